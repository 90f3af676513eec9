#!/usr/bin/env python
"""FP8 block weights against BF16 at the 9B served model's projection shapes, on one GPU: a decode step's one
row (qse's FP8 GEMV against cuBLAS and qse's BF16 GEMV) and a 512-row grid chunk (qse's FP8 GEMM against
cuBLAS BF16), with the dequantise-every-call path FP8 weights took before for context. One-row calls replay 200
times inside one CUDA graph (launch gaps out of the figure); chunk calls are timed eagerly.

    python benchmarks/fp8_bench.py [--out DIR]
    python benchmarks/fp8_bench.py --tiny --out DIR     (CPU, interpreted kernels, small shapes: a smoke run)

Writes benchmarks/results/fp8_bench-<date>-<device>.json: us a call, the weight bandwidth one row reached
(TB/s), the chunk's TFLOP/s, FP8 over BF16, and each FP8 result's largest difference from its naive twin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import cuda_us, kernel_bench_args, wall_us  # noqa: E402

# (name, N, K): the 9B's projections one by one (an FP8 checkpoint's members are not fused), and the head
SHAPES_9B = [("gdn_in_proj_qkv", 8192, 4096), ("gdn_in_proj_z", 4096, 4096), ("gdn_out_proj", 4096, 4096),
             ("attn_q_gate", 8192, 4096), ("attn_k", 1024, 4096), ("attn_o", 4096, 4096), ("mlp_gate", 12288, 4096),
             ("mlp_down", 4096, 12288)]
SHAPES_TINY = [("tiny_up", 256, 128), ("tiny_down", 128, 256)]
CHUNK_ROWS, CHUNK_ROWS_TINY = 512, 64


def _timer(device: str):
    """us a call of fn: on CUDA graphed (200 calls) or eager (20); on the CPU (the smoke run) the wall clock."""
    if device == "cuda":
        return lambda fn, graphed: cuda_us(fn, 200 if graphed else 20, graphed=graphed, tries=5)
    return lambda fn, graphed: wall_us(fn)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    args, device = kernel_bench_args(argparse.ArgumentParser(), argv)
    from qse.models.linear import quantize_fp8_block
    from qse_kernels import fp8, naive
    from qse_kernels.gemv import gemv

    time_us = _timer(device)
    dtype = torch.bfloat16
    shapes, chunk_rows = (SHAPES_TINY, CHUNK_ROWS_TINY) if args.tiny else (SHAPES_9B, CHUNK_ROWS)
    rows = []
    for name, n, k in shapes:
        gen = torch.Generator().manual_seed(n * 7 + k)
        dense = (torch.randn(n, k, generator=gen) * k ** -0.5)
        w8, scale = (t.to(device) for t in quantize_fp8_block(dense))
        w16 = dense.to(device, dtype)
        x1 = torch.randn(1, k, generator=gen).to(device, dtype)
        xc = torch.randn(chunk_rows, k, generator=gen).to(device, dtype)
        row = {"name": name, "N": n, "K": k, "chunk_rows": chunk_rows}
        # one row (decode)
        row["bf16_cublas_row_us"] = time_us(lambda: F.linear(x1, w16), True)
        row["bf16_gemv_row_us"] = time_us(lambda: gemv(x1, w16), True)
        row["fp8_gemv_row_us"] = time_us(lambda: fp8.fp8_gemv(x1, w8, scale), True)
        row["fp8_dequant_row_us"] = time_us(lambda: F.linear(x1, naive.fp8_dequantize(w8, scale).to(dtype)), True)
        # a grid chunk (prefill, reading)
        row["bf16_cublas_chunk_us"] = time_us(lambda: F.linear(xc, w16), False)
        row["fp8_gemm_chunk_us"] = time_us(lambda: fp8.fp8_gemm(xc, w8, scale), False)
        row["fp8_dequant_chunk_us"] = time_us(lambda: F.linear(xc, naive.fp8_dequantize(w8, scale).to(dtype)), False)
        # against the twins: the GEMV equals its twin bit for bit (unfused); the GEMM to the tensor cores' rounding
        row["fp8_gemv_equals_twin"] = bool(torch.equal(fp8.fp8_gemv(x1, w8, scale), naive.fp8_block_gemv(x1, w8, scale)))
        row["fp8_gemm_rel_diff_twin"] = _rel(fp8.fp8_gemm(xc, w8, scale), naive.fp8_block_gemm(xc, w8, scale))
        row["fp8_vs_bf16_rel_diff"] = _rel(fp8.fp8_gemm(xc, w8, scale), F.linear(xc, w16))
        for key in [k_ for k_ in row if k_.endswith("_us")]:
            row[key] = round(row[key], 2)
        row["bf16_row_tb_s"] = round(n * k * 2 / (min(row["bf16_cublas_row_us"], row["bf16_gemv_row_us"]) * 1e-6) / 1e12, 3)
        row["fp8_row_tb_s"] = round((n * k + scale.numel() * 4) / (row["fp8_gemv_row_us"] * 1e-6) / 1e12, 3)
        row["fp8_over_bf16_row"] = round(row["fp8_gemv_row_us"] / min(row["bf16_cublas_row_us"], row["bf16_gemv_row_us"]), 3)
        row["fp8_over_bf16_chunk"] = round(row["fp8_gemm_chunk_us"] / row["bf16_cublas_chunk_us"], 3)
        row["fp8_chunk_tflop_s"] = round(2 * chunk_rows * n * k / (row["fp8_gemm_chunk_us"] * 1e-6) / 1e12, 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {**result_header("triton", device="cpu (interpreted)" if args.tiny else None), "rows": rows}
    write_result(result, args.out, "fp8_bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
