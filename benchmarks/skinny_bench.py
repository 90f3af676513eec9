#!/usr/bin/env python
"""A few rows through the 9B served model's projections and head, on one GPU: qse's skinny GEMM
(qse_kernels/skinny.py) against cuBLAS (F.linear; torch.mm with an fp32 output for the head), and qse's
one-row GEMV at one row; device time by CUDA events over a CUDA graph of back-to-back calls that rotate
among copies of the weight (together several times the L2), so every call streams its weight from memory
as a forward's layers do.

    python benchmarks/skinny_bench.py [--out DIR] [--sweep]
    python benchmarks/skinny_bench.py --tiny --out DIR      (CPU, interpreted kernels, small shapes: the flow only)

--sweep also times each candidate tiling (CANDIDATES) at SWEEP_ROWS rows: what `skinny.tiles` is pinned from.
Writes benchmarks/results/skinny_bench-<date>-<device>.json: per shape and M, us a call and GB/s (the weight,
x and y once each) for every implementation; the skinny result's largest difference from an fp32 reference;
and whether its rows are the same bits whatever M is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import graph_us, kernel_bench_args, wall_us  # noqa: E402

# (name, N, K): the 9B's fused projections of one layer (qse/models/qwen3_5/model.py FUSED_PROJECTIONS over
# layout.expected_shapes) and the head, whose output is fp32
SHAPES_9B = [("gdn_in_proj", 12352, 4096), ("gdn_out_proj", 4096, 4096), ("attn_qkv", 10240, 4096),
             ("attn_o", 4096, 4096), ("mlp_gate_up", 24576, 4096), ("mlp_down", 4096, 12288), ("head", 248320, 4096)]
LAYERS_9B = {"gdn_in_proj": 24, "gdn_out_proj": 24, "attn_qkv": 8, "attn_o": 8, "mlp_gate_up": 32, "mlp_down": 32,
             "head": 1}  # how many of each a forward runs (24 GDN layers, 8 attention, 32 MLPs)
SHAPES_TINY = [("tiny_proj", 96, 64), ("tiny_head", 200, 64)]
ROWS, ROWS_TINY = (1, 2, 4, 8, 16, 24, 32), (1, 2, 5)  # 17..32: the 32-row tile (a verify of 8 x 4)
SWEEP_ROWS = (2, 4, 8, 16)
ROTATE_BYTES = 512 << 20  # the weight copies a timing rotates among, together (the H200's L2 is 50 MB)
MIN_CALLS = 24  # calls in a timed graph
TRIES = 7


def candidates():
    from qse_kernels.skinny import Tiles

    # name: (BN, BK, splits, warps, stages[, swap_ab])
    table = {
        "n32k128s4": (32, 128, 1, 4, 4), "n32k256s4": (32, 256, 1, 4, 4), "n64k128s4": (64, 128, 1, 4, 4),
        "swap64k128s4": (64, 128, 1, 4, 4, True), "swap128k128s3": (128, 128, 1, 4, 3, True),
        "swap128k128s4": (128, 128, 1, 4, 4, True),
        "n64k256x2": (64, 256, 2, 4, 3), "swap64k128x2": (64, 128, 2, 4, 4, True),
        "swap64k256x2": (64, 256, 2, 4, 3, True), "swap64k256x4": (64, 256, 4, 4, 3, True),
        "swap128k128x4": (128, 128, 4, 4, 3, True),
    }
    return {name: Tiles(*cfg) for name, cfg in table.items()}


def _timer(device: str):
    """us a call of fns[i % len(fns)], i = 0.. (each fn reads its own copy of the weight); on the CPU (the flow
    check) the wall clock of fns[0]."""
    if device != "cuda":
        return lambda fns: wall_us(fns[0])
    return lambda fns: graph_us(fns, len(fns) * math.ceil(MIN_CALLS / len(fns)), TRIES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time every candidate tiling at SWEEP_ROWS rows")
    p.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    args, device = kernel_bench_args(p, argv)
    from qse_kernels import skinny
    from qse_kernels.gemv import gemv

    time_us = _timer(device)
    dtype = torch.bfloat16
    shapes, all_rows = (SHAPES_TINY, ROWS_TINY) if args.tiny else (SHAPES_9B, ROWS)
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    sweep = candidates() if args.sweep else {}
    rows, sweeps = [], []
    for name, n, k in shapes:
        is_head = name.endswith("head")
        out_dtype = torch.float32 if is_head else dtype
        w_nbytes = n * k * dtype.itemsize
        num_copies = 1 if args.tiny else max(2, math.ceil(ROTATE_BYTES / w_nbytes))
        gen = torch.Generator(device=device).manual_seed(n * 31 + k)  # drawn where they are used: the head is 1G values
        w0 = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)
        copies = [w0] + [w0.clone() for _ in range(num_copies - 1)]
        x16 = torch.randn(max(all_rows + SWEEP_ROWS), k, generator=gen, device=device).to(dtype)
        xs = {m: x16[:m] for m in {*all_rows, *SWEEP_ROWS}}
        ref16 = (x16.double() @ w0.double().t()).float()  # (fp64 products and sums: the rounding's yardstick)
        pinned = skinny.tiles(n, k)

        def cublas(x, w):  # the model's own calls (Qwen35Model._logits for the head)
            if not is_head:
                return F.linear(x, w)
            if device == "cuda":
                return torch.mm(x, w.t(), out_dtype=torch.float32)
            return F.linear(x.float(), w.float())  # (the CPU's mm has no bf16 -> fp32 form)

        def gbps(m, us):
            return round((w_nbytes + m * k * dtype.itemsize + m * n * out_dtype.itemsize) / (us * 1e-6) / 1e9, 1)

        def timed(fn, m):
            return time_us([lambda w=w: fn(xs[m], w) for w in copies])

        for m in all_rows:
            row = {"name": name, "N": n, "K": k, "M": m, "weight_copies": num_copies}
            row["cublas_us"] = timed(cublas, m)
            row["skinny_us"] = timed(lambda x, w: skinny.skinny_matmul(x, w, out_dtype), m)
            if m == 1:
                row["gemv_us"] = timed(lambda x, w: gemv(x, w, out_dtype), m)
            for key in [key for key in row if key.endswith("_us")]:
                row[key.replace("_us", "_gb_s")] = gbps(m, row[key])
                row[key] = round(row[key], 2)
            row["skinny_over_cublas"] = round(row["skinny_us"] / row["cublas_us"], 3)
            got = skinny.skinny_matmul(xs[m], w0, out_dtype).float()
            row["skinny_rel_diff"] = float((got - ref16[:m]).abs().max() / ref16[:m].abs().max())
            print(json.dumps(row), flush=True)
            rows.append(row)
        # a row's bits whatever M: the rows of a 5-row call against the same rows inside every other call
        five = skinny.skinny_matmul(x16[:5], w0, out_dtype)
        invariant = all(torch.equal(skinny.skinny_matmul(x16[:m], w0, out_dtype)[: min(m, 5)], five[: min(m, 5)])
                        for m in all_rows)
        rows.append({"name": name, "N": n, "K": k, "tiles": pinned._asdict(), "rows_invariant": invariant})
        print(json.dumps(rows[-1]), flush=True)
        for cand, cfg in sweep.items():
            if cfg.splits > 1 and n >= 16384:  # a split pays only where N leaves SMs idle
                continue
            entry = {"name": name, "N": n, "K": k, "candidate": cand, "tiles": cfg._asdict()}
            try:
                for m in SWEEP_ROWS:
                    us = timed(lambda x, w, cfg=cfg: skinny.skinny_matmul(x, w, out_dtype, launch=cfg), m)
                    entry[f"us_m{m}"], entry[f"gb_s_m{m}"] = round(us, 2), gbps(m, us)
                y16 = skinny.skinny_matmul(x16, w0, out_dtype, launch=cfg)
                entry["rel_diff_m16"] = float((y16.float() - ref16).abs().max() / ref16.abs().max())
                entry["rows_invariant"] = all(torch.equal(skinny.skinny_matmul(x16[:m], w0, out_dtype, launch=cfg),
                                                          y16[:m]) for m in (1, 2, 5))
            except Exception as exc:  # noqa: BLE001 - a tiling the compiler refuses (shared memory) is recorded
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(json.dumps(entry), flush=True)
            sweeps.append(entry)
        copies, w0 = [], None  # (freed before the next shape allocates its own)
        if device == "cuda":
            torch.cuda.empty_cache()
    # a forward's projections at M rows (the counts of LAYERS_9B), with the head and without it (a forward of
    # several rows takes the model's own fp32 head, not dense_matmul)
    forward = []
    for m in all_rows:
        at_m = [r for r in rows if r.get("M") == m and r["name"] in LAYERS_9B]
        if not at_m:
            continue
        entry = {"M": m}
        for impl in ("cublas", "skinny", "gemv"):
            if all(f"{impl}_us" in r for r in at_m):
                total = sum(LAYERS_9B[r["name"]] * r[f"{impl}_us"] for r in at_m)
                head = sum(r[f"{impl}_us"] for r in at_m if r["name"] == "head")
                entry[f"{impl}_ms"], entry[f"{impl}_no_head_ms"] = round(total / 1e3, 4), round((total - head) / 1e3, 4)
        forward.append(entry)
        print(json.dumps({"forward": entry}), flush=True)
    result = {**result_header("triton", device="cpu (interpreted)" if args.tiny else None),
              "rotate_bytes": ROTATE_BYTES, "calls_a_graph": MIN_CALLS, "tries": TRIES, "rows": rows,
              "forward_9b": forward,
              "sweep": sweeps}
    write_result(result, args.out, "skinny_bench")
    print(f"{'shape':<14}{'M':>3}{'cublas GB/s':>13}{'skinny GB/s':>13}{'gemv GB/s':>11}{'x cublas':>10}")
    for r in rows:
        if "M" in r:
            print(f"{r['name']:<14}{r['M']:>3}{r['cublas_gb_s']:>13}{r['skinny_gb_s']:>13}"
                  f"{r.get('gemv_gb_s', ''):>11}{r['skinny_over_cublas']:>10}")
    for name in dict.fromkeys(e["name"] for e in sweeps):  # each shape's fastest candidates at 16 rows
        ranked = sorted((e for e in sweeps if e["name"] == name and "us_m16" in e), key=lambda e: e["us_m16"])
        best = [f"{e['candidate']}:" + "/".join(str(e[f"gb_s_m{m}"]) for m in SWEEP_ROWS) for e in ranked[:5]]
        print(name, " ".join(best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
