"""A few rows times a weight, x [M, K] @ w [N, K]^T for 1 <= M <= 32, in Triton: a speculative verify's k + 1
rows and a small batched decode round; the naive twin is naive.dense_matmul.

Like the one-row GEMV (gemv.py) this is bound by memory: the weight is read once for all M rows. Each program
owns BN rows of w (BN columns of y) and streams them in BK-column steps through one tensor-core product of a
[16, BK] tile of x by a [BK, BN] tile of w^T (or, swapped, w's [BN, BK] by x^T's [BK, 16]). x is padded
to 16 rows of zeros (their results are never stored), so the tile shape, the K order and the instructions
are the same for every M; element (i, j) of a tile product reads row i of x and row j of w only. Row
invariance follows: row i's bits depend on x[i] and w, never on M or on the other rows' values. 17 to 32 rows
(a verify of 8 sequences of 4 rows) take two such products a step, rows 0-15 and 16-31, of the one weight tile
loaded once: the same 16-row product shape, so the same bits as a call of 16 rows or fewer.

The tiling is pinned by (N, K) alone (`tiles`). Where N gives too few programs to keep the SMs reading, K is
cut into SPLIT fixed slices: each writes its fp32 partial sums, and a second kernel adds the slices in slice
order, so the split keeps the invariance (no atomics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting, pdl

TILE_ROWS = 16  # a tile product's rows: x is padded to them
MAX_ROWS = 2 * TILE_ROWS  # two products a weight tile
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Tiles(NamedTuple):
    """One launch shape, pinned per (N, K)."""

    block_n: int  # rows of w a program owns
    block_k: int  # columns of w a step reads
    splits: int  # fixed slices of K (1: no split, one kernel)
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # the product as w @ x^T ([BN, BK] x [BK, 16]: Hopper's wgmma takes BN >= 64 rows)


# pinned from benchmarks/skinny_bench.py's sweep on the H200 (benchmarks/results/skinny_bench-*.json), by N;
# below MID_FROM two slices of K (N / 64 * 2 programs)
NARROW = Tiles(64, 256, 2, 4, 3, swap_ab=True)
MID = Tiles(64, 128, 1, 4, 4, swap_ab=True)
WIDE = Tiles(64, 128, 1, 4, 4)
MID_FROM, WIDE_FROM = 8192, 16384


def tiles(num_cols: int, depth: int) -> Tiles:
    """The launch shape for w [N, K]; it never depends on M (that is the row invariance)."""
    del depth  # (pinned by N so far; K is in the signature so that a K-dependent choice stays a local change)
    return WIDE if num_cols >= WIDE_FROM else (MID if num_cols >= MID_FROM else NARROW)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_kernel(
    x_ptr, w_ptr, y_ptr, num_rows, num_cols, depth, split_depth, stride_xm, stride_wn, stride_ys, stride_ym,
    BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
    SWAP: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_m = tl.arange(0, 16)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    # x's rows past M load as zeros (masked: no traffic; repeating row M - 1 instead made every program read
    # the same lines, slower at small M); w's rows past N repeat row N - 1 (unmasked loads). A tile product's
    # element (i, j) reads only x's row i and w's row j, so neither touches a stored result.
    m_m = o_m < num_rows
    m_m2 = (o_m + 16) < num_rows  # TWO: the second product's rows, 16..31
    p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    p_x2 = p_x + 16 * stride_xm
    p_w = w_ptr + tl.minimum(o_n, num_cols - 1)[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    k_lo = i_s * split_depth
    k_hi = tl.minimum(k_lo + split_depth, depth)
    if SWAP:
        acc = tl.zeros((BN, 16), tl.float32)
        acc2 = tl.zeros((BN, 16), tl.float32)
    else:
        acc = tl.zeros((16, BN), tl.float32)
        acc2 = tl.zeros((16, BN), tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        m_k = (k0 + o_k) < depth  # (read where K is ragged: slices start on BK lines, so only K's own end is)
        if EVEN_K:
            b_w = tl.load(p_w + k0)
        else:
            b_w = tl.load(p_w + k0, mask=m_k[None, :], other=0.0)
        if DOT_FP32:  # the interpreter multiplies 16-bit dot operands as raw integers
            b_w = b_w.to(tl.float32)
        acc = _product(acc, _x_tile(p_x + k0, m_m, m_k, EVEN_K, DOT_FP32), b_w, SWAP, IEEE)
        if TWO:
            acc2 = _product(acc2, _x_tile(p_x2 + k0, m_m2, m_k, EVEN_K, DOT_FP32), b_w, SWAP, IEEE)
    y_ptr += i_s.to(tl.int64) * stride_ys
    _store_rows(y_ptr, acc, o_m, o_n, m_m, num_cols, stride_ym, SWAP)
    if TWO:
        _store_rows(y_ptr + 16 * stride_ym, acc2, o_m, o_n, m_m2, num_cols, stride_ym, SWAP)


@triton.jit
def _x_tile(p_x, m_m, m_k, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """16 rows of x at one K step: rows past M are zeros (masked: no traffic)."""
    if EVEN_K:
        b_x = tl.load(p_x, mask=m_m[:, None], other=0.0)
    else:
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
    if DOT_FP32:
        b_x = b_x.to(tl.float32)
    return b_x


@triton.jit
def _product(acc, b_x, b_w, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """acc + one K step of 16 rows of x by BN rows of w: [BN, 16] swapped, else [16, BN]."""
    if SWAP:
        if IEEE:  # fp32 operands: full fp32 products
            acc += tl.dot(b_w, tl.trans(b_x), input_precision="ieee")
        else:
            acc += tl.dot(b_w, tl.trans(b_x))
    else:
        if IEEE:
            acc += tl.dot(b_x, tl.trans(b_w), input_precision="ieee")
        else:
            acc += tl.dot(b_x, tl.trans(b_w))
    return acc


@triton.jit
def _store_rows(y_ptr, acc, o_m, o_n, m_m, num_cols, stride_ym, SWAP: tl.constexpr):
    if SWAP:
        p_y = y_ptr + o_m[None, :].to(tl.int64) * stride_ym + o_n[:, None]
        tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[None, :] & (o_n < num_cols)[:, None])
    else:
        p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
        tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & (o_n < num_cols)[None, :])


@triton.jit
def _sum_slices_kernel(part_ptr, y_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """y = part[0] + part[1] + ... in that order (part: [SPLITS, M, N] fp32, y: [M, N], both contiguous)."""
    pdl.start(PDL)
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    acc = tl.load(part_ptr + o, mask=m, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + o, mask=m, other=0.0)
    tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=m)


SUM_BLOCK = 1024


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  launch: Tiles | None = None) -> torch.Tensor:
    """x [..., K] with 1..32 rows @ w [N, K]^T -> [..., N] in out_dtype (x's dtype, or float32 for a logits
    head; fp32 accumulation either way). `launch` overrides the pinned tiling (benchmarks only: another
    tiling rounds differently)."""
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"skinny_matmul: x [..., K] and w [N, K] must share K; "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"skinny_matmul: x and w must share a dtype of {[str(d) for d in DTYPES]}; "
                         f"got {x.dtype} and {w.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"skinny_matmul: out_dtype must be x's dtype ({x.dtype}) or torch.float32; got {out_dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    num_rows, depth = x2.shape
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1 to {MAX_ROWS} rows; got {num_rows} (x {tuple(x.shape)}): "
                         f"use dense_matmul for more")
    if depth == 0:
        raise ValueError(f"skinny_matmul: K must be at least 1; got x {tuple(x.shape)} and w {tuple(w.shape)}")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    num_cols = w.shape[0]
    cfg = launch or tiles(num_cols, depth)
    y = torch.empty(num_rows, num_cols, dtype=out_dtype, device=x.device)
    if num_cols == 0:
        return y.reshape(*lead, num_cols)
    # slices of K on BK lines; the last may be short or, at a small K, absent (its partials are then zero)
    split_depth = triton.cdiv(triton.cdiv(depth, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(depth, split_depth)
    part = y if splits == 1 else torch.empty(splits, num_rows, num_cols, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_cols, cfg.block_n), splits)
    _skinny_kernel[grid](
        x2, w, part, num_rows, num_cols, depth, split_depth, x2.stride(0), w.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(-2),
        BN=cfg.block_n, BK=cfg.block_k, EVEN_K=depth % cfg.block_k == 0,
        DOT_FP32=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32, SWAP=cfg.swap_ab,
        TWO=num_rows > TILE_ROWS, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options()
    )
    if splits > 1:
        numel = num_rows * num_cols
        _sum_slices_kernel[(triton.cdiv(numel, SUM_BLOCK),)](part, y, numel, SPLITS=splits, BLOCK=SUM_BLOCK,
                                                             **pdl.options())
    return y.reshape(*lead, num_cols)


__all__ = ["MAX_ROWS", "TILE_ROWS", "Tiles", "skinny_matmul", "tiles"]
