#!/usr/bin/env python
"""Where a decode token's MoE block loses its time: the pairs path's gate_up and down (qse_kernels/moe.py) at
T = 1 against ways of laying the same bytes over the device's SMs, at the 35B-A3B shapes, on one GPU.

At T = 1 the pairs gate_up is (k + 1) * I / BN = 144 programs of 16 K steps (256 KB each) on 132 SMs, and the
pairs down 576 programs of 4 steps (32 KB): both ran at ~2.3 TB/s (benchmarks/NOTES.md, the twenty-first
session's profile), against ~4.3 TB/s for a device copy. The variants here test why:

- split_s{S}_p{P}_st{stages}: the pairs path's split gate_up (moe._gate_up_parts, GATE_UP_SEGMENTS = S): K in S
  fixed segments (each summed from zero, then added in order, 0 + s0 + s1 + ...: a sum one program can also do
  alone, so every path keeps the same bits), its (pair, column tile, segment) units dealt to P programs in
  contiguous runs, one flat K loop a program (the pipeline stays full from unit to unit); each unit's fp32
  partials stored, then `finish` (moe._parts_h) makes h of them. P = the SM count: every SM streams the same
  bytes.
- down_flat_p{P}: the pairs down's (pair, column tile) units dealt the same way (the same per-tile K loop: the
  same bits as the pairs down), from h; down_parts_p{P}: the same reading the gate_up's partials instead of h
  (no finish launch).
- prod_block_pairs against prod_block_pairs_s4 (moe.GATE_UP_SEGMENTS = 4: route, the split gate_up, h of its
  partials, the pairs down, combine) and candidate_block_s4 (route, the split gate_up, the flat down making h of
  the partials, combine): the whole block (the output's largest difference from the pairs path's: the segment
  sums round differently).
Times are CUDA events over a graph of back-to-back calls rotating among weight copies and inputs (as
moe_block_bench's). Each variant's h or y is checked against the production kernels' (bit_equal where the
arithmetic is the same, max_abs_diff where the sum's order differs).

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

from benchmarks.moe_block_bench import NUM_COPIES, SHAPE_35B, SHAPE_TINY, draw_block, hbm_tbps  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import graph_us, kernel_bench_args, wall_us  # noqa: E402
from qse_kernels import moe, pdl  # noqa: E402

CALLS = 16


@triton.jit
def _pair_of(pair, b_ids, num_tokens, TOP_K: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr):
    """Pair `pair`'s place: (is it the shared expert's block, its expert, its rows' mask [BM], their tokens, their
    rows of h and y): a routed pair is row 0 of its tile (its token), the shared block every token."""
    num_routed = num_tokens * TOP_K
    o_m = tl.arange(0, BM)
    is_shared = pair == num_routed
    e = tl.sum(tl.where(tl.arange(0, BP) == pair, b_ids, 0), 0)
    m_m = o_m < tl.where(is_shared, num_tokens, 1)
    token = tl.where(is_shared, o_m, pair // TOP_K + o_m * 0)
    row = tl.where(is_shared, num_routed + o_m, pair + o_m * 0)
    return is_shared, e, m_m, token, row


@triton.jit
def _my_units(ids_ptr, num_tokens, num_units, units_a_program, TOP_K: tl.constexpr, BP: tl.constexpr):
    """This program's contiguous run of units [u0, u1), and every routed pair's expert [BP] (read once, ahead of
    the loop: no load in it waits on another)."""
    u0 = tl.program_id(0) * units_a_program
    o_p = tl.arange(0, BP)
    b_ids = tl.load(ids_ptr + o_p, mask=o_p < num_tokens * TOP_K, other=0)
    return u0, tl.minimum(u0 + units_a_program, num_units), b_ids


@triton.jit
def _down_flat_kernel(
    h_ptr, part_ptr, w_ptr, ws_ptr, ids_ptr, y_ptr, num_tokens, num_units, units_a_program, inter, hidden,
    stride_h, stride_we, stride_y, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    N_TILES: tl.constexpr, BP: tl.constexpr, FROM_PARTS: tl.constexpr, NUM_SEG: tl.constexpr, PDL: tl.constexpr,
):
    """y[pair] = h[pair] @ down_e^T, the pairs down's tiles (BM rows, BN of H, K from 0 in BK steps), units
    (pair, column tile) dealt to programs in contiguous runs, one flat loop; FROM_PARTS: h made from the
    gate_up's partials as it is loaded."""
    pdl.start(PDL)
    steps = inter // BK
    u0, u1, b_ids = _my_units(ids_ptr, num_tokens, num_units, units_a_program, TOP_K, BP)
    o_m = tl.arange(0, BM)
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), tl.float32)
    for i in range(0, (u1 - u0) * steps):
        unit = u0 + i // steps
        j = i % steps
        pair = unit // N_TILES
        o_n = (unit % N_TILES) * BN + tl.arange(0, BN)
        is_shared, e, m_m, _, row = _pair_of(pair, b_ids, num_tokens, TOP_K, BM, BP)
        o_k = j * BK + tl.arange(0, BK)
        if FROM_PARTS:
            b_h = moe._h_of_parts(part_ptr, row, o_k, m_m[:, None] & (o_k < inter)[None, :], inter, NUM_SEG, dt)
        else:
            b_h = tl.load(h_ptr + row[:, None].to(tl.int64) * stride_h + o_k[None, :], mask=m_m[:, None], other=0.0)
        p_w = tl.where(is_shared, ws_ptr, w_ptr + e.to(tl.int64) * stride_we)
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * inter + o_k[None, :])
        acc = tl.dot(b_h, tl.trans(b_w), acc)
        is_end = (o_m * 0 + j) == steps - 1
        tl.store(y_ptr + row[:, None].to(tl.int64) * stride_y + o_n[None, :], acc.to(dt),
                 mask=(m_m & is_end)[:, None] & (o_n < hidden)[None, :])
        acc = tl.where(is_end[:, None], 0.0, acc)


