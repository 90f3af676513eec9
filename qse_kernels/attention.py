"""Causal GQA attention in Triton over a paged KV (prefill chunks, questions and decode alike); the naive
twin is naive.attention.

Keys and values are read through a page table: row r of the sequence lives at row r % page_rows of page
page_table[r // page_rows]. A contiguous KV is one page with no end (`attention`). The query start (the
sequence position of the first query) is read from device memory, so one launch shape serves every
position and a CUDA graph holding it stays valid as the session grows.

Query rows of one KV head are packed: row m of kv head hk is token m // G of query head hk*G + m % G
(G = H / Hkv), so a K/V tile loaded once serves the whole group. Grid (M / BM, Hkv, splits).

    split s covers KV rows [s*R, (s+1)*R); within it a program walks its rows in blocks of BN with an
    fp32 online softmax (log2 domain), first the blocks every query row sees (no mask), then the
    causal edge (masked).

R = max(MIN_ROWS, BN * ceil(ceil(L / WANT) / BN)) for L = start + T rows, computed in the kernel from L
alone: it never depends on the device, its load, or how many split programs the grid launched. A grid
may launch more splits than L needs (a captured graph launches WANT); the extra ones find no rows and
add exact zeros in the combine, so the bits are the same. With one split the program writes the output
directly; that equals the combine of one split bit for bit (weight 2^0 = 1, denominator 1).

The attention layer's output gate, out * sigmoid(gate), can ride in whichever epilogue writes the output
(`gate`): the output rounded to its dtype, then fused.sigmoid_gate's own arithmetic, so the bits equal
sigmoid_gate applied after, one launch fewer a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, pdl
from .fused import _sigmoid_gated, check_page_table, check_page_tables

# split-K sizing: at most this many programs (two waves of the H200's 132 SMs), with splits of at least
# MIN_ROWS rows. A chunk's program holds 192 KB of shared memory, so one runs on an SM at a time: rounding
# the split count up (9 splits x 32 row blocks = 288 programs) launched a third wave of 24 programs
# that ran as long as a full one; rounding down (8 splits, 256 programs) ends in two
TARGET_PROGRAMS = 264
# chunks and questions (the prefill tiles) aim at one wave instead: alone a chunk's attention took about the
# same (321 against 327 us at 32k, half the split parts to write and combine), and in a chunk group the SMs
# it leaves free run the other layer ranges' kernels (a 64k grouped read 8.47 -> 8.35 ms per 1000 tokens at
# two ranges, 8.25 -> 8.11 at three: chunk_groups-*)
PREFILL_TARGET_PROGRAMS = 132
PREFILL_MIN_SPLIT_ROWS = 1024
# decode: splits of at least this many rows; 128 rather than 256 doubles the programs a short context gets (a
# 35B-A3B round at 6k: 48 -> 94 of 264, round_step-split*-2026-12-04-h200.json)
DECODE_MIN_SPLIT_ROWS = 128
COMBINE_BLOCK_SPLITS = 16
# a combine of few query rows (decode) splits D into blocks of this many columns. The block width sets the
# tile layout of the sum over the splits, and on a GPU its order (a batched row differed from the row alone
# when B >= 16 took the wide block), so it is picked by the queries of one sequence, never by B; a decode combine
# of 8 heads then runs 32 programs instead of 8 (17 -> 6 us a layer at 128 splits on the H200). A chunk's
# combine has programs enough, and there the split (4x the loads of the weights) cost 2x.
COMBINE_BLOCK_D = 64
COMBINE_SPLIT_D_BELOW_ROWS = 16
# chunk and question launches over pages fetch their unmasked K/V tiles by TMA descriptors instead of
# per-element addresses: on the H200 a chunk's attention at 32k went 366 -> 335 us a layer, at 64k 679 -> 606,
# a question's 240 -> 225 (attention_configs-paged-tma-*); the session's state kept its bits (shadow-check).
# The masked edge blocks keep the masked loads (rows past the sequence may hold anything, NaN included).
TMA_LOADS = True
# Candidates measured by benchmarks/attention_configs.py (module flags; none paid on the H200, so all are off:
# attention_configs-softmax-forms-*: lazy rescale 327 -> 362 us a layer at 32k, the fused scale 327 -> 337,
# warp specialisation under Triton 3.6 the same 327-328, i.e. no specialisation happened):
# LAZY_RESCALE_LOG2 > 0 keeps a row's reference max until the row's max grows past it by more than 2^that
# (the accumulator's rescale, 128 multiplies a thread a block at D = 256, then runs only in blocks where
# some row grew; the sums stay exact to fp32, p <= 2^LAZY in bf16); FUSED_SCALE scales the raw scores inside
# the exponent's subtraction (one fused multiply-add a score instead of a multiply and a subtract);
# WARP_SPECIALIZE asks Triton to split the unmasked loop into producer and consumer warps.
LAZY_RESCALE_LOG2 = 0
FUSED_SCALE = False
WARP_SPECIALIZE = False
LOG2_E = 1.4426950408889634
CONTIGUOUS_PAGE_ROWS = 1 << 30  # a contiguous KV is one page this long
# grid-invariant launches (QSE_KERNELS=invariant): one tile shape for every query count, and splits of a
# constant size, so a query row's result depends on its position and the rows it sees, never on how many
# queries came with it or how long the call's context was
INVARIANT_SPLIT_ROWS = 2048


def _decode_tiles(num_q: int, group: int, fixed_tiles: bool = False) -> bool:
    """Whether a launch takes the decode tiles: the group's heads of about one token (fixed_tiles: never)."""
    return num_q * group <= 16 and not fixed_tiles


