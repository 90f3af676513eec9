#!/usr/bin/env python
"""Where a grid chunk's GEMM time goes: every projection of a preset at the chunk's row count, timed alone
through cuBLAS (what the fast path runs), through cuBLASLt and through qse's own GEMM (the grid-invariant one), with the
weights cold in L2 as in a chunk (each call reads another copy of the weight), TFLOP/s, and the sum over a
chunk's layers against the profiler's GEMM total.

    python benchmarks/gemm_shapes.py [--preset qwen3.5-0.8b] [--rows 512] [--out DIR]

Writes benchmarks/results/gemm_shapes-<date>-<device>.json.
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
from benchmarks.timing import cuda_us  # noqa: E402
from qse.models.qwen3_5.config import parse_config  # noqa: E402
from qse.models.qwen3_5.presets import preset_config_dict  # noqa: E402
from qse_kernels.gemm import dense_matmul  # noqa: E402

COLD_BYTES = 256 << 20  # weight copies enough to pass through the H200's 60 MB of L2 between two uses


def chunk_projections(cfg) -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses a chunk) of the fast path's fused projections (see the model: one GEMM a layer
    input, as views of one weight)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    kdim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vdim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    linear_layers = sum(1 for kind in cfg.layer_types if kind == "linear_attention")
    full_layers = cfg.num_hidden_layers - linear_layers
    qdim = cfg.num_attention_heads * cfg.head_dim
    kvdim = cfg.num_key_value_heads * cfg.head_dim
    return [
        ("gdn_in_proj (qkv, z, b, a)", 2 * kdim + 2 * vdim + 2 * cfg.linear_num_value_heads, hidden, linear_layers),
        ("gdn_out_proj", hidden, vdim, linear_layers),
        ("attn_qkv (q, gate, k, v)", 2 * qdim + 2 * kvdim, hidden, full_layers),
        ("attn_o_proj", hidden, qdim, full_layers),
        ("mlp_gate_up", 2 * inter, hidden, cfg.num_hidden_layers),
        ("mlp_down", hidden, inter, cfg.num_hidden_layers),
    ]


def time_cold(fn_of_weight, weights) -> float:
    """Microseconds a call, each call on the next weight copy (graphed, so launch gaps stay out)."""
    # a graph replays the copies in the order captured: one call a copy
    def all_copies():
        for w in weights:
            fn_of_weight(w)

    return cuda_us(all_copies, reps=2, graphed=True) / len(weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows must be at least 1; got {args.rows}")
    cfg = parse_config(preset_config_dict(args.preset), where=f"preset {args.preset}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, max(k for _, _, k, _ in chunk_projections(cfg)), device="cuda", generator=gen).bfloat16()
    rows, total = [], {"cublas_us": 0.0, "qse_gemm_us": 0.0, "gflop": 0.0}
    for name, n, k, uses in chunk_projections(cfg):
        copies = max(2, COLD_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
        xk = x[:, :k].contiguous()
        flop = 2 * args.rows * n * k
        cublas = time_cold(lambda w: F.linear(xk, w), weights)
        ours = time_cold(lambda w: dense_matmul(xk, w), weights)
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the same call through cuBLASLt's heuristics
        lt = time_cold(lambda w: F.linear(xk, w), weights)
        torch.backends.cuda.preferred_blas_library("cublas")
        row = {"name": name, "N": n, "K": k, "uses_a_chunk": uses, "cublas_us": round(cublas, 2),
               "cublas_tflop_s": round(flop / cublas / 1e6, 1), "qse_gemm_us": round(ours, 2),
               "qse_gemm_tflop_s": round(flop / ours / 1e6, 1), "cublaslt_us": round(lt, 2),
               "cublaslt_tflop_s": round(flop / lt / 1e6, 1), "chunk_share_cublas_ms": round(cublas * uses / 1000, 3)}
        rows.append(row)
        total["cublas_us"] += cublas * uses
        total["qse_gemm_us"] += ours * uses
        total["gflop"] += flop * uses / 1e9
        print(json.dumps(row), flush=True)
        del weights
    total = {"cublas_ms": round(total["cublas_us"] / 1000, 3), "qse_gemm_ms": round(total["qse_gemm_us"] / 1000, 3),
             "gflop": round(total["gflop"], 1),
             "cublas_tflop_s": round(total["gflop"] / total["cublas_us"] * 1e3, 1)}
    result = {**result_header("triton"), "preset": args.preset,
              "rows": args.rows, "projections": rows, "chunk_total": total}
    print(json.dumps(total))
    write_result(result, args.out, "gemm_shapes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