def num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4


def gate_up_split(x, ids, gate_up, ws_gate_up, top_k, num_seg, programs, stages=3):
    """The production split gate_up (moe._gate_up_parts, GATE_UP_SEGMENTS = num_seg) on `programs` programs
    (a multiple of the SM count) with `stages`: part [T*k + T, S, 2, I] fp32."""
    knobs = {"PARTS_PROGRAMS_A_SM": max(1, programs // num_sms(str(x.device.type))),
             "DIRECT_GATE_UP_STAGES": stages}
    saved = {k: getattr(moe, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(moe, k, v)
        return moe._gate_up_parts(x, ids, gate_up, ws_gate_up, top_k, num_seg)
    finally:
        for k, v in saved.items():
            setattr(moe, k, v)


def finish(part, dtype):
    """h of the partials, moe's own launch (T = 1: the last row is the shared expert's)."""
    return moe._parts_h(part, part.shape[0] - 1, part.shape[-1], part.shape[-1], dtype)


def down_flat(h_or_part, ids, down, ws_down, num_tokens, top_k, programs, from_parts=False, stages=3):
    hidden, inter = down.shape[1], down.shape[2]
    bn, bk = moe.DOWN_BLOCK_N, moe.DOWN_BLOCK_K
    num_pairs = num_tokens * top_k + 1
    num_units = num_pairs * (hidden // bn)
    y = torch.empty(num_tokens * top_k + num_tokens, hidden, dtype=down.dtype, device=down.device)
    per = triton.cdiv(num_units, programs)
    num_seg = h_or_part.shape[1] if from_parts else 1
    _down_flat_kernel[(triton.cdiv(num_units, per),)](
        h_or_part, h_or_part, down, ws_down, ids, y, num_tokens, num_units, per, inter, hidden,
        0 if from_parts else h_or_part.stride(0), down.stride(0), y.stride(0), TOP_K=top_k, BM=moe.BLOCK_M, BN=bn,
        BK=bk, N_TILES=hidden // bn, BP=triton.next_power_of_2(num_pairs), FROM_PARTS=from_parts, NUM_SEG=num_seg,
        num_warps=moe.NUM_WARPS, num_stages=stages, **pdl.options())
    return y


def production_down(h, ids, down, ws_down, num_tokens, top_k):
    """The pairs path's down (moe._pairs), alone."""
    hidden, inter = down.shape[1], down.shape[2]
    num_routed = num_tokens * top_k
    y = torch.empty(num_routed + num_tokens, hidden, dtype=h.dtype, device=h.device)
    moe._down_kernel[(num_routed + 1, triton.cdiv(hidden, moe.DOWN_BLOCK_N))](
        h, down, ws_down, y, ids, ids, num_tokens, num_tokens, down.shape[0], inter, ws_down.shape[1], hidden, 0,
        h.stride(0), down.stride(0), y.stride(0), TOP_K=top_k, BM=moe.BLOCK_M, BN=moe.DOWN_BLOCK_N,
        BK=moe.DOWN_BLOCK_K, BE=triton.next_power_of_2(down.shape[0]), NT=1, PAIRS=True, **moe._dot_flags(h.dtype),
        num_warps=moe.NUM_WARPS, num_stages=moe.NUM_STAGES)
    return y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, device = kernel_bench_args(p, argv)
    tiny = args.tiny
    shape = SHAPE_TINY if tiny else SHAPE_35B
    if tiny:  # the interpreter: shapes that the pinned tiles divide
        shape = dict(hidden=512, num_experts=8, top_k=2, inter=128, inter_s=128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    top_k, num_tokens = shape["top_k"], 1
    num_copies, calls = (1, 1) if tiny else (NUM_COPIES, CALLS)
    copies = [draw_block(shape, device, dtype, seed) for seed in range(num_copies)]
    gen = torch.Generator(device=device).manual_seed(7)
    xs = [torch.randn(num_tokens, shape["hidden"], generator=gen, device=device).to(dtype) for _ in range(calls)]
    routes = []  # each call's logits, its pairs' experts (int32) and the production h
    for i, x in enumerate(xs):
        w = copies[i % num_copies]
        logits = moe._router(x, w["router_w"], w["shared_gate_w"])
        ids, _, h = moe._direct_gate_up(x, logits, w["gate_up"], (w["shared_gate_up"], w["shared_down"]), top_k,
                                        route_first=True)
        routes.append((logits, ids, h))
    sms = num_sms(device)
    time_us = (lambda fns: wall_us(fns[0], warm=False)) if device != "cuda" else (lambda fns: graph_us(fns))

    def timed(name, fn, check=None):
        fns = [lambda i=i: fn(i) for i in range(calls)]
        row = {"variant": name, "us": round(time_us(fns), 2)}
        if check is not None:
            row.update(check(fn(0)))
        print(json.dumps(row), flush=True)
        return row

    w0, (_, ids0, h0) = copies[0], routes[0]
    shared = lambda i: (copies[i % num_copies]["shared_gate_up"], copies[i % num_copies]["shared_down"])  # noqa: E731
    y0 = production_down(h0, ids0, w0["down"], w0["shared_down"], num_tokens, top_k)

    def against_h(h):
        rows = h0.shape[0]
        return {"h_max_abs_diff": float((h[:rows].float() - h0.float()).abs().max())}

    def against_y(y):
        return {"y_bit_equal": bool(torch.equal(y, y0)), "y_max_abs_diff": float((y.float() - y0.float()).abs().max())}

    rows = [timed("prod_gate_up_direct", lambda i: moe._direct_gate_up(
                xs[i], routes[i][0], copies[i % num_copies]["gate_up"], shared(i), top_k)),
            timed("prod_gate_up_route_first", lambda i: moe._direct_gate_up(
                xs[i], routes[i][0], copies[i % num_copies]["gate_up"], shared(i), top_k, route_first=True)),
            timed("prod_down_pairs", lambda i: production_down(
                routes[i][2], routes[i][1], copies[i % num_copies]["down"], shared(i)[1], num_tokens, top_k),
                against_y)]
    steps = shape["hidden"] // moe.GATE_UP_BLOCK_K
    grid = ((1, 4), (sms,), (3,)) if tiny else ((1, 2, 4, 8), (sms, 2 * sms), (3, 4))  # (the interpreter: the flow)
    for num_seg in (s for s in grid[0] if steps % s == 0):
        for programs in grid[1]:
            for stages in grid[2]:
                name = f"split_s{num_seg}_p{programs}_st{stages}"
                rows.append(timed(name, lambda i, s=num_seg, pr=programs, st=stages: gate_up_split(
                    xs[i], routes[i][1], copies[i % num_copies]["gate_up"], shared(i)[0], top_k, s, pr, stages=st),
                    lambda part: against_h(finish(part, dtype))))
    parts = [gate_up_split(xs[i], routes[i][1], copies[i % num_copies]["gate_up"], shared(i)[0], top_k, 4, sms)
             for i in range(calls)]
    rows.append(timed("finish_s4", lambda i: finish(parts[i], dtype)))
    hs = [finish(part, dtype) for part in parts]
    for programs in grid[1]:
        for stages in (3,) if tiny else (3, 4, 6):
            rows.append(timed(f"down_flat_p{programs}_st{stages}", lambda i, pr=programs, st=stages: down_flat(
                routes[i][2], routes[i][1], copies[i % num_copies]["down"], shared(i)[1], num_tokens, top_k, pr,
                stages=st), against_y))
        rows.append(timed(f"down_parts_s4_p{programs}", lambda i, pr=programs: down_flat(
            parts[i], routes[i][1], copies[i % num_copies]["down"], shared(i)[1], num_tokens, top_k, pr,
            from_parts=True), lambda y, pr=programs: {"y_equals_finish_then_down": bool(torch.equal(y, down_flat(
                hs[0], routes[0][1], w0["down"], w0["shared_down"], num_tokens, top_k, pr)))}))
    # the whole block: the pairs path against the candidate (router, route, split gate_up, the down from its
    # partials, combine: five launches, the pairs path's four and the route)
    def candidate_block(i, num_seg=4):
        x, w = xs[i], copies[i % num_copies]
        logits = moe._router(x, w["router_w"], w["shared_gate_w"])
        ids, weights = moe._route(logits, shape["num_experts"], top_k, torch.int32)
        part = gate_up_split(x, ids.reshape(-1), w["gate_up"], w["shared_gate_up"], top_k, num_seg, sms)
        y = down_flat(part, ids.reshape(-1), w["down"], w["shared_down"], num_tokens, top_k, sms, from_parts=True)
        return moe._combine(y, weights, logits, torch.empty_like(x), shape["num_experts"], True)

    out0 = moe.moe_block(xs[0], **w0, top_k=top_k, path="pairs")
    rows.append(timed("prod_block_pairs", lambda i: moe.moe_block(xs[i], **copies[i % num_copies], top_k=top_k,
                                                                  path="pairs")))
    def pairs_segments(i, num_seg=4):  # the production knob: moe_block's pairs path with GATE_UP_SEGMENTS
        saved, moe.GATE_UP_SEGMENTS = moe.GATE_UP_SEGMENTS, num_seg
        try:
            return moe.moe_block(xs[i], **copies[i % num_copies], top_k=top_k, path="pairs")
        finally:
            moe.GATE_UP_SEGMENTS = saved

    rows.append(timed("prod_block_pairs_s4", pairs_segments,
                      lambda out: {"out_max_abs_diff": float((out.float() - out0.float()).abs().max())}))
    rows.append(timed("candidate_block_s4", candidate_block,
                      lambda out: {"out_max_abs_diff": float((out.float() - out0.float()).abs().max()),
                                   "out_max_abs": float(out0.float().abs().max())}))
    nbytes = {"gate_up": (top_k + 1) * 2 * shape["inter"] * shape["hidden"] * dtype.itemsize,
              "down": (top_k + 1) * shape["hidden"] * shape["inter"] * dtype.itemsize}
    tbps = hbm_tbps(device)
    result = {**result_header("triton", device="cpu (interpreted)" if tiny else None), "shape": shape,
              "num_tokens": num_tokens, "sms": sms, "weight_copies": num_copies, "calls_a_graph": calls,
              "nbytes": nbytes, "copy_tbps": tbps and round(tbps, 3), "pdl": pdl.active(), "rows": rows}
    write_result(result, args.out, "moe_decode_variants")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