def _config(num_q: int, group: int, head_dim: int, fixed_tiles: bool = False) -> dict:
    """Tile sizes pinned by the shape: (BM, BN, num_warps, num_stages), the split floor and the program
    target; fixed_tiles: the same for every query count (a decode row then rides in a mostly empty tile)."""
    if _decode_tiles(num_q, group, fixed_tiles):
        return dict(BM=16, BN=64, num_warps=4, num_stages=3, MIN_ROWS=DECODE_MIN_SPLIT_ROWS, TARGET=TARGET_PROGRAMS)
    if head_dim > 128:
        return dict(BM=128, BN=64, num_warps=8, num_stages=2, MIN_ROWS=PREFILL_MIN_SPLIT_ROWS,
                    TARGET=PREFILL_TARGET_PROGRAMS)
    return dict(BM=128, BN=64, num_warps=4, num_stages=3, MIN_ROWS=PREFILL_MIN_SPLIT_ROWS, TARGET=PREFILL_TARGET_PROGRAMS)


def max_splits(num_q: int, num_heads: int, num_kv: int, head_dim: int) -> int:
    """WANT: the most splits a launch of this shape ever needs, whatever the context."""
    cfg = _config(num_q, num_heads // num_kv, head_dim)
    base_programs = triton.cdiv(num_q * (num_heads // num_kv), cfg["BM"]) * num_kv
    return max(1, cfg["TARGET"] // base_programs)


def split_rows(num_q: int, num_heads: int, num_kv: int, head_dim: int, num_rows: int) -> int:
    """R, the KV rows of one split, for L = num_rows (the kernel computes the same on the device)."""
    cfg = _config(num_q, num_heads // num_kv, head_dim)
    want = max_splits(num_q, num_heads, num_kv, head_dim)
    return max(cfg["MIN_ROWS"], triton.cdiv(triton.cdiv(max(num_rows, 1), want), cfg["BN"]) * cfg["BN"])


def splits_for(num_q: int, num_heads: int, num_kv: int, head_dim: int, max_rows: int, rows_per_split: int = 0) -> int:
    """Split programs enough for every context up to max_rows rows. Below MIN_ROWS * WANT rows R is
    MIN_ROWS, so ceil(rows / MIN_ROWS) is what the longest of them needs; above, WANT always suffices."""
    if rows_per_split:
        return triton.cdiv(max_rows, rows_per_split)
    cfg = _config(num_q, num_heads // num_kv, head_dim)
    return max(1, min(max_splits(num_q, num_heads, num_kv, head_dim), triton.cdiv(max_rows, cfg["MIN_ROWS"])))


@triton.jit
def _attn_block(b_q, k_base, v_base, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                b_m, b_l, b_acc, scale_log2, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
                LAZY: tl.constexpr = 0, FUSED: tl.constexpr = False):
    """One BN block of keys (rows n.. of the sequence; k_base, v_base point at row n) into the online
    softmax state (b_m, b_l, b_acc)."""
    o_key = n + o_n
    if MASKED:
        m_key = o_key < num_rows
        b_k = tl.load(k_base + o_n[:, None] * stride_kl + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_base + o_n[:, None] * stride_vl + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0)
    else:
        b_k = tl.load(k_base + o_n[:, None] * stride_kl + o_d[None, :], mask=m_d[None, :], other=0.0)
        b_v = tl.load(v_base + o_n[:, None] * stride_vl + o_d[None, :], mask=m_d[None, :], other=0.0)
    return _attn_update(b_q, b_k, b_v, o_key, pos, num_rows, b_m, b_l, b_acc, scale_log2, MASKED, DOT_FP32,
                        LAZY, FUSED)


@triton.jit
def _attn_update(b_q, b_k, b_v, o_key, pos, num_rows, b_m, b_l, b_acc, scale_log2,
                 MASKED: tl.constexpr, DOT_FP32: tl.constexpr, LAZY: tl.constexpr = 0,
                 FUSED: tl.constexpr = False):
    """The online softmax state after the keys o_key (tiles b_k, b_v [BN, BD]); b_m is in the log2 domain.
    LAZY, FUSED: see LAZY_RESCALE_LOG2, FUSED_SCALE."""
    if DOT_FP32:
        b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k))
    if not FUSED:
        b_s = b_s * scale_log2
    if MASKED:
        b_s = tl.where((o_key[None, :] <= pos[:, None]) & (o_key < num_rows)[None, :], b_s, float("-inf"))
    if FUSED:  # scale_log2 > 0, so the largest scaled score is the largest score scaled (same rounding)
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
    else:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    if LAZY > 0:  # keep the reference unless the row grew past it by more than 2^LAZY (-inf always grows)
        b_m_new = tl.where(b_m_new > b_m + LAZY, b_m_new, b_m)
    # a row with no visible key yet keeps m = -inf; subtract 0 there so nothing turns into NaN
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    if FUSED:
        b_p = tl.exp2(b_s * scale_log2 - b_m_use[:, None])
    else:
        b_p = tl.exp2(b_s - b_m_use[:, None])
    if LAZY > 0:
        # one test for the block: the rescale (BM x BD multiplies) runs only when some row's reference moved
        if tl.max(tl.where(b_m_new != b_m, 1, 0), 0) > 0:
            b_acc = b_acc * b_alpha[:, None]
            b_l = b_l * b_alpha
        b_l = b_l + tl.sum(b_p, 1)
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
    else:
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_m_new, b_l, b_acc


@triton.jit
def _page_base(ptr, table_ptr, n, page_rows, stride_page, stride_row):
    """Address of sequence row n (a block start: a block never straddles a page)."""
    page = tl.load(table_ptr + n // page_rows).to(tl.int64)
    return ptr + page * stride_page + (n % page_rows).to(tl.int64) * stride_row


# num_q stays a run-time argument so that every T compiles to the same arithmetic
@triton.jit(do_not_specialize=["num_q", "page_rows", "forced_rows"])
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, table_ptr, start_ptr, o_ptr, part_ptr, lse_ptr, gate_ptr,
    num_q, num_heads, page_rows, forced_rows, scale_log2,
    stride_qt, stride_qh, stride_kp, stride_kl, stride_kh, stride_vp, stride_vl, stride_vh, stride_ot, stride_oh,
    stride_gt, stride_gh, stride_tb,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    WANT: tl.constexpr, MIN_ROWS: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    TMA: tl.constexpr, GATE: tl.constexpr, LAZY: tl.constexpr = 0, FUSED: tl.constexpr = False,
    WS: tl.constexpr = False, BATCHED: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    i_m, i_hk, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    part_rows = num_q  # rows of the split parts' layout [splits, rows, H, D]
    if BATCHED:
        # decode rounds: program row i_b is the one query (num_q == 1) of sequence i_b, with its own start and
        # page-table row; its query, output and gate are row i_b, its split parts row i_b of B
        i_b = i_m
        i_m = 0
        part_rows = tl.num_programs(0)
        start_ptr = start_ptr + i_b
        table_ptr = table_ptr + i_b * stride_tb
        q_ptr = q_ptr + i_b * stride_qt
        o_ptr = o_ptr + i_b * stride_ot
        gate_ptr = gate_ptr + i_b * stride_gt
        part_ptr = part_ptr + i_b * num_heads * D
        lse_ptr = lse_ptr + i_b * num_heads
    q_start = tl.load(start_ptr)
    num_rows = q_start + num_q
    if forced_rows > 0:
        rows_per_split = forced_rows
    else:
        rows_per_split = tl.maximum(MIN_ROWS, tl.cdiv(tl.cdiv(num_rows, WANT), BN) * BN)
    o_m = i_m * BM + tl.arange(0, BM)
    o_t = o_m // G
    o_head = i_hk * G + o_m % G
    m_m = o_t < num_q
    pos = q_start + o_t
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_n = tl.arange(0, BN)
    p_q = q_ptr + o_t[:, None] * stride_qt + o_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)

    t_first = (i_m * BM) // G
    t_last = tl.minimum((i_m * BM + BM - 1) // G, num_q - 1)
    lo = i_s * rows_per_split
    hi = tl.minimum(tl.minimum(lo + rows_per_split, q_start + t_last + 1), num_rows)
    # keys below q_start + t_first + 1 are seen by every row of the block: no mask
    full_hi = tl.maximum(lo, tl.minimum(hi, q_start + t_first + 1))
    full_hi = lo + ((full_hi - lo) // BN) * BN

    b_m = tl.full((BM,), float("-inf"), tl.float32)
    b_l = tl.zeros((BM,), tl.float32)
    b_acc = tl.zeros((BM, BD), tl.float32)
    k_head = k_ptr + i_hk * stride_kh
    v_head = v_ptr + i_hk * stride_vh
    for n in tl.range(lo, full_hi, BN, warp_specialize=WS):
        if TMA:  # the tensor-memory accelerator fetches the tiles (pages [P, rows, Hkv * D]; D == BD)
            page = tl.load(table_ptr + n // page_rows)
            b_k = k_desc.load([page, n % page_rows, i_hk * D]).reshape(BN, BD)
            b_v = v_desc.load([page, n % page_rows, i_hk * D]).reshape(BN, BD)
            b_m, b_l, b_acc = _attn_update(b_q, b_k, b_v, n + o_n, pos, num_rows, b_m, b_l, b_acc, scale_log2,
                                           MASKED=False, DOT_FP32=DOT_FP32, LAZY=LAZY, FUSED=FUSED)
        else:
            k_base = _page_base(k_head, table_ptr, n, page_rows, stride_kp, stride_kl)
            v_base = _page_base(v_head, table_ptr, n, page_rows, stride_vp, stride_vl)
            b_m, b_l, b_acc = _attn_block(b_q, k_base, v_base, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                                          b_m, b_l, b_acc, scale_log2, MASKED=False, DOT_FP32=DOT_FP32,
                                          LAZY=LAZY, FUSED=FUSED)
    for n in range(full_hi, hi, BN):
        k_base = _page_base(k_head, table_ptr, n, page_rows, stride_kp, stride_kl)
        v_base = _page_base(v_head, table_ptr, n, page_rows, stride_vp, stride_vl)
        b_m, b_l, b_acc = _attn_block(b_q, k_base, v_base, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                                      b_m, b_l, b_acc, scale_log2, MASKED=True, DOT_FP32=DOT_FP32,
                                      LAZY=LAZY, FUSED=FUSED)

    m_out = m_m[:, None] & m_d[None, :]
    if SPLIT:
        b_has = b_l > 0.0
        b_part = b_acc / tl.where(b_has, b_l, 1.0)[:, None]
        b_lse = tl.where(b_has, b_m + tl.log2(tl.where(b_has, b_l, 1.0)), float("-inf"))
        o_row = (i_s * part_rows + o_t) * num_heads + o_head
        tl.store(part_ptr + o_row[:, None] * D + o_d[None, :], b_part, mask=m_out)
        tl.store(lse_ptr + o_row, b_lse, mask=m_m)
    else:
        b_out = (b_acc / b_l[:, None]).to(o_ptr.dtype.element_ty)
        if GATE:
            p_g = gate_ptr + o_t[:, None] * stride_gt + o_head[:, None] * stride_gh + o_d[None, :]
            b_out = _sigmoid_gated(b_out, p_g, m_out)
        p_o = o_ptr + o_t[:, None] * stride_ot + o_head[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_out, mask=m_out)


@triton.jit
def _attn_combine_kernel(
    part_ptr, lse_ptr, o_ptr, gate_ptr, num_splits, num_q, num_heads, stride_ot, stride_oh, stride_gt, stride_gh,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BS_ALL: tl.constexpr, GATE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """out = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M), splits in order 0..S-1 in blocks of BS (empty
    splits carry lse = -inf and part = 0: weight 0, exact zeros); GATE: times sigmoid(gate), as the split-free
    epilogue. A row's splits with keys are 0..n-1 (it sees keys 0..its position), so the blocks past split
    n - 1 would add only exact zeros to sums that start at +0 and so are never -0: they are skipped, the same
    bits. (A graph launches the splits of the longest context; a short one uses few of them.)"""
    pdl.start(PDL)
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.program_id(2) * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_all = tl.arange(0, BS_ALL)  # every split's lse in one load (BS_ALL >= num_splits)
    b_lse_all = tl.load(lse_ptr + (o_all * num_q + i_t) * num_heads + i_h, mask=o_all < num_splits,
                        other=float("-inf"))
    b_top = tl.max(b_lse_all, 0)  # finite: key 0 is in split 0 and every row sees it
    num_used = tl.max(tl.where(b_lse_all > float("-inf"), o_all, -1), 0) + 1
    b_acc = tl.zeros((BD,), tl.float32)
    b_den = tl.zeros((BS,), tl.float32)
    for s0 in range(0, num_used, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < num_splits
        o_row = (o_s * num_q + i_t) * num_heads + i_h
        b_lse = tl.load(lse_ptr + o_row, mask=m_s, other=float("-inf"))
        b_w = tl.exp2(b_lse - b_top)
        b_part = tl.load(part_ptr + o_row[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_acc = b_acc + tl.sum(b_w[:, None] * b_part, 0)
        b_den = b_den + b_w
    b_out = (b_acc / tl.sum(b_den, 0)).to(o_ptr.dtype.element_ty)
    if GATE:
        b_out = _sigmoid_gated(b_out, gate_ptr + i_t * stride_gt + i_h * stride_gh + o_d, m_d)
    tl.store(o_ptr + i_t * stride_ot + i_h * stride_oh + o_d, b_out, mask=m_d)


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    start: torch.Tensor, max_rows: int | None = None, scale: float | None = None,
                    rows_per_split: int = 0, fixed_tiles: bool = False, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] at positions start.. (start: an int32 tensor [1] on q's device) over the rows
    [0, start + T) of a paged KV: k_pages, v_pages [P, page_rows, Hkv, D] (any page stride), page_table
    int32 [>= pages used]. Returns [T, H, D] in q's dtype.

    max_rows: a bound on start + T (exact when eager; the pool's capacity under a graph): the launch
    takes min(max_splits, ceil(max_rows / MIN_ROWS)) splits, enough for any context up to the bound;
    None takes max_splits. The bits never depend on it. rows_per_split > 0 forces R; with fixed_tiles
    (and a forced R) the result is grid-invariant (see INVARIANT_SPLIT_ROWS). gate [T, H, D] in q's dtype
    (a strided view welcome): the output times sigmoid(gate), the bits of fused.sigmoid_gate after."""
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k, v pages [P, rows, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    check_page_table(page_table, start)
    page_rows = k_pages.shape[1]
    bn = _config(q.shape[0], q.shape[1] // max(1, k_pages.shape[2]), q.shape[2])["BN"]
    if page_rows % bn:
        raise ValueError(f"page_rows must be a multiple of {bn}; got {page_rows}")
    num_splits = None
    if max_rows is not None:
        num_splits = splits_for(q.shape[0], q.shape[1], k_pages.shape[2], q.shape[2], max_rows, rows_per_split)
    return _launch(q, k_pages, v_pages, page_rows, k_pages.stride()[:3], v_pages.stride()[:3], page_table, start,
                   num_splits, scale, rows_per_split, fixed_tiles,
                   # grid-invariant launches load every row the same way (TMA is for chunks only)
                   descriptors=None if fixed_tiles else _page_descriptors(k_pages, v_pages, bn), gate=gate)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_tables: torch.Tensor,
                           positions: torch.Tensor, max_rows: int | None = None, scale: float | None = None,
                           gate: torch.Tensor | None = None, rows_per_split: int = 0,
                           fixed_tiles: bool = False) -> torch.Tensor:
    """Triton twin of naive.paged_decode_attention: B sequences of one query each in one launch, q [B, H, D],
    row b at position positions[b] (int32 [B], on the device) over rows [0, positions[b]] of the pages
    page_tables[b] (int32 [B, >= pages used]). Row b has the bits of paged_attention of that query alone
    (the same tiles, split size and combine; a program a sequence, head group and split). max_rows, scale,
    rows_per_split, fixed_tiles, gate: as paged_attention."""
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"q must be [B, H, D] and k, v pages [P, rows, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    check_page_tables(page_tables, positions, q.shape[0])
    page_rows = k_pages.shape[1]
    group = q.shape[1] // max(1, k_pages.shape[2])
    cfg = _config(1, group, q.shape[2], fixed_tiles)
    if page_rows % cfg["BN"] or group > cfg["BM"]:
        raise ValueError(f"page_rows must be a multiple of {cfg['BN']} and the query heads of a KV head at most "
                         f"{cfg['BM']}; got {page_rows}, {group}")
    num_splits = None
    if max_rows is not None:
        num_splits = splits_for(1, q.shape[1], k_pages.shape[2], q.shape[2], max_rows, rows_per_split)
    return _launch(q, k_pages, v_pages, page_rows, k_pages.stride()[:3], v_pages.stride()[:3], page_tables, positions,
                   num_splits, scale, rows_per_split, fixed_tiles, gate=gate, batched=True)


def paged_decode_attention_invariant(q, k_pages, v_pages, page_tables, positions, max_rows=None, scale=None, gate=None):
    """paged_decode_attention, grid-invariant: the arithmetic of paged_attention_invariant for each row."""
    return paged_decode_attention(q, k_pages, v_pages, page_tables, positions, max_rows, scale, gate,
                                  INVARIANT_SPLIT_ROWS, True)


def _page_descriptors(k_pages: torch.Tensor, v_pages: torch.Tensor, bn: int):
    """TMA descriptors of the pages seen as [P, rows, Hkv * D], one [1, BN, D] tile a load; None where
    TMA_LOADS is off or the layout does not allow them (a power-of-two D, a contiguous row of heads)."""
    if not TMA_LOADS:
        return None
    num_pages, rows, num_kv, dim = k_pages.shape
    if dim & (dim - 1) or dim > 256:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = []
    for pages in (k_pages, v_pages):
        if pages.stride(3) != 1 or pages.stride(2) != dim or pages.stride(1) != num_kv * dim:
            return None
        out.append(TensorDescriptor.from_tensor(pages.view(num_pages, rows, num_kv * dim), [1, bn, dim]))
    return tuple(out)


def _launch(q, k, v, page_rows, k_strides, v_strides, page_table, start, num_splits, scale, rows_per_split,
            fixed_tiles=False, descriptors=None, gate=None, batched=False):
    """k_strides, v_strides: (page, row, head) element strides; the last dimension is contiguous. gate: None,
    or [T, H, D] multiplied in by sigmoid in the epilogue. batched: q's rows are B sequences of one query each,
    start [B] and page_table [B, pages] (paged_decode_attention)."""
    num_rows_q, num_heads, head_dim = q.shape
    num_q = 1 if batched else num_rows_q  # queries of one sequence
    num_kv = k.shape[-2]
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} must be a multiple of KV heads {num_kv}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last dimension")
    group = num_heads // num_kv
    cfg = _config(num_q, group, head_dim, fixed_tiles)
    if rows_per_split < 0 or rows_per_split % cfg["BN"]:
        raise ValueError(f"rows_per_split must be a multiple of {cfg['BN']}; got {rows_per_split}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if gate is not None:
        if gate.shape != q.shape or gate.dtype != q.dtype:
            raise ValueError(f"gate must match q {tuple(q.shape)} {q.dtype}; got {tuple(gate.shape)} {gate.dtype}")
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    out = torch.empty(num_rows_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_rows_q == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else scale
    want = max_splits(num_q, num_heads, num_kv, head_dim)
    if num_splits is None and rows_per_split:
        raise ValueError("a forced split size needs the launch's split count (max_rows): it cannot be bounded")
    splits = want if num_splits is None else num_splits
    is_split = splits > 1
    if is_split:
        part = torch.empty(splits, num_rows_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, num_rows_q, num_heads, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (num_rows_q if batched else triton.cdiv(num_q * group, cfg["BM"]), num_kv, splits)
    k_desc, v_desc = (None, None) if descriptors is None or _decode_tiles(num_q, group, fixed_tiles) else descriptors
    gate_args = (out, 0, 0) if gate is None else (gate, gate.stride(0), gate.stride(1))  # (out: unread)
    _attn_kernel[grid](
        q, k, v, k_desc, v_desc, page_table, start, out, part, lse, gate_args[0],
        num_q, num_heads, page_rows, rows_per_split, scale * LOG2_E,
        q.stride(0), q.stride(1), *k_strides, *v_strides, out.stride(0), out.stride(1), *gate_args[1:],
        page_table.stride(0) if batched else 0,
        G=group, D=head_dim, BD=block_d, BM=cfg["BM"], BN=cfg["BN"], WANT=want, MIN_ROWS=cfg["MIN_ROWS"],
        SPLIT=is_split, DOT_FP32=interpreting() and q.dtype != torch.float32, TMA=k_desc is not None,
        GATE=gate is not None, LAZY=LAZY_RESCALE_LOG2, FUSED=FUSED_SCALE, WS=WARP_SPECIALIZE and k_desc is not None,
        BATCHED=batched, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.options()
    )
    if is_split:
        # chosen by the queries of one sequence, never by the batch: the column block sets the layout of the
        # split reduction (tl.sum over the splits), and so its order; a decode round's row must reduce as the
        # same query alone does, whatever B is (B >= 16 took the wide block, and other bits, before)
        combine_d = min(block_d, COMBINE_BLOCK_D) if num_q < COMBINE_SPLIT_D_BELOW_ROWS else block_d
        _attn_combine_kernel[(num_rows_q, num_heads, triton.cdiv(head_dim, combine_d))](
            part, lse, out, gate_args[0], splits, num_rows_q, num_heads, out.stride(0), out.stride(1), *gate_args[1:],
            D=head_dim, BD=combine_d, BS=COMBINE_BLOCK_SPLITS, BS_ALL=max(16, triton.next_power_of_2(splits)),
            GATE=gate is not None, num_warps=4, **pdl.options()
        )
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None = None) -> torch.Tensor:
    """Triton twin of naive.attention: q [T, H, D] at positions q_start.., k, v [L, Hkv, D] -> [T, H, D].

    Launches just the splits this context needs (the bits equal a launch of max_splits)."""
    return attention_split(q, k, v, q_start, scale, 0)


def attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                        scale: float | None = None) -> torch.Tensor:
    """attention, grid-invariant: one tile shape, splits of INVARIANT_SPLIT_ROWS rows."""
    return attention_split(q, k, v, q_start, scale, INVARIANT_SPLIT_ROWS, fixed_tiles=True)


def paged_attention_invariant(q, k_pages, v_pages, page_table, start, max_rows=None, scale=None, gate=None):
    """paged_attention, grid-invariant: one tile shape, splits of INVARIANT_SPLIT_ROWS rows."""
    return paged_attention(q, k_pages, v_pages, page_table, start, max_rows, scale, INVARIANT_SPLIT_ROWS, True, gate)


def attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None,
                    rows_per_split: int, num_splits: int | None = None, fixed_tiles: bool = False) -> torch.Tensor:
    """attention with R forced (rows_per_split > 0, a multiple of the kernel's BN; tests use it to force
    splits) and the launched split count given (None: what the context needs)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k, v [L, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_q, num_heads, head_dim = q.shape
    num_rows, num_kv = k.shape[0], k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} must be a multiple of KV heads {num_kv}")
    if q_start < 0 or num_rows < q_start + num_q:
        raise ValueError(f"k, v hold {num_rows} rows; queries at {q_start}..{q_start + num_q - 1} need at least {q_start + num_q}")
    rows = rows_per_split or split_rows(num_q, num_heads, num_kv, head_dim, q_start + num_q)
    if num_splits is None:
        num_splits = triton.cdiv(q_start + num_q, rows)
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    start = torch.tensor([q_start], dtype=torch.int32, device=q.device)
    table = torch.zeros(1, dtype=torch.int32, device=q.device)
    # one endless page: every row is on page 0, the page stride is never used
    return _launch(q, k, v, CONTIGUOUS_PAGE_ROWS, (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1)),
                   table, start, num_splits, scale, rows_per_split, fixed_tiles)


__all__ = ["INVARIANT_SPLIT_ROWS", "attention", "attention_invariant", "attention_split", "max_splits",
           "paged_attention", "paged_attention_invariant", "paged_decode_attention", "paged_decode_attention_invariant", "split_rows", "splits_for"]
