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
  columns, K in BK steps) with loads only (each tile summed into fp32 lanes, no products), from the checkpoint's
  layout (canon) or a tile-major copy of it (tiled: each (BN, BK) tile's bytes contiguous, tiles in the order a
  program reads them). Tells what the pattern alone streams at.
- gemv_gate_up_bytes: the same byte count through the decode GEMV (qse_kernels/gemv.py), one contiguous matrix.
- gate_up_{canon,tiled}_st{S}, down_{canon,tiled}_st{S}: the pairs path's gate_up and down (the same tile
  products, the same rounding: bit-equal to the production kernels' h and y) reading either layout.

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
    """w [E, R, K] with each (bn, bk) tile's bytes contiguous, tiles row block by row block and K step by K step
    (the order one program reads them): element (r, k) at ((r // bn) * (K // bk) + k // bk) * bn * bk + (r % bn)
    * bk + k % bk of its expert, so a tile at (n0, k0) starts at n0 * K + k0 * bn."""
    num, rows, depth = w.shape
    return (w.reshape(num, rows // bn, bn, depth // bk, bk).permute(0, 1, 3, 2, 4).contiguous()
            .reshape(num, rows, depth))


@triton.jit
def _tile_offsets(n0, k0, depth, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr):
    """[BN, BK] element offsets of the tile at rows n0.., columns k0.. of a [R, depth] matrix (tile_major's
    layout when TILED)."""
    o_r = tl.arange(0, BN)
    o_c = tl.arange(0, BK)
    if TILED:
        return n0 * depth + k0 * BN + o_r[:, None] * BK + o_c[None, :]
    return (n0 + o_r[:, None]) * depth + k0 + o_c[None, :]


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
    """A pair's BN rows (of each half: gate and up) read in BK steps and summed, no products."""
    p_w = _expert_weights(w_ptr, ws_ptr, ids_ptr, num_routed, stride_we)
    n0 = tl.program_id(1) * BN
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, depth, BK):
        off = _tile_offsets(n0, k0, depth, BN, BK, TILED)
        acc += tl.load(p_w + off).to(tl.float32)
        if HALVES == 2:
            acc += tl.load(p_w + width * depth + off).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _gate_up_probe_kernel(x_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, num_routed, inter, hidden, stride_we, stride_h,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr,
                          ROW_EXACT: tl.constexpr, IEEE: tl.constexpr):
    """The pairs gate_up at T = 1 (each pair the token's row 0 of its tile), as moe._gate_up_kernel computes it."""
    p_w = _expert_weights(w_ptr, ws_ptr, ids_ptr, num_routed, stride_we)
    n0 = tl.program_id(1) * BN
    o_m = tl.arange(0, BM)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, hidden, BK):
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(x_ptr + o_m[:, None] * 0 + o_k[None, :], mask=(o_m == 0)[:, None], other=0.0)
        off = _tile_offsets(n0, k0, hidden, BN, BK, TILED)
        acc_g = moe._dot_acc(acc_g, b_x, tl.load(p_w + off), ROW_EXACT, IEEE)
        acc_u = moe._dot_acc(acc_u, b_x, tl.load(p_w + inter * hidden + off), ROW_EXACT, IEEE)
    dt = h_ptr.dtype.element_ty
    b_g = acc_g.to(dt).to(tl.float32)
    b_act = (b_g * tl.sigmoid(b_g)).to(dt)
    b_h = b_act.to(tl.float32) * acc_u.to(dt).to(tl.float32)
    o_n = n0 + tl.arange(0, BN)
    tl.store(h_ptr + tl.program_id(0) * stride_h + o_m[:, None] * 0 + o_n[None, :], b_h.to(dt),
             mask=(o_m == 0)[:, None])


@triton.jit
def _down_probe_kernel(h_ptr, w_ptr, ws_ptr, ids_ptr, y_ptr, num_routed, inter, stride_we, stride_h, stride_y,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr,
                       ROW_EXACT: tl.constexpr, IEEE: tl.constexpr):
    """The pairs down at T = 1, as moe._down_kernel computes it: y[pair] = h[pair] @ down_e^T, BN columns."""
    p_w = _expert_weights(w_ptr, ws_ptr, ids_ptr, num_routed, stride_we)
    n0 = tl.program_id(1) * BN
    o_m = tl.arange(0, BM)
    row = tl.program_id(0) + o_m * 0
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, inter, BK):
        o_k = k0 + tl.arange(0, BK)
        b_h = tl.load(h_ptr + row[:, None] * stride_h + o_k[None, :], mask=(o_m == 0)[:, None], other=0.0)
        acc = moe._dot_acc(acc, b_h, tl.load(p_w + _tile_offsets(n0, k0, inter, BN, BK, TILED)), ROW_EXACT, IEEE)
    o_n = n0 + tl.arange(0, BN)
    tl.store(y_ptr + row[:, None] * stride_y + o_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=(o_m == 0)[:, None])


