#!/usr/bin/env python
"""One-row projections (a decode step's GEMMs and the logits head) timed three ways on one GPU: cuBLAS
through F.linear, cuBLAS with an fp32 output (the head), and qse's Triton GEMV; for the 0.8B reader's
shapes and the 9B served model's. Each call is replayed 200 times inside one CUDA graph so that launch
gaps stay out of the figure.

    python benchmarks/gemv_bench.py [--out DIR]

Writes benchmarks/results/gemv_bench-<date>-<device>.json (us a call and the bandwidth it reached).
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
from qse_kernels.gemv import gemv  # noqa: E402

# (name, N, K): the fused projections of one layer, and the head
SHAPES = {
    "0.8b": [("gdn_in_proj", 8224, 1024), ("gdn_out_proj", 1024, 2048), ("attn_qkv", 5120, 1024), ("attn_o", 1024, 2048),
             ("mlp_gate_up", 7168, 1024), ("mlp_down", 1024, 3584), ("head", 248320, 1024)],
    "9b": [("gdn_in_proj", 20544, 4096), ("gdn_out_proj", 4096, 4096), ("attn_qkv", 10240, 4096), ("attn_o", 4096, 4096),
           ("mlp_gate_up", 24576, 4096), ("mlp_down", 4096, 12288), ("head", 248320, 4096)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    rows = []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out_fp32 = name == "head"
            gbytes = n * k * 2 / 1e9
            row = {"model": model, "name": name, "N": n, "K": k}
            if out_fp32:
                row["cublas_us"] = cuda_us(lambda: torch.mm(x, w.t(), out_dtype=torch.float32), 200, graphed=True, tries=5)
                row["triton_gemv_us"] = cuda_us(lambda: gemv(x, w, torch.float32), 200, graphed=True, tries=5)
                ref = torch.mm(x, w.t(), out_dtype=torch.float32)
                got = gemv(x, w, torch.float32)
            else:
                row["cublas_us"] = cuda_us(lambda: F.linear(x, w), 200, graphed=True, tries=5)
                row["triton_gemv_us"] = cuda_us(lambda: gemv(x, w), 200, graphed=True, tries=5)
                ref, got = F.linear(x, w).float(), gemv(x, w).float()
            row["max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
            for key in ("cublas", "triton_gemv"):
                row[f"{key}_tb_s"] = round(gbytes / (row[f"{key}_us"] * 1e-6) / 1e3, 3)
                row[f"{key}_us"] = round(row[f"{key}_us"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {**result_header("triton"), "rows": rows}
    write_result(result, args.out, "gemv_bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
