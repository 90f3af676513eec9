"""Qwen3.5-MoE's sparse MLP block in Triton, batch-invariant; the naive twins are in moe_naive.py (the math,
the layouts, the tie rule and the rounding points are written there, and hold here).

A block takes one of three paths, chosen by T alone (path_for); all give the same bits for a row.
Nothing waits on the host and nothing but Triton kernels runs (a CUDA graph holds the block):

    router   logits [T, E + 1] = x @ [router_w; shared_gate_w]^T: column E
             is the shared expert's gate logit                           _dense_kernel
  direct (when asked; T <= BLOCK_M), three launches:
    gate_up  a program a pair (token t, rank r): it routes t from the
             logits (_top_k), and its tile's row 0 is x_t through expert
             ids[t, r]; one more program holds the shared expert's block
             of all T tokens; h [P, I] at the pair's row                  _gate_up_kernel, DIRECT
    down     a program a token and BN columns: for r = 0..k-1 the pair's
             row through down_e, rounded, weighted and summed in fp32 in
             rank order, then the shared expert's, rounded once           _down_combine_kernel
  pairs (small decode batches, PAIRS_MAX_TOKENS; T <= BLOCK_M), four launches: the direct gate_up (or, with
  PAIRS_ROUTE_FIRST, the route kernel and then a gate_up reading each pair's expert: five), then
    down     a program a pair and BN columns (the shared block: one more
             program), y [P, H] at the pair's row, its expert read from
             the ids the gate_up stored                                   _down_kernel, PAIRS
    combine  as the grouped path's                                        _combine_kernel
  grouped (chunks), six launches:
    route    top-k and weights [T, k] (_top_k), the pairs' experts        _route_kernel, a program a token
    group    each expert's pairs in pair order (a counting sort, a
             program owning BE experts: no atomics), and their counts     _group_kernel
    gate_up  h for BLOCK_M rows of one expert a program; every program
             finds its block from the counts (blocks run expert by
             expert, then the shared expert's T rows); from
             WIDE_MIN_TOKENS a program takes WIDE_TILES column tiles      _gate_up_kernel
    down     y [P, H] = h @ down_e^T, at the pair's own row               _down_kernel
    combine  out_t = sum_r w_tr * y_tr + sigmoid(gate_t) * shared_t
             in fp32 in rank order, rounded once                          _combine_kernel, a program a token

Every launch above is a programmatic dependent launch where the device allows it (pdl.py): placed on the device
while the one before it runs, each of its programs waiting for that one before its first load.

Pairs: routed pair t * k + r, and the shared expert (as expert E, whose weights are shared_gate_up /
shared_down, its intermediate size may differ) pair T * k + t; h and y are indexed by pair on every path.

Batch invariance (a row's bits never depend on the other rows of the call, nor on T): every tile shape below
is pinned, not chosen by T, and the same on every path (BLOCK_M rows, the same BN and BK, the same warps); a
tile's K loop runs from 0 upwards in one program (no split-K), whichever program holds the tile (how many
column tiles a program takes, one after another, is a choice of speed), except that the router may cut its K
into ROUTER_SPLIT_K fixed slices whose partials one program adds in slice order for every T; the k outputs of a
token are summed in one program in rank order with the same fused multiply-adds on every path; the routing
weights come from scalar arithmetic in rank order (_top_k), never a sum across lanes, so no launch's lane layout
reaches them; the one atomic (the split router's count of a tile's finished slices) picks which program adds,
never the order of a sum. A row's place inside a BLOCK_M tile, and which other rows share the tile, differ
between the paths and with T. On a GPU that does not change its bits (a tile product's row is that row's dot
products; the gpu tests check it bit for bit at the real shapes, across T and across the paths). Under Triton's
interpreter it would: tile products go through numpy's BLAS, whose result for a row depends on its place in
the tile; there (ROW_EXACT) the kernels multiply by broadcasting and sum over K instead, which is exact per
row, so the interpreted tests can check invariance, and the paths' equality, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import counts as counts_
from . import interpreting, pdl
from .fused import _add_rows, add_rms_norm
from .norms import NORM_NUM_WARPS, _row_blocks, _store_rms_norm

# pinned tiles, for every T and every path (see the docstring): a block of BLOCK_M (token, expert) rows of one expert
BLOCK_M = 16  # a chunk of 512 tokens at top-8 over 256 experts is 16 rows an expert on average
GATE_UP_BLOCK_N, GATE_UP_BLOCK_K = 32, 128  # gate and up: 2 x 32 columns a program
DOWN_BLOCK_N, DOWN_BLOCK_K = 32, 128  # 64 programs for one decode token's down (H = 2048)
# 17 tiles for one token (136 programs with the K split below): its 1 MB of router weight in parallel. K steps
# of 128 rather than 256 (the same bits: a row's products in the same order) shortened the decode round a little
# (benchmarks/NOTES.md, twenty-seventh and twenty-eighth sessions)
ROUTER_BLOCK_N, ROUTER_BLOCK_K = 16, 128
NUM_WARPS, NUM_STAGES = 4, 3
# pipeline depths (they change no bits): the router has 17 tiles for a decode token and the direct down
# H / DOWN_BLOCK_N, whose K loop runs over all k experts of the token; with few programs the bytes in flight
# come from depth. Reckoned, not yet measured: benchmarks/moe_block_bench.py --sweep times the others. (Before
# the direct down read its ids and weights ahead of its K loop, Triton's pipeliner kept only 2 of its 6 stages
# in flight, behind the expert id's load, with a plain load of the weight in every step; now 5.)
ROUTER_STAGES = 4
# the router's K in ROUTER_SPLIT_K fixed slices, each a program of its own writing its fp32 partial tile, added in
# slice order by whichever of a tile's programs ends last (an atomic count picks that program, never the order):
# the same sum for every T, so invariant (other bits than one K loop a program). At T = 1 the router's 17
# programs each ran a chain of dependent tile products and hardly waited on memory (Nsight Compute); 8 slices
# shortened the decode round at batch 1 and 8 (benchmarks/NOTES.md, twenty-eighth session)
ROUTER_SPLIT_K = 8
DIRECT_DOWN_STAGES = 6
# the post-attention add and norm and the router in one launch for a decode round's few tokens
# (add_rms_norm_router): measured against the two launches on the device before it is the default
NORM_ROUTER = False
# the direct gate_up (direct and pairs paths): (k + 1) * I / GATE_UP_BLOCK_N programs; 4 stages against 3 shortened
# the 35B-A3B's decode round at batch 1 and 8, the same at 32 (benchmarks/NOTES.md, twenty-eighth session)
DIRECT_GATE_UP_STAGES = 4
# the pairs path for 1..PAIRS_MAX_TOKENS tokens, the grouped one past them; the direct path only when asked (all
# give the same bits: a choice of speed, at most BLOCK_M so that the shared expert's rows are one tile). Measured
# on the H200 (35B-A3B shapes, moe_block_bench-pairs-2026-12-03-h200.json): pairs is the fastest path at T = 1, 2,
# 4 and 8 (grouped first from T = 32); the pairs down has (T * k + 1) * H / DOWN_BLOCK_N programs where the direct
# one has T * H / DOWN_BLOCK_N
PAIRS_MAX_TOKENS = 8
# the pairs path's routing: inside the gate_up (each program routes its token from the logits before its first
# weight load: one launch fewer), or first, by the route kernel (its programs then only load their pair's
# expert id). The same bits; not yet measured (moe_block_bench --sweep --knobs PAIRS_ROUTE_FIRST)
PAIRS_ROUTE_FIRST = False
# the route kernel's warps: one warp reduces without a barrier (it changes no bits: the ranks are exact maxima,
# the weights lane by lane)
ROUTE_WARPS = 1
GROUP_BLOCK_E, GROUP_BLOCK_T = 16, 64  # the counting sort: BE experts a program, BT tokens a step
# past GROUP_WIDE_MIN_TOKENS tokens BT = GROUP_WIDE_BLOCK_T: a program's steps run one after another, 64 of them
# at T = 4096 with BT = 64 (BT changes no bits: the sort is stable whatever its steps)
GROUP_WIDE_MIN_TOKENS, GROUP_WIDE_BLOCK_T = 512, 256
# from WIDE_MIN_TOKENS tokens on a grouped program takes WIDE_TILES column tiles one after another (the same
# tiles, the same bits): every grouped program first finds its block from the counts (a scan over E), and at
# T = 4096 the down alone has 2560 x 64 programs. Reckoned, not measured; above the 512-row chunks the served
# sessions read, which keep their measured schedule
WIDE_MIN_TOKENS, WIDE_TILES = 1024, 4
assert PAIRS_MAX_TOKENS <= BLOCK_M


@triton.jit
def _dot_acc(acc, b_a, b_b, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr):
    """acc + b_a [BM, BK] @ b_b [BN, BK]^T in fp32."""
    if ROW_EXACT:  # the interpreter: exact per row (the module docstring)
        return acc + tl.sum(b_a.to(tl.float32)[:, :, None] * tl.trans(b_b.to(tl.float32))[None, :, :], axis=1)
    elif IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmul
        return tl.dot(b_a, tl.trans(b_b), acc, input_precision="ieee")
    else:
        return tl.dot(b_a, tl.trans(b_b), acc)


@triton.jit
def _dense_tile(x_ptr, w_ptr, w_last_ptr, y_ptr, parts_ptr, counts_ptr, num_rows, num_cols, depth, stride_x, stride_w,
                stride_y, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_LAST: tl.constexpr,
                SPLIT: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr):
    """The router's tile of this program (_dense_kernel's body, and _add_norm_router_kernel's after its norm)."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < num_rows, o_n < num_cols
    if HAS_LAST:
        is_last = o_n == num_cols
    else:
        is_last = o_n < 0
    k_lo, k_hi = _dense_slice(depth, BK, SPLIT)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < depth
        b_x = tl.load(x_ptr + o_m[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        # two loads and a select of values, not one load through selected pointers: the rows' addresses
        # stay provably contiguous, so the loads are vectors (the same values, the same bits)
        b_w = tl.load(w_ptr + o_n[:, None].to(tl.int64) * stride_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        if HAS_LAST:
            b_last = tl.load(w_last_ptr + o_n[:, None] * 0 + o_k[None, :], mask=is_last[:, None] & m_k[None, :],
                             other=0.0)
            b_w = tl.where(is_last[:, None], b_last, b_w)
        acc = _dot_acc(acc, b_x, b_w, ROW_EXACT, IEEE)
    p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_y + o_n[None, :]
    m_y = m_m[:, None] & (m_n | is_last)[None, :]
    if SPLIT > 1:
        i_tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        o_tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        p_parts = parts_ptr + i_tile.to(tl.int64) * (SPLIT * BM * BN) + o_tile
        tl.store(p_parts + tl.program_id(2) * (BM * BN), acc)
        tl.debug_barrier()  # every thread's partial stored before the count releases them
        if tl.atomic_add(counts_ptr + i_tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            # the tile's last slice: the others' partials are stored; add them in slice order
            tl.atomic_xchg(counts_ptr + i_tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
            total = tl.load(p_parts, cache_modifier=".cg")
            for i_s in tl.static_range(1, SPLIT):
                total = total + tl.load(p_parts + i_s * (BM * BN), cache_modifier=".cg")
            tl.store(p_y, total.to(y_ptr.dtype.element_ty), mask=m_y)
    else:
        tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_y)


@triton.jit
def _dense_slice(depth, BK: tl.constexpr, SPLIT: tl.constexpr):
    """[k_lo, k_hi): the K columns this program's slice of its tile sums (all of K without a split)."""
    k_lo, k_hi = 0, depth
    if SPLIT > 1:
        k_slice = tl.cdiv(tl.cdiv(depth, SPLIT), BK) * BK
        k_lo = tl.program_id(2) * k_slice
        k_hi = tl.minimum(depth, k_lo + k_slice)
    return k_lo, k_hi


@triton.jit(do_not_specialize=["num_rows"])
def _dense_kernel(
    x_ptr, w_ptr, w_last_ptr, y_ptr, parts_ptr, counts_ptr, num_rows, num_cols, depth, stride_x, stride_w,
    stride_y, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_LAST: tl.constexpr, SPLIT: tl.constexpr,
    ROW_EXACT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """y [M, N (+1)] = x [M, K] @ w [N, K]^T, one BM x BN tile a program (the router's logits); with HAS_LAST
    one more column N from w_last [1, K] (the shared gate's logit). SPLIT > 1: program_id(2) is the tile's
    slice of K (ROUTER_SPLIT_K), its fp32 partial stored in parts_ptr; the tile's last program to count itself
    in counts_ptr (zero between launches: that program sets it back) adds the SPLIT partials in slice order."""
    pdl.start(PDL)
    _dense_tile(x_ptr, w_ptr, w_last_ptr, y_ptr, parts_ptr, counts_ptr, num_rows, num_cols, depth, stride_x, stride_w,
                stride_y, BM, BN, BK, HAS_LAST, SPLIT, ROW_EXACT, IEEE)


@triton.jit(do_not_specialize=["num_rows"])
def _add_norm_router_kernel(
    x_ptr, h_ptr, nw_ptr, s_ptr, y_ptr, w_ptr, w_last_ptr, logits_ptr, parts_ptr, counts_ptr, num_rows, num_cols,
    depth, stride_x, stride_h, stride_s, stride_y, stride_w, stride_l, eps,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_LAST: tl.constexpr, SPLIT: tl.constexpr,
    ROW_EXACT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
    PDL: tl.constexpr,
):
    """fused.add_rms_norm of x, h [M, D] (s = x + h, y its norm by nw), then _dense_kernel's router tile on y, in
    one launch on the router's grid. Every program runs the add and norm of its tile's BM rows, BR rows at a time
    as the add_rms_norm kernel does (its code, its tile: the same bits), and stores the K slice of y its tile reads
    (so each reads back only what it wrote); its tile's first program stores s."""
    pdl.start(PDL)
    k_lo, k_hi = _dense_slice(depth, BK, SPLIT)
    o_d = tl.arange(0, BD)
    m_slice = (o_d >= k_lo) & (o_d < k_hi)
    # (a column vector, not a scalar: the interpreter takes no scalar in a mask)
    first = (tl.arange(0, BR) * 0 + tl.program_id(1) + tl.program_id(2)) == 0
    m0 = tl.program_id(0) * BM
    for r0 in range(m0, tl.minimum(m0 + BM, num_rows), BR):
        o_r = r0 + tl.arange(0, BR)
        m = (o_r < num_rows)[:, None] & (o_d < D)[None, :]
        b_s = _add_rows(x_ptr, h_ptr, s_ptr, o_r, o_d, m, m & first[:, None], stride_x, stride_h, stride_s)
        _store_rms_norm(b_s.to(tl.float32), nw_ptr, y_ptr, o_r, o_d, m & m_slice[None, :], stride_y, eps, D)
    tl.debug_barrier()  # every thread's part of y stored before any thread's K loop loads it
    _dense_tile(y_ptr, w_ptr, w_last_ptr, logits_ptr, parts_ptr, counts_ptr, num_rows, num_cols, depth, stride_y,
                stride_w, stride_l, BM, BN, BK, HAS_LAST, SPLIT, ROW_EXACT, IEEE)


@triton.jit
def _top_k(logits_ptr, i_t, stride_l, num_experts, TOP_K: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr):
    """Token i_t's routing from its E logits: (ids [BR] int32, weights [BR] fp32), rank r at lane r < TOP_K.
    Softmax (fp32) over the E logits, the TOP_K largest logits (equal ones: the lowest index first; NaN counts
    as -inf), renormalised over the k: weight_r = exp(l_r - l_0) / sum_{j < k} exp(l_j - l_0) (softmax's
    denominator cancels), the sum scalar by scalar in rank order. No value here is a sum across lanes, whose
    order would follow the launch's lane layout: every kernel that routes gets the same bits.
    A rank is one max over int64 keys (the logit's bits made to order as signed integers, high; BE - 1 - e,
    low): the largest logit, the lowest index among equal ones (-0.0 made +0.0 first, as == holds them equal),
    and the key decodes back to both."""
    o_e = tl.arange(0, BE)
    m_e = o_e < num_experts
    b_l = tl.load(logits_ptr + i_t * stride_l + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    b_l = tl.where(b_l == b_l, b_l, float("-inf"))  # NaN counts as -inf: every rank gets an expert in range
    b_l = tl.where(b_l == 0.0, 0.0, b_l)
    bits = b_l.to(tl.int32, bitcast=True)
    b_key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (BE - 1 - o_e).to(tl.int64)
    o_r = tl.arange(0, BR)
    b_ids = tl.zeros((BR,), tl.int32)
    b_ex = tl.zeros((BR,), tl.float32)
    top = tl.max(b_l, 0)  # rank 0's logit
    denom = top * 0.0  # (0 + ex_0 = ex_0)
    for r in tl.static_range(TOP_K):
        key = tl.max(b_key, 0)
        b_key = tl.where(b_key == key, -9223372036854775807 - 1, b_key)  # taken (lanes past E: never reached)
        pick = BE - 1 - (key & 0xFFFFFFFF).to(tl.int32)
        s = (key >> 32).to(tl.int32)
        best = (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        ex = tl.exp(best - top)
        denom = denom + ex
        b_ids = tl.where(o_r == r, pick, b_ids)
        b_ex = tl.where(o_r == r, ex, b_ex)
    return b_ids, b_ex / denom


@triton.jit
def _fold(acc, w, y):
    """acc + w * y in one rounding (fp32; w a scalar, broadcast first): the combine's step, the same
    instruction on both paths."""
    return tl.fma(tl.zeros_like(y) + w, y, acc)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, num_experts, stride_l, TOP_K: tl.constexpr, BE: tl.constexpr,
                  BR: tl.constexpr, PDL: tl.constexpr):
    """One token: ids [T, TOP_K] (int64, or int32 for the group kernel's keys) and w [T, TOP_K] by rank."""
    pdl.start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    b_ids, b_w = _top_k(logits_ptr, i_t, stride_l, num_experts, TOP_K, BE, BR)
    o_r = tl.arange(0, BR)
    tl.store(ids_ptr + i_t * TOP_K + o_r, b_ids.to(ids_ptr.dtype.element_ty), mask=o_r < TOP_K)
    tl.store(w_ptr + i_t * TOP_K + o_r, b_w.to(w_ptr.dtype.element_ty), mask=o_r < TOP_K)


@triton.jit(do_not_specialize=["num_tokens", "cap"])
def _group_kernel(keys_ptr, order_ptr, counts_ptr, num_tokens, num_experts, cap, TOP_K: tl.constexpr,
                  BE: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    """Experts BE * program .. + BE: each one's pairs t * k + r (keys [T, k] int32 in 0..E-1, their experts)
    in pair order, order[e * cap + j] for j < counts[e]: a stable counting sort, each program owning its
    experts (no atomics). cap bounds an expert's pairs (T where a token's k experts differ)."""
    pdl.start(PDL)
    o_e = tl.program_id(0) * BE + tl.arange(0, BE)
    m_e = o_e < num_experts
    p_row = order_ptr + o_e.to(tl.int64) * cap
    seen = tl.zeros((BE,), tl.int32)
    for t0 in range(0, num_tokens, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < num_tokens
        hits = tl.zeros((BT, BE), tl.int32)
        for r in tl.static_range(TOP_K):
            b_k = tl.load(keys_ptr + o_t * TOP_K + r, mask=m_t, other=-1)
            hits += (b_k[:, None] == o_e[None, :]).to(tl.int32)
        # each (token, expert): the expert's pairs before the token's first one (earlier steps, earlier tokens)
        before = seen[None, :] + tl.cumsum(hits, 0) - hits
        for r in tl.static_range(TOP_K):  # a token may name one expert twice (moe_experts): rank order
            b_k = tl.load(keys_ptr + o_t * TOP_K + r, mask=m_t, other=-1)
            hit = (b_k[:, None] == o_e[None, :]) & m_e[None, :]
            pair = (o_t * TOP_K + r)[:, None] + tl.zeros((BT, BE), tl.int32)
            tl.store(p_row[None, :] + before, pair, mask=hit)
            before += hit.to(tl.int32)
        seen += tl.sum(hits, 0)
    tl.store(counts_ptr + o_e, seen, mask=m_e)


@triton.jit
def _grouped_rows(order_ptr, counts_ptr, num_experts, num_routed, num_shared, cap, top_k, BM: tl.constexpr,
                  BE: tl.constexpr):
    """This program's block: (its expert e, its rows' mask [BM], pairs [BM], tokens [BM]). Blocks run expert
    by expert, ceil(counts[e] / BM) an expert (rows order[e * cap + j]), then the shared expert's (e = E,
    pairs num_routed + t in token order); past the last block e = E + 1."""
    i_b = tl.program_id(0)
    o_e = tl.arange(0, BE)
    m_e = o_e < num_experts
    b_c = tl.load(counts_ptr + o_e, mask=m_e, other=0)
    b_nb = (b_c + BM - 1) // BM
    b_end = tl.cumsum(b_nb, 0)  # the blocks of experts 0..e
    routed_blocks = tl.sum(b_nb, 0)
    is_routed = i_b < routed_blocks
    e_r = tl.sum(((b_end <= i_b) & m_e).to(tl.int32), 0)
    first = tl.sum(tl.where(o_e == e_r, b_end - b_nb, 0), 0)
    count_r = tl.sum(tl.where(o_e == e_r, b_c, 0), 0)
    j = tl.where(is_routed, i_b - first, i_b - routed_blocks)
    count = tl.where(is_routed, count_r, num_shared)
    o_j = j * BM + tl.arange(0, BM)
    m_m = o_j < count
    e = tl.where(is_routed, e_r, tl.where(j * BM < num_shared, num_experts, num_experts + 1))
    routed = tl.load(order_ptr + e_r.to(tl.int64) * cap + o_j, mask=tl.where(is_routed, m_m, False), other=0)
    pair = tl.where(is_routed, routed, num_routed + o_j)
    token = tl.where(pair < num_routed, pair // top_k, pair - num_routed)
    return e, m_m, pair, token


@triton.jit
def _direct_rows(logits_ptr, ids_ptr, w_ptr, num_tokens, num_experts, stride_l, TOP_K: tl.constexpr,
                 BM: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr):
    """Direct: program p < T * k is pair p alone (token p // k, rank p % k, at row 0 of its tile), its
    expert read off the token's routing here; program T * k is the shared expert's block, all T <= BM tokens
    in token order. Each token's rank-0 program of column tile 0 stores its routing (ids, weights) for the
    down. Returns as _grouped_rows."""
    i_p = tl.program_id(0)
    num_routed = num_tokens * TOP_K
    is_routed = i_p < num_routed
    i_t = tl.minimum(i_p // TOP_K, num_tokens - 1)  # (the shared block's program routes a token it does not use)
    b_ids, b_w = _top_k(logits_ptr, i_t.to(tl.int64), stride_l, num_experts, TOP_K, BE, BR)
    o_r = tl.arange(0, BR)
    is_writer = (i_p < num_routed) & (i_p % TOP_K == 0) & (tl.program_id(1) == 0)
    if is_writer:
        tl.store(ids_ptr + i_t * TOP_K + o_r, b_ids, mask=o_r < TOP_K)
        tl.store(w_ptr + i_t * TOP_K + o_r, b_w.to(w_ptr.dtype.element_ty), mask=o_r < TOP_K)
    o_m = tl.arange(0, BM)
    e = tl.where(is_routed, tl.sum(tl.where(o_r == i_p % TOP_K, b_ids, 0), 0), num_experts)
    m_m = tl.where(is_routed, o_m == 0, o_m < num_tokens)
    pair = tl.where(is_routed, i_p + o_m * 0, num_routed + o_m)
    token = tl.where(is_routed, i_t + o_m * 0, o_m)
    return e, m_m, pair, token


@triton.jit
def _pair_rows(ids_ptr, num_tokens, num_experts, TOP_K: tl.constexpr, BM: tl.constexpr):
    """Pairs, after the direct gate_up stored each pair's expert in ids [T * k]: program p < T * k is pair p
    alone (row 0 of its tile), program T * k the shared expert's block of all T <= BM tokens, as _direct_rows
    lays them out. Returns as _grouped_rows."""
    i_p = tl.program_id(0)
    num_routed = num_tokens * TOP_K
    is_routed = i_p < num_routed
    o_m = tl.arange(0, BM)
    e = tl.where(is_routed, tl.load(ids_ptr + tl.minimum(i_p, num_routed - 1)), num_experts)
    m_m = tl.where(is_routed, o_m == 0, o_m < num_tokens)
    pair = tl.where(is_routed, i_p + o_m * 0, num_routed + o_m)
    token = tl.where(is_routed, i_p // TOP_K + o_m * 0, o_m)
    return e, m_m, pair, token


@triton.jit(do_not_specialize=["num_tokens", "num_shared", "cap"])
def _gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, logits_ptr, ids_ptr, wts_ptr, order_ptr, counts_ptr,
    num_tokens, num_shared, num_experts, inter, inter_s, hidden, cap, stride_x, stride_we, stride_h, stride_l,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr,
    NT: tl.constexpr, DIRECT: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    PAIRS: tl.constexpr = 0,
):
    """h[pair] = silu(x_t @ gate_e^T) * (x_t @ up_e^T) for a tile's rows, BN columns of each, for NT column
    tiles one after another (each tile's K loop the same as alone: NT changes no bits, only how many programs
    share one finding of the rows); the rows from _direct_rows (DIRECT), _pair_rows (PAIRS: the pairs' experts
    routed before, in ids_ptr) or _grouped_rows."""
    pdl.start(PDL)
    if DIRECT:
        e, m_m, pair, token = _direct_rows(logits_ptr, ids_ptr, wts_ptr, num_tokens, num_experts, stride_l, TOP_K,
                                           BM, BE, BR)
    elif PAIRS:
        e, m_m, pair, token = _pair_rows(ids_ptr, num_tokens, num_experts, TOP_K, BM)
    else:
        e, m_m, pair, token = _grouped_rows(order_ptr, counts_ptr, num_experts, num_tokens * TOP_K, num_shared, cap,
                                            TOP_K, BM, BE)
    if e > num_experts:  # past the last block
        return
    if e == num_experts:  # the shared expert: [2 Is, H]
        p_w = ws_ptr
        width = inter_s
    else:  # [E, 2 I, H]
        p_w = w_ptr + e.to(tl.int64) * stride_we
        width = inter
    dt = h_ptr.dtype.element_ty
    for c in tl.static_range(NT):
        n0 = (tl.program_id(1) * NT + c) * BN
        if n0 < width:
            o_n = n0 + tl.arange(0, BN)
            m_n = o_n < width
            acc_g = tl.zeros((BM, BN), tl.float32)
            acc_u = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, hidden, BK):
                o_k = k0 + tl.arange(0, BK)
                m_k = o_k < hidden
                b_x = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_x + o_k[None, :],
                              mask=m_m[:, None] & m_k[None, :], other=0.0)
                p_g = p_w + o_n[:, None].to(tl.int64) * hidden + o_k[None, :]
                m_w = m_n[:, None] & m_k[None, :]
                b_g = tl.load(p_g, mask=m_w, other=0.0)
                b_u = tl.load(p_g + width.to(tl.int64) * hidden, mask=m_w, other=0.0)
                acc_g = _dot_acc(acc_g, b_x, b_g, ROW_EXACT, IEEE)
                acc_u = _dot_acc(acc_u, b_x, b_u, ROW_EXACT, IEEE)
            # the twin's rounding: each projection to the dtype, silu(gate) to the dtype, then the product
            b_g = acc_g.to(dt).to(tl.float32)
            b_act = (b_g * tl.sigmoid(b_g)).to(dt)
            b_h = b_act.to(tl.float32) * acc_u.to(dt).to(tl.float32)
            tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_h + o_n[None, :], b_h.to(dt),
                     mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_shared", "cap"])
def _down_kernel(
    h_ptr, w_ptr, ws_ptr, y_ptr, order_ptr, counts_ptr,
    num_tokens, num_shared, num_experts, inter, inter_s, hidden, cap, stride_h, stride_we, stride_y,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
    NT: tl.constexpr, PAIRS: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """y[pair] = h[pair] @ down_e^T for a block's rows, BN of the H columns, for NT column tiles one after
    another (as _gate_up_kernel's); the rows from _pair_rows (PAIRS: order_ptr holds the pairs' experts) or
    _grouped_rows."""
    pdl.start(PDL)
    if PAIRS:
        e, m_m, pair, _ = _pair_rows(order_ptr, num_tokens, num_experts, TOP_K, BM)
    else:
        e, m_m, pair, _ = _grouped_rows(order_ptr, counts_ptr, num_experts, num_tokens * TOP_K, num_shared, cap,
                                        TOP_K, BM, BE)
    if e > num_experts:
        return
    if e == num_experts:  # the shared expert: [H, Is]
        p_w = ws_ptr
        depth = inter_s
    else:  # [E, H, I]
        p_w = w_ptr + e.to(tl.int64) * stride_we
        depth = inter
    for c in tl.static_range(NT):
        n0 = (tl.program_id(1) * NT + c) * BN
        if n0 < hidden:
            o_n = n0 + tl.arange(0, BN)
            m_n = o_n < hidden
            acc = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, depth, BK):
                o_k = k0 + tl.arange(0, BK)
                m_k = o_k < depth
                b_h = tl.load(h_ptr + pair[:, None].to(tl.int64) * stride_h + o_k[None, :],
                              mask=m_m[:, None] & m_k[None, :], other=0.0)
                b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * depth + o_k[None, :],
                              mask=m_n[:, None] & m_k[None, :], other=0.0)
                acc = _dot_acc(acc, b_h, b_w, ROW_EXACT, IEEE)
            p_y = y_ptr + pair[:, None].to(tl.int64) * stride_y + o_n[None, :]
            tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(
    y_ptr, w_ptr, logits_ptr, out_ptr, num_tokens, num_experts, hidden, stride_y, stride_l, stride_out,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr,
):
    """Grouped, one token: out = sum_r w[t, r] * y[t * k + r] (+ sigmoid(logits[t, E]) * y[T * k + t]) in
    fp32, in rank order (fused multiply-adds, as _down_combine_kernel's), rounded once."""
    pdl.start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < hidden
    acc = tl.zeros((BH,), tl.float32)
    for r in tl.static_range(TOP_K):
        b_w = tl.load(w_ptr + i_t * TOP_K + r).to(tl.float32)
        b_y = tl.load(y_ptr + (i_t * TOP_K + r) * stride_y + o_h, mask=m_h, other=0.0).to(tl.float32)
        acc = _fold(acc, b_w, b_y)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(logits_ptr + i_t * stride_l + num_experts).to(tl.float32))
        b_s = tl.load(y_ptr + (num_tokens * TOP_K + i_t) * stride_y + o_h, mask=m_h, other=0.0).to(tl.float32)
        acc = _fold(acc, gate, b_s)
    tl.store(out_ptr + i_t * stride_out + o_h, acc.to(out_ptr.dtype.element_ty), mask=m_h)


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_add_rms_norm_kernel(
    y_ptr, w_ptr, logits_ptr, x_ptr, nw_ptr, s_ptr, out_ptr, num_tokens, num_experts, stride_y, stride_l, stride_x,
    stride_s, stride_out, eps, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BR: tl.constexpr, PDL: tl.constexpr = 0,
):
    """_combine_kernel's sum for BR tokens, then fused.add_rms_norm's step on it: s = x + the block's output
    (rounded as the combine rounds it), out = rms_norm(s), the tile [BR, BD] and arithmetic of
    fused._add_rms_norm_kernel (the sum over a row's columns in the same layout, so the same bits)."""
    pdl.start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < num_tokens
    m = m_r[:, None] & (o_d < D)[None, :]
    acc = tl.zeros((BR, BD), tl.float32)
    for r in tl.static_range(TOP_K):
        b_w = tl.load(w_ptr + o_r * TOP_K + r, mask=m_r, other=0.0).to(tl.float32)
        b_y = tl.load(y_ptr + (o_r * TOP_K + r)[:, None].to(tl.int64) * stride_y + o_d[None, :], mask=m,
                      other=0.0).to(tl.float32)
        acc = _fold(acc, b_w[:, None], b_y)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(logits_ptr + o_r * stride_l + num_experts, mask=m_r, other=0.0).to(tl.float32))
        b_sh = tl.load(y_ptr + (num_tokens * TOP_K + o_r)[:, None].to(tl.int64) * stride_y + o_d[None, :], mask=m,
                       other=0.0).to(tl.float32)
        acc = _fold(acc, gate[:, None], b_sh)
    b_h = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_s = (b_x + b_h).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + o_r[:, None] * stride_s + o_d[None, :], b_s, mask=m)
    _store_rms_norm(b_s.to(tl.float32), nw_ptr, out_ptr, o_r, o_d, m, stride_out, eps, D)


@triton.jit(do_not_specialize=["num_tokens"])
def _down_combine_kernel(
    h_ptr, w_ptr, ws_ptr, ids_ptr, wts_ptr, logits_ptr, out_ptr,
    num_tokens, num_experts, inter, inter_s, hidden, stride_h, stride_we, stride_l, stride_out,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    ROW_EXACT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Direct, one token and BN columns: its k pairs' rows through their experts' down (row 0 of a BM tile,
    the grouped down's tile), each rounded to the dtype as y is, then weighted and summed in fp32 in rank
    order, then the shared expert's the same way: _down_kernel and _combine_kernel in one pass, their bits.
    One K loop runs over all k experts (k * ceil(I / BK) steps), so the pipeline stays full across them: the
    token's experts and weights are read once, before it, so no load in the loop waits on another."""
    pdl.start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    o_m = tl.arange(0, BM)
    m_row = o_m == 0
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_n = o_n < hidden
    num_k = tl.cdiv(inter, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    out = tl.zeros((BM, BN), tl.float32)
    o_r = tl.arange(0, BR)
    m_r = o_r < TOP_K
    b_ids = tl.load(ids_ptr + i_t * TOP_K + o_r, mask=m_r, other=0)
    b_wts = tl.load(wts_ptr + i_t * TOP_K + o_r, mask=m_r, other=0.0).to(tl.float32)
    for i in range(0, TOP_K * num_k):
        r = i // num_k
        k0 = (i - r * num_k) * BK
        e = tl.sum(tl.where(o_r == r, b_ids, 0), 0)  # lane r alone: the others add zeros
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < inter
        b_h = tl.load(h_ptr + (i_t * TOP_K + r) * stride_h + o_m[:, None] * 0 + o_k[None, :],
                      mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w_ptr + e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * inter + o_k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc = _dot_acc(acc, b_h, b_w, ROW_EXACT, IEEE)
        is_end = k0 + BK >= inter  # the pair's last step: fold it in rank order, start the next one from zero
        b_wt = tl.sum(tl.where(o_r == r, b_wts, 0.0), 0)
        out = tl.where(is_end, _fold(out, b_wt, acc.to(dt).to(tl.float32)), out)
        acc = tl.where(is_end, 0.0, acc)
    for k0 in range(0, inter_s, BK):  # the shared expert: [H, Is]
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < inter_s
        b_h = tl.load(h_ptr + (num_tokens * TOP_K + i_t) * stride_h + o_m[:, None] * 0 + o_k[None, :],
                      mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(ws_ptr + o_n[:, None].to(tl.int64) * inter_s + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        acc = _dot_acc(acc, b_h, b_w, ROW_EXACT, IEEE)
    gate = tl.sigmoid(tl.load(logits_ptr + i_t * stride_l + num_experts).to(tl.float32))
    out = _fold(out, gate, acc.to(dt).to(tl.float32))
    p_out = out_ptr + i_t * stride_out + o_m[:, None] * 0 + o_n[None, :]
    tl.store(p_out, out.to(dt), mask=m_row[:, None] & m_n[None, :])


def _dot_flags(dtype: torch.dtype) -> dict:
    return dict(ROW_EXACT=interpreting(), IEEE=dtype == torch.float32, **pdl.options())


def _router(x: torch.Tensor, router_w: torch.Tensor, gate_w: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] @ router_w [E, H]^T -> [T, E] in x's dtype, one pinned tiling for every T; with gate_w [1, H],
    [T, E + 1] whose column E is the shared gate's logit (columns 0..E-1 the same bits either way)."""
    logits, launch = _router_launch(x, router_w, gate_w)
    if launch is not None:
        grid, buffers, sizes = launch
        _dense_kernel[grid](x, router_w, *buffers, x.stride(0), router_w.stride(0), logits.stride(0), **sizes)
    return logits


def _router_launch(x, router_w, gate_w):
    """The router's logits [T, E (+1)] and, for T > 0, its launch: (grid, (w_last, logits, parts, counts,
    num_rows, num_cols, depth), constexprs and options), which _dense_kernel and _add_norm_router_kernel share."""
    num_tokens, hidden = x.shape
    num_experts = router_w.shape[0]
    has_last = gate_w is not None
    logits = torch.empty(num_tokens, num_experts + has_last, dtype=x.dtype, device=x.device)
    if not num_tokens:
        return logits, None
    split = ROUTER_SPLIT_K
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_experts + has_last, ROUTER_BLOCK_N), split)
    num_tiles = grid[0] * grid[1]
    parts, counts = logits, logits  # (unread without a split)
    if split > 1:
        parts = torch.empty(num_tiles * split * BLOCK_M * ROUTER_BLOCK_N, dtype=torch.float32, device=x.device)
        counts = counts_.zeroed(router_w, num_tiles)
    buffers = (gate_w if has_last else router_w, logits, parts, counts, num_tokens, num_experts, hidden)
    sizes = dict(BM=BLOCK_M, BN=ROUTER_BLOCK_N, BK=ROUTER_BLOCK_K, HAS_LAST=has_last, SPLIT=split,
                 **_dot_flags(x.dtype), num_warps=NUM_WARPS, num_stages=ROUTER_STAGES)
    return logits, (grid, buffers, sizes)


def add_rms_norm_router(x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor,
                        shared_gate_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused.add_rms_norm(x, h, norm_w, eps) -> (s, y), and the block's router logits of y [T, E + 1] (the shared
    gate's logit last, as moe_block computes them), the same bits as the two: with NORM_ROUTER and at most
    PAIRS_MAX_TOKENS rows in one launch (_add_norm_router_kernel: every router program normalises its tile's
    rows, cheap for a decode round's few), else the two launches."""
    num_tokens, hidden = x.shape
    if h.shape != x.shape or norm_w.shape != (hidden,) or router_w.dim() != 2 or router_w.shape[1] != hidden:
        raise ValueError(f"h must match x {tuple(x.shape)}, norm_w be [{hidden}] and router_w [E, {hidden}]; got "
                         f"{tuple(h.shape)}, {tuple(norm_w.shape)}, {tuple(router_w.shape)}")
    if not (NORM_ROUTER and 0 < num_tokens <= PAIRS_MAX_TOKENS and NUM_WARPS == NORM_NUM_WARPS):
        s, y = add_rms_norm(x, h, norm_w, eps)
        return s, y, _router(y, router_w.contiguous(), shared_gate_w.contiguous())
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    router_w, shared_gate_w = router_w.contiguous(), shared_gate_w.contiguous()
    logits, (grid, buffers, sizes) = _router_launch(y, router_w, shared_gate_w)
    block_d, block_r = _row_blocks(hidden)
    _add_norm_router_kernel[grid](x, h, norm_w.contiguous(), s, y, router_w, *buffers, x.stride(0), h.stride(0),
                                  s.stride(0), y.stride(0), router_w.stride(0), logits.stride(0), eps, D=hidden,
                                  BD=block_d, BR=block_r, **sizes)
    return s, y, logits


def router_logits(x: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ router_w [E, H]^T -> [T, E] in x's dtype, one pinned tiling for every T (moe_block's
    routing logits, bit for bit)."""
    return _router(x, router_w)


def _route_sizes(num_experts: int, top_k: int) -> dict:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts); got {top_k}")
    return dict(TOP_K=top_k, BE=triton.next_power_of_2(num_experts), BR=triton.next_power_of_2(top_k))


def _route(logits: torch.Tensor, num_experts: int, top_k: int, ids_dtype: torch.dtype):
    """logits [T, >= E] (columns 0..E-1 the experts') -> (ids [T, k] ids_dtype, weights [T, k] logits' dtype)."""
    num_tokens = logits.shape[0]
    sizes = _route_sizes(num_experts, top_k)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(num_tokens, top_k, dtype=ids_dtype, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, ids, weights, num_experts, logits.stride(0), **sizes,
                                     num_warps=ROUTE_WARPS, **pdl.options())
    return ids, weights


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As moe_naive.moe_route: logits [T, E] -> (ids [T, k] int64, weights [T, k] in logits' dtype)."""
    return _route(logits, logits.shape[1], top_k, torch.int64)


def _check_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    num_experts, two_inter, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"need x [T, H], gate_up [E, 2I, H], down [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("expert weights must be contiguous (a copy each call would move all of them): "
                         "store gate_up and down contiguous")
    if not (x.dtype == gate_up.dtype == down.dtype):
        raise ValueError(f"x and the expert weights must share a dtype; got {x.dtype}, {gate_up.dtype}, {down.dtype}")


def _group(keys: torch.Tensor, num_tokens: int, top_k: int, num_experts: int, cap: int):
    """The routed pairs grouped by expert: keys [T * k] int32 (pair t * k + r's expert) -> (order [E * cap]
    int32, counts [E] int32): expert e's pairs in pair order are order[e * cap : e * cap + counts[e]] (a stable
    sort's), the rest of order unwritten. cap: the most pairs an expert can have."""
    order = torch.empty(num_experts * cap, dtype=torch.int32, device=keys.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=keys.device)
    block_t = GROUP_BLOCK_T if num_tokens <= GROUP_WIDE_MIN_TOKENS else GROUP_WIDE_BLOCK_T
    _group_kernel[(triton.cdiv(num_experts, GROUP_BLOCK_E),)](keys, order, counts, num_tokens, num_experts, cap,
                                                             TOP_K=top_k, BE=GROUP_BLOCK_E, BT=block_t, **pdl.options())
    return order, counts


def _tiles_a_program(num_tokens: int) -> int:
    """Column tiles a grouped program takes (a choice of speed: the tiles' bits are the same either way)."""
    return WIDE_TILES if num_tokens >= WIDE_MIN_TOKENS else 1


def _grouped(x, keys, cap, weights, gate_up, down, shared=None, logits=None, finish=None):
    """The grouped path's experts on x [T, H] -> [T, H]: keys [T * k] int32 the routed pairs' experts (an
    expert at most cap times), weights [T, k]; with shared = (shared_gate_up, shared_down) the shared expert
    too, its gate logit read from logits[:, E]. finish(y, weights, logits, num_experts, has_shared), where
    given, takes the combine's place (T >= 1)."""
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = gate_up.shape[0], weights.shape[1], gate_up.shape[1] // 2
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    ws_gate_up, ws_down = shared if shared is not None else (gate_up, down)
    inter_s = ws_gate_up.shape[-2] // 2 if shared is not None else inter
    num_shared = num_tokens if shared is not None else 0
    num_routed = num_tokens * top_k
    order, counts = _group(keys, num_tokens, top_k, num_experts, cap)
    # sum over experts of ceil(rows / BM) <= ceil(P / BM) + (experts with rows), then the shared expert's blocks
    max_blocks = triton.cdiv(num_routed, BLOCK_M) + min(num_experts, num_routed) + triton.cdiv(num_shared, BLOCK_M)
    h = torch.empty(num_routed + num_shared, max(inter, inter_s), dtype=x.dtype, device=x.device)
    y = torch.empty(num_routed + num_shared, hidden, dtype=x.dtype, device=x.device)
    tiles = _tiles_a_program(num_tokens)
    sizes = dict(TOP_K=top_k, BM=BLOCK_M, BE=triton.next_power_of_2(num_experts), NT=tiles, **_dot_flags(x.dtype),
                 num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _gate_up_kernel[(max_blocks, triton.cdiv(max(inter, inter_s), GATE_UP_BLOCK_N * tiles))](
        x, gate_up, ws_gate_up, h, x, order, weights, order, counts, num_tokens, num_shared, num_experts, inter,
        inter_s, hidden, cap, x.stride(0), gate_up.stride(0), h.stride(0), 0,
        BN=GATE_UP_BLOCK_N, BK=GATE_UP_BLOCK_K, BR=triton.next_power_of_2(top_k), DIRECT=False, **sizes)
    _down_kernel[(max_blocks, triton.cdiv(hidden, DOWN_BLOCK_N * tiles))](
        h, down, ws_down, y, order, counts, num_tokens, num_shared, num_experts, inter, inter_s, hidden, cap,
        h.stride(0), down.stride(0), y.stride(0), BN=DOWN_BLOCK_N, BK=DOWN_BLOCK_K, PAIRS=False, **sizes)
    if finish is not None:
        return finish(y, weights, logits, num_experts, shared is not None)
    return _combine(y, weights, logits, out, num_experts, shared is not None)


def _combine(y, weights, logits, out, num_experts, has_shared):
    """out [T, H] = the k pairs' rows of y weighted in rank order (+ the shared expert's behind its gate,
    logits[:, E]): _combine_kernel, a program a token."""
    num_tokens, hidden = out.shape
    top_k = weights.numel() // num_tokens
    weights = weights if weights.is_contiguous() else weights.contiguous()
    _combine_kernel[(num_tokens,)](y, weights, logits if logits is not None else y, out, num_tokens, num_experts,
                                   hidden, y.stride(0), logits.stride(0) if logits is not None else 0, out.stride(0),
                                   TOP_K=top_k, HAS_SHARED=has_shared, BH=triton.next_power_of_2(hidden),
                                   num_warps=NUM_WARPS, **pdl.options())
    return out


def _direct_gate_up(x, logits, gate_up, shared, top_k, route_first: bool = False):
    """The direct gate_up on x [T <= BLOCK_M, H] (the module docstring), logits [T, E + 1] -> (ids [T * k]
    int32, weights [T * k] in x's dtype, h [T * k + T, max(I, Is)]): it routes as it goes. route_first (the
    pairs path's PAIRS_ROUTE_FIRST): _route_kernel routes first (a program a token, the same _top_k) and the
    gate_up's programs only load their pair's expert: one launch more, no program waiting on the routing's
    reductions before its first weight load."""
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    ws_gate_up = shared[0]
    inter_s = ws_gate_up.shape[0] // 2
    num_routed = num_tokens * top_k
    if route_first:
        ids, weights = (t.reshape(-1) for t in _route(logits, num_experts, top_k, torch.int32))
    else:
        ids = torch.empty(num_routed, dtype=torch.int32, device=x.device)
        weights = torch.empty(num_routed, dtype=x.dtype, device=x.device)
    h = torch.empty(num_routed + num_tokens, max(inter, inter_s), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_routed + 1, triton.cdiv(max(inter, inter_s), GATE_UP_BLOCK_N))](
        x, gate_up, ws_gate_up, h, logits, ids, weights, ids, ids, num_tokens, num_tokens, num_experts, inter,
        inter_s, hidden, 0, x.stride(0), gate_up.stride(0), h.stride(0), logits.stride(0),
        BM=BLOCK_M, BN=GATE_UP_BLOCK_N, BK=GATE_UP_BLOCK_K, NT=1, DIRECT=not route_first, PAIRS=route_first,
        num_stages=DIRECT_GATE_UP_STAGES, **_route_sizes(num_experts, top_k), **_dot_flags(x.dtype),
        num_warps=NUM_WARPS)
    return ids, weights, h


def _direct(x, logits, gate_up, down, shared, top_k):
    """The direct path on x [T <= BLOCK_M, H] -> [T, H] (the module docstring); logits [T, E + 1]."""
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    ws_down = shared[1]
    inter_s = shared[0].shape[0] // 2
    ids, weights, h = _direct_gate_up(x, logits, gate_up, shared, top_k)
    out = torch.empty_like(x)
    _down_combine_kernel[(num_tokens, triton.cdiv(hidden, DOWN_BLOCK_N))](
        h, down, ws_down, ids, weights, logits, out, num_tokens, num_experts, inter, inter_s, hidden, h.stride(0),
        down.stride(0), logits.stride(0), out.stride(0), TOP_K=top_k, BM=BLOCK_M, BN=DOWN_BLOCK_N, BK=DOWN_BLOCK_K,
        BR=triton.next_power_of_2(top_k), num_stages=DIRECT_DOWN_STAGES, **_dot_flags(x.dtype), num_warps=NUM_WARPS)
    return out


def _pairs_down(h, ids, down, ws_down, num_tokens, top_k, num_stages=None):
    """The pairs path's down: y [T * k + T, H] = each pair's row of h through its expert's down (ids [T * k], as
    _direct_gate_up stored them), then the shared expert's rows (ws_down [H, Is])."""
    num_experts, hidden, inter = down.shape
    num_routed = num_tokens * top_k
    y = torch.empty(num_routed + num_tokens, hidden, dtype=h.dtype, device=h.device)
    _down_kernel[(num_routed + 1, triton.cdiv(hidden, DOWN_BLOCK_N))](
        h, down, ws_down, y, ids, ids, num_tokens, num_tokens, num_experts, inter, ws_down.shape[1], hidden, 0,
        h.stride(0), down.stride(0), y.stride(0), TOP_K=top_k, BM=BLOCK_M, BN=DOWN_BLOCK_N, BK=DOWN_BLOCK_K,
        BE=triton.next_power_of_2(num_experts), NT=1, PAIRS=True, **_dot_flags(h.dtype), num_warps=NUM_WARPS,
        num_stages=num_stages or NUM_STAGES)
    return y


def _pairs(x, logits, gate_up, down, shared, top_k, finish=None):
    """The pairs path on x [T <= BLOCK_M, H] -> [T, H] (the module docstring); logits [T, E + 1]; finish: as
    _grouped's."""
    ids, weights, h = _direct_gate_up(x, logits, gate_up, shared, top_k, route_first=PAIRS_ROUTE_FIRST)
    y = _pairs_down(h, ids, down, shared[1], x.shape[0], top_k)
    num_experts = gate_up.shape[0]
    if finish is not None:
        return finish(y, weights, logits, num_experts, True)
    return _combine(y, weights, logits, torch.empty_like(x), num_experts, True)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """As moe_naive.moe_experts: x [T, H], ids [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I]
    -> sum_r weights[t, r] * expert_{ids[t, r]}(x[t]), [T, H] in x's dtype (the grouped path). ids must lie
    in 0..E-1 (not checked: that would wait on the device; moe_route's always do); a token may name an
    expert more than once."""
    _check_experts(x, gate_up, down)
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids and weights must both be [T, k] for x [T, H]; got {tuple(ids.shape)}, "
                         f"{tuple(weights.shape)} for {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _grouped(x, ids.reshape(-1).to(torch.int32), ids.numel(), weights, gate_up, down)


PATHS = ("direct", "pairs", "grouped")
SMALL_PATHS = ("direct", "pairs")  # at most BLOCK_M tokens: the shared expert's rows are one tile


def path_for(num_tokens: int) -> str:
    """The path a block of num_tokens tokens takes when none is asked for (the choice of speed above)."""
    return "pairs" if num_tokens <= PAIRS_MAX_TOKENS else "grouped"


def moe_block(x: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              shared_gate_up: torch.Tensor, shared_down: torch.Tensor, shared_gate_w: torch.Tensor,
              top_k: int, *, path: str | None = None) -> torch.Tensor:
    """As moe_naive.moe_block: Qwen3.5-MoE's sparse MLP block on x [T, H] -> [T, H]; router_w [E, H],
    gate_up [E, 2I, H], down [E, H, I], shared_gate_up [2Is, H], shared_down [H, Is], shared_gate_w [1, H].
    path: "direct" or "pairs" (T <= BLOCK_M), or "grouped"; None picks by T alone (path_for). All give the
    same bits (the module docstring), so the choice is one of speed."""
    return _block(x, router_w, gate_up, down, shared_gate_up, shared_down, shared_gate_w, top_k, path)


def moe_block_add_rms_norm(x: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           shared_gate_up: torch.Tensor, shared_down: torch.Tensor, shared_gate_w: torch.Tensor,
                           top_k: int, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, *,
                           path: str | None = None, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.add_rms_norm(residual, moe_block(x, ...), norm_w, eps) -> (s, y), the same bits, with the block's
    combine and the residual add and norm in one launch (_combine_add_rms_norm_kernel) where the path has a
    combine (pairs, grouped): a decode layer's launch fewer. logits: the router's of x as add_rms_norm_router
    gives them ([T, E + 1]), its launch then skipped."""
    if residual.shape != x.shape or residual.dtype != x.dtype or norm_w.shape != (x.shape[-1],):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype} and norm_w be [{x.shape[-1]}]; got "
                         f"{tuple(residual.shape)} {residual.dtype}, {tuple(norm_w.shape)}")

    def finish(y, weights, logits, num_experts, has_shared):
        num_tokens, dim = residual.shape
        res = residual if residual.stride(-1) == 1 else residual.contiguous()
        s, out = torch.empty_like(res), torch.empty_like(res)
        block_d, block_r = _row_blocks(dim)
        weights = weights if weights.is_contiguous() else weights.contiguous()
        _combine_add_rms_norm_kernel[(triton.cdiv(num_tokens, block_r),)](
            y, weights, logits, res, norm_w.contiguous(), s, out, num_tokens, num_experts, y.stride(0),
            logits.stride(0), res.stride(0), s.stride(0), out.stride(0), eps, TOP_K=top_k, HAS_SHARED=has_shared,
            D=dim, BD=block_d, BR=block_r, num_warps=NORM_NUM_WARPS, **pdl.options())
        return s, out

    path = path_for(x.shape[0]) if path is None else path
    if path == "direct" or x.shape[0] == 0:  # the direct down combines as it goes: the add and norm after it
        out = _block(x, router_w, gate_up, down, shared_gate_up, shared_down, shared_gate_w, top_k, path,
                     logits=logits)
        return add_rms_norm(residual, out, norm_w, eps)
    return _block(x, router_w, gate_up, down, shared_gate_up, shared_down, shared_gate_w, top_k, path, finish, logits)


def _block(x, router_w, gate_up, down, shared_gate_up, shared_down, shared_gate_w, top_k, path, finish=None,
           logits=None):
    """moe_block's checks and launches; finish: as _grouped's (not on the direct path); logits: the router's
    of x, given (add_rms_norm_router), or None (the router runs here)."""
    _check_experts(x, gate_up, down)
    num_tokens, hidden = x.shape
    inter_s = shared_gate_up.shape[0] // 2
    if (router_w.shape != (gate_up.shape[0], hidden) or shared_gate_up.shape != (2 * inter_s, hidden)
            or shared_down.shape != (hidden, inter_s) or shared_gate_w.shape != (1, hidden)):
        raise ValueError(f"need router_w [E, H], shared_gate_up [2Is, H], shared_down [H, Is], shared_gate_w [1, H]"
                         f" for H = {hidden}; got {tuple(router_w.shape)}, {tuple(shared_gate_up.shape)}, "
                         f"{tuple(shared_down.shape)}, {tuple(shared_gate_w.shape)}")
    if path is None:
        path = path_for(num_tokens)
    if path not in PATHS or (path in SMALL_PATHS and num_tokens > BLOCK_M):
        raise ValueError(f"path must be one of {PATHS} ({' and '.join(SMALL_PATHS)} for at most {BLOCK_M} tokens);"
                         f" got {path!r} for {num_tokens} tokens")
    num_experts = gate_up.shape[0]
    _route_sizes(num_experts, top_k)
    if num_tokens == 0:
        return torch.empty_like(x)
    shared = tuple(w.contiguous() for w in (shared_gate_up, shared_down))
    x = x if x.stride(-1) == 1 else x.contiguous()
    if logits is None:
        logits = _router(x, router_w.contiguous(), shared_gate_w.contiguous())  # [T, E + 1]
    elif logits.shape != (num_tokens, num_experts + 1) or logits.dtype != x.dtype or logits.stride(-1) != 1:
        raise ValueError(f"logits must be the router's of x: {x.dtype} [{num_tokens}, {num_experts + 1}]; got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if path == "direct":
        return _direct(x, logits, gate_up, down, shared, top_k)
    if path == "pairs":
        return _pairs(x, logits, gate_up, down, shared, top_k, finish)
    keys, weights = _route(logits, num_experts, top_k, torch.int32)
    return _grouped(x, keys.reshape(-1), num_tokens, weights, gate_up, down, shared, logits, finish)


__all__ = ["NORM_ROUTER", "PAIRS_MAX_TOKENS", "PATHS", "add_rms_norm_router", "moe_block", "moe_block_add_rms_norm", "moe_experts",
           "moe_route", "path_for", "router_logits"]