def stream(w, ws, ids, halves, bn, bk, tiled, stages):
    """_stream_kernel over the k routed pairs and the shared expert: w [E, halves * width, depth]."""
    width, depth = w.shape[1] // halves, w.shape[2]
    out = torch.empty(ids.numel() + 1, width // bn, dtype=torch.float32, device=w.device)
    _stream_kernel[(ids.numel() + 1, width // bn)](w, ws, ids, out, ids.numel(), width, depth, w.stride(0), BN=bn,
                                                  BK=bk, HALVES=halves, TILED=tiled, num_warps=moe.NUM_WARPS,
                                                  num_stages=stages)
    return out


def gate_up_probe(x, w, ws, ids, tiled, stages):
    inter, hidden = w.shape[1] // 2, w.shape[2]
    h = torch.empty(ids.numel() + 1, inter, dtype=x.dtype, device=x.device)
    bn, bk = moe.GATE_UP_BLOCK_N, moe.GATE_UP_BLOCK_K
    flags = moe._dot_flags(x.dtype)
    _gate_up_probe_kernel[(ids.numel() + 1, inter // bn)](
        x, w, ws, ids, h, ids.numel(), inter, hidden, w.stride(0), h.stride(0), BM=moe.BLOCK_M, BN=bn, BK=bk,
        TILED=tiled, ROW_EXACT=flags["ROW_EXACT"], IEEE=flags["IEEE"], num_warps=moe.NUM_WARPS, num_stages=stages)
    return h


def down_probe(h, w, ws, ids, tiled, stages):
    hidden, inter = w.shape[1], w.shape[2]
    y = torch.empty(ids.numel() + 1, hidden, dtype=h.dtype, device=h.device)
    bn, bk = moe.DOWN_BLOCK_N, moe.DOWN_BLOCK_K
    flags = moe._dot_flags(h.dtype)
    _down_probe_kernel[(ids.numel() + 1, hidden // bn)](
        h, w, ws, ids, y, ids.numel(), inter, w.stride(0), h.stride(0), y.stride(0), BM=moe.BLOCK_M, BN=bn, BK=bk,
        TILED=tiled, ROW_EXACT=flags["ROW_EXACT"], IEEE=flags["IEEE"], num_warps=moe.NUM_WARPS, num_stages=stages)
    return y


def production_down(h, ids, down, ws_down, top_k):
    """The pairs path's down (moe._pairs) at T = 1, alone."""
    hidden, inter = down.shape[1], down.shape[2]
    y = torch.empty(top_k + 1, hidden, dtype=h.dtype, device=h.device)
    moe._down_kernel[(top_k + 1, triton.cdiv(hidden, moe.DOWN_BLOCK_N))](
        h, down, ws_down, y, ids, ids, 1, 1, down.shape[0], inter, ws_down.shape[1], hidden, 0,
        h.stride(0), down.stride(0), y.stride(0), TOP_K=top_k, BM=moe.BLOCK_M, BN=moe.DOWN_BLOCK_N,
        BK=moe.DOWN_BLOCK_K, BE=triton.next_power_of_2(down.shape[0]), NT=1, PAIRS=True, **moe._dot_flags(h.dtype),
        num_warps=moe.NUM_WARPS, num_stages=moe.NUM_STAGES)
    return y


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
    y0 = production_down(h0, ids0, w0["down"], w0["shared_down"], top_k)
    rows = [timed("prod_gate_up", lambda i: moe._direct_gate_up(
                xs[i], routes[i][2], copies[i % num_copies]["gate_up"], (copies[i % num_copies]["shared_gate_up"], None),
                top_k)),  # (it routes as it goes, PAIRS_ROUTE_FIRST off)
            timed("prod_down_pairs", lambda i: production_down(routes[i][1], routes[i][0], copies[i % num_copies]["down"],
                                                               copies[i % num_copies]["shared_down"], top_k))]
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
    for tiled in (False, True):
        for st in stages_grid:
            tag = f"{'tiled' if tiled else 'canon'}_st{st}"
            gw, dw = layouts[("gate_up", gbn, gbk, tiled)], layouts[("down", dbn, dbk, tiled)]
            rows.append(timed(f"gate_up_{tag}", lambda i, gw=gw, t=tiled, st=st: gate_up_probe(
                xs[i], *gw[i % num_copies], routes[i][0], t, st),
                lambda h: {"h_bit_equal": bool(torch.equal(h, h0[:, :h.shape[1]]))}))
            rows.append(timed(f"down_{tag}", lambda i, dw=dw, t=tiled, st=st: down_probe(
                routes[i][1], *dw[i % num_copies], routes[i][0], t, st),
                lambda y: {"y_bit_equal": bool(torch.equal(y, y0))}))
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
