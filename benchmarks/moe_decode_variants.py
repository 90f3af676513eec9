#!/usr/bin/env python
"""Where a decode token's MoE block loses its time: the pairs path's gate_up and down (qse_kernels/moe.py) at
T = 1, at the 35B-A3B shapes, against the same bytes read in other patterns, on one GPU.

At T = 1 the pairs gate_up (144 programs of 16 K steps) and down (576 programs of 4) stream at ~2.3 TB/s on the
H200 and on the H100 alike (benchmarks/NOTES.md), against a device copy's ~4.2 / ~3.0 TB/s. The SMs' balance is
not why (the twenty-sixth session: the K split dealt evenly over the SMs, moe_decode_variants-2026-12-07-h100.json,
was no faster); neither were the pipeline's depth, the tiles' widths or the warps (moe_block_bench's sweeps).
What is left is the access pattern: a program's K step reads each of its BN weight rows in a run of BK * 2
bytes (256 B) with a row's next run 4 KB away, and its tile's rows are 4 KB apart. The variants:

- stream_{canon,tiled}_n{BN}_k{BK}_st{S}: the gate_up's or the down's tile walk (one program a pair and BN
  columns, K in BK steps) with the loads alone (each tile times a constant block: no x loads, no activation,
  the loads pipelined as the production kernels' are), from the checkpoint's layout (canon) or a tile-major
  copy of it (tiled: each (BN, BK) tile's bytes contiguous, tiles in the order a program reads them). Tells
  what the pattern alone streams at.
- gemv_gate_up_bytes: the same byte count through the decode GEMV (qse_kernels/gemv.py), one contiguous matrix.
- gate_up_{canon,tiled}_st{S}, down_{canon,tiled}_st{S}, block_pairs_{canon,tiled}: the production kernels
  (moe.TILE_WEIGHTS's path: tiles=True on weights laid out by moe.to_tiles_) reading either layout, checked bit
  for bit against the row-major weights' h, y and block output; canon at stages 3 is today's decode kernels.

Times are CUDA events over a graph of back-to-back calls rotating among weight copies and inputs (as
moe_block_bench's); the byte count a call reads is in the result (nbytes), with the device's copy rate.

    python benchmarks/moe_decode_variants.py [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__" and "--tiny" in sys.argv:  # the interpreter, before any kernel below is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.moe_block_bench import NUM_COPIES, SHAPE_35B, draw_block, hbm_tbps  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import graph_us, kernel_bench_args, wall_us  # noqa: E402
from qse_kernels import gemv, moe, pdl  # noqa: E402

CALLS = 16


def tile_major(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """A copy of w [..., R, K] laid out in [bn, bk] tiles (moe.to_tiles_'s layout, at any tile)."""
    out = w.clone()
    moe._relayout_(out, bn, bk, True)
    return out


@triton.jit
def _expert_weights(w_ptr, ws_ptr, ids_ptr, num_routed, stride_we):
    """Program 0's pair's expert weights: a routed pair's (its expert from ids) or, past them, the shared one's."""
    i_p = tl.program_id(0)
    if i_p < num_routed:
        return w_ptr + tl.load(ids_ptr + i_p).to(tl.int64) * stride_we
    return ws_ptr


@triton.jit
def _stream_kernel(w_ptr, ws_ptr, ids_ptr, out_ptr, num_routed, width, depth, stride_we, BN: tl.constexpr,
                   BK: tl.constexpr, HALVES: tl.constexpr, TILED: tl.constexpr):
    """A pair's BN rows (of each half: gate and up) read in BK steps, each tile multiplied by a constant row
    block (no x to load, no activation): a tile product, so that Triton pipelines the loads as it does the
    production kernels' (loads summed elementwise are not pipelined: their latency would be the measure)."""
    p_w = _expert_weights(w_ptr, ws_ptr, ids_ptr, num_routed, stride_we)
    n0 = tl.program_id(1) * BN
    ones = tl.full((16, BK), 1.0, w_ptr.dtype.element_ty)
    acc = tl.zeros((16, BN), tl.float32)
    every = tl.full((BN,), 1, tl.int1)
    for k0 in range(0, depth, BK):
        whole = tl.full((BK,), 1, tl.int1)
        acc = tl.dot(ones, tl.trans(moe._weight_tile(p_w, n0, k0, depth, every, whole, BN, BK, TILED)), acc)
        if HALVES == 2:
            b_u = moe._weight_tile(p_w + width * depth, n0, k0, depth, every, whole, BN, BK, TILED)
            acc = tl.dot(ones, tl.trans(b_u), acc)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


def stream(w, ws, ids, halves, bn, bk, tiled, stages):
    """_stream_kernel over the k routed pairs and the shared expert: w [E, halves * width, depth]."""
    width, depth = w.shape[1] // halves, w.shape[2]
    out = torch.empty(ids.numel() + 1, width // bn, dtype=torch.float32, device=w.device)
    _stream_kernel[(ids.numel() + 1, width // bn)](w, ws, ids, out, ids.numel(), width, depth, w.stride(0), BN=bn,
                                                  BK=bk, HALVES=halves, TILED=tiled, num_warps=moe.NUM_WARPS,
                                                  num_stages=stages)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, device = kernel_bench_args(p, argv)
    tiny = args.tiny
    # the interpreter: shapes that the pinned tiles divide, the flow only
    shape = dict(hidden=256, num_experts=4, top_k=2, inter=128, inter_s=128) if tiny else SHAPE_35B
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    top_k = shape["top_k"]
    num_copies, calls = (1, 1) if tiny else (NUM_COPIES, CALLS)
    copies = [draw_block(shape, device, dtype, seed) for seed in range(num_copies)]
    gen = torch.Generator(device=device).manual_seed(7)
    xs = [torch.randn(1, shape["hidden"], generator=gen, device=device).to(dtype) for _ in range(calls)]
    routes = []  # each call's pairs' experts (int32), the production h and the logits
    for i, x in enumerate(xs):
        w = copies[i % num_copies]
        logits = moe._router(x, w["router_w"], w["shared_gate_w"])
        ids, _, h = moe._direct_gate_up(x, logits, w["gate_up"], (w["shared_gate_up"], w["shared_down"]), top_k,
                                        route_first=True)
        routes.append((ids, h, logits))
    time_us = (lambda fns: wall_us(fns[0], warm=False)) if device != "cuda" else (lambda fns: graph_us(fns))

    def timed(name, fn, check=None):
        fns = [lambda i=i: fn(i) for i in range(calls)]
        row = {"variant": name, "us": round(time_us(fns), 2)}
        if check is not None:
            row.update(check(fn(0)))
        print(json.dumps(row), flush=True)
        return row

    gbn, gbk, dbn, dbk = moe.GATE_UP_BLOCK_N, moe.GATE_UP_BLOCK_K, moe.DOWN_BLOCK_N, moe.DOWN_BLOCK_K
    tiles = {"gate_up": ((gbn, gbk), (gbn, 2 * gbk), (gbn // 2, 2 * gbk)), "down": ((dbn, dbk),)}
    layouts = {}  # (name, bn, bk, tiled) -> per copy (w, ws)
    for c in copies:
        for name, key_w, key_ws in (("gate_up", "gate_up", "shared_gate_up"), ("down", "down", "shared_down")):
            for bn, bk in tiles[name]:
                layouts.setdefault((name, bn, bk, False), []).append((c[key_w], c[key_ws]))
                layouts.setdefault((name, bn, bk, True), []).append(
                    (tile_major(c[key_w], bn, bk), tile_major(c[key_ws][None], bn, bk)[0]))
    w0 = copies[0]
    ids0, h0, _ = routes[0]
    y0 = moe._pairs_down(h0, ids0, w0["down"], w0["shared_down"], 1, top_k)
    rows = []
    stages_grid = (3,) if tiny else (3, 5)
    for name, halves in (("gate_up", 2), ("down", 1)):
        for bn, bk in tiles[name]:
            for tiled in (False, True):
                for st in stages_grid:
                    ws = layouts[(name, bn, bk, tiled)]
                    rows.append(timed(f"stream_{name}_{'tiled' if tiled else 'canon'}_n{bn}_k{bk}_st{st}",
                                      lambda i, ws=ws, bn=bn, bk=bk, t=tiled, st=st: stream(
                                          *ws[i % num_copies], routes[i][0], halves, bn, bk, t, st)))
    # the same bytes as the gate_up's through the decode GEMV (qse_kernels/gemv.py: many short programs, BK
    # 256): what a plain one-row projection streams them at on this device
    rows_gu = (top_k + 1) * 2 * shape["inter"]
    flat = [torch.randn(rows_gu, shape["hidden"], generator=gen, device=device).to(dtype) for _ in range(num_copies)]
    rows.append(timed("gemv_gate_up_bytes", lambda i: gemv.gemv(xs[i], flat[i % num_copies])))
    # the production kernels (moe.TILE_WEIGHTS's path) on the tile-major copies, the gate_up and the down alone at
    # two pipeline depths, then the whole pairs block, each against the row-major weights' bits
    tiled_copies = []
    for c in copies:
        t = {k: v.clone() for k, v in c.items()}
        moe.to_tiles_(t["gate_up"], t["down"], t["shared_gate_up"], t["shared_down"])
        tiled_copies.append(t)
    for st in stages_grid:
        saved, moe.DIRECT_GATE_UP_STAGES = moe.DIRECT_GATE_UP_STAGES, st
        try:
            for tag, ws, tiles in (("canon", copies, False), ("tiled", tiled_copies, True)):
                rows.append(timed(f"gate_up_{tag}_st{st}", lambda i, ws=ws, t=tiles: moe._direct_gate_up(
                    xs[i], routes[i][2], ws[i % num_copies]["gate_up"], (ws[i % num_copies]["shared_gate_up"], None),
                    top_k, tiles=t), lambda out: {"h_bit_equal": bool(torch.equal(out[2], h0))}))
                rows.append(timed(f"down_{tag}_st{st}", lambda i, ws=ws, t=tiles, st=st: moe._pairs_down(
                    routes[i][1], routes[i][0], ws[i % num_copies]["down"], ws[i % num_copies]["shared_down"], 1,
                    top_k, t, st), lambda y: {"y_bit_equal": bool(torch.equal(y, y0))}))
        finally:
            moe.DIRECT_GATE_UP_STAGES = saved
    out0 = moe.moe_block(xs[0], **w0, top_k=top_k, path="pairs")
    for tag, ws, tiles in (("canon", copies, False), ("tiled", tiled_copies, True)):
        rows.append(timed(f"block_pairs_{tag}", lambda i, ws=ws, t=tiles: moe.moe_block(
            xs[i], **ws[i % num_copies], top_k=top_k, path="pairs", tiles=t),
            lambda out: {"out_bit_equal": bool(torch.equal(out, out0))}))
    nbytes = {"gate_up": (top_k + 1) * 2 * shape["inter"] * shape["hidden"] * dtype.itemsize,
              "down": (top_k + 1) * shape["hidden"] * shape["inter"] * dtype.itemsize}
    tbps = hbm_tbps(device)
    result = {**result_header("triton", device="cpu (interpreted)" if tiny else None), "shape": shape,
              "num_tokens": 1, "weight_copies": num_copies, "calls_a_graph": calls, "nbytes": nbytes,
              "copy_tbps": tbps and round(tbps, 3), "pdl": pdl.active(), "rows": rows}
    write_result(result, args.out, "moe_decode_variants")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
