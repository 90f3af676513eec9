"""One row times a weight, x [1, K] @ w [N, K]^T, in Triton: the decode step's projections and the logits
head of one row; the naive twin is naive.dense_matmul (and, for a float32 output, the head's fp32 GEMM).

A decode step reads every weight once for one row: it is bound by memory, and cuBLAS's choice for
M = 1 read the 0.8B's 1.5 GB at ~1.9 TB/s on the H200 (0.78 ms of the 1.79 ms fork-decode step).
Here each program owns BN whole rows of w and streams them in BK-column steps, accumulating x * w
elementwise in fp32 and reducing once at the end, so a row's result depends only on x, that row and
the pinned (BN, BK); no split-K, no atomics. Small N takes narrow programs so that enough of them run.

A batched decode round has a few rows (2 to ROWS_MAX), still bound by memory: gemv_rows reads each weight
tile once for all of them, each thread holding every row's products for its (n, k) lanes. A row's lanes, its
k steps and its final sum follow gemv's (the same BK and warps along k), so a row's result is the same bits
alone or among others: a sequence's greedy tokens do not depend on who shares its round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # BN * BK: 32 fp32 accumulators a thread at 4 warps
WIDE_ROWS, NARROW_ROWS = 16, 4  # BN for N >= WIDE_FROM, and below it
WIDE_FROM = 8192
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, num_cols, depth, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    m_n = o_n < num_cols
    o_k = tl.arange(0, BK)
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, depth, BK):
        m_k = (k0 + o_k) < depth
        b_w = tl.load(p_w + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0)
        acc += b_w.to(tl.float32) * b_x.to(tl.float32)[None, :]
    tl.store(y_ptr + o_n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, y_ptr, num_rows, num_cols, depth, stride_xm, stride_ym, stride_wn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    o_m = tl.arange(0, BM)
    m_m = o_m < num_rows
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    m_n = o_n < num_cols
    o_k = tl.arange(0, BK)
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn
    p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BM, BN, BK), tl.float32)
    for k0 in range(0, depth, BK):
        m_k = (k0 + o_k) < depth
        b_w = tl.load(p_w + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(p_x + (k0 + o_k)[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        acc += b_w.to(tl.float32)[None, :, :] * b_x.to(tl.float32)[:, None, :]
    p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, tl.sum(acc, 2).to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


ROWS_BLOCK_N = NUM_WARPS  # weight rows a rows-GEMV program takes where a warp's threads cover BK: a warp a row
ROWS_MAX = 8  # past this, a round's projections go to cuBLAS (more rows than the registers hold a lane)


def tiles(num_cols: int) -> tuple[int, int]:
    """(BN, BK), pinned by N alone."""
    rows = WIDE_ROWS if num_cols >= WIDE_FROM else NARROW_ROWS
    return rows, TILE_ELEMENTS // rows


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) @ w [N, K]^T -> [1, N] (or [N]) in out_dtype (default x's dtype), fp32 accumulation."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.numel() != w.shape[1]:
        raise ValueError(f"x must be one row [1, K] and w [N, K] with the same K; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x1 = x.reshape(-1)
    x1 = x1 if x1.stride(0) == 1 else x1.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    num_cols, depth = w.shape
    y = torch.empty(*x.shape[:-1], num_cols, dtype=out_dtype, device=x.device)
    block_n, block_k = tiles(num_cols)
    _gemv_kernel[(triton.cdiv(num_cols, block_n),)](x1, w, y, num_cols, depth, w.stride(0), BN=block_n, BK=block_k,
                                                     num_warps=NUM_WARPS)
    return y


def rows_tiles(num_cols: int, num_rows: int) -> tuple[int, int, int]:
    """(BM, BN, BK) of gemv_rows: gemv's BK (a row's summation order), every row in each thread's registers
    (BM, a power of two), and as many weight rows as keep a program's accumulators at gemv's budget a row
    times BM: NUM_WARPS rows where threads cover BK (warps then lie along n), one where warps lie along k."""
    block_k = tiles(num_cols)[1]
    block_m = triton.next_power_of_2(num_rows)
    lanes = 32 * 8  # a warp's threads times a thread's contiguous elements: the k extent one warp covers
    block_n = ROWS_BLOCK_N if block_k <= lanes else 1
    return block_m, block_n, block_k


def gemv_rows(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] for 1 <= M <= ROWS_MAX, each row the bits gemv gives it alone."""
    if w.dim() != 2 or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K] with the same K; got {tuple(x.shape)} and {tuple(w.shape)}")
    if not 1 <= x.shape[0] <= ROWS_MAX:
        raise ValueError(f"gemv_rows takes 1 to {ROWS_MAX} rows; got {x.shape[0]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    (num_rows, depth), num_cols = x.shape, w.shape[0]
    y = torch.empty(num_rows, num_cols, dtype=out_dtype, device=x.device)
    block_m, block_n, block_k = rows_tiles(num_cols, num_rows)
    _gemv_rows_kernel[(triton.cdiv(num_cols, block_n),)](x, w, y, num_rows, num_cols, depth, x.stride(0), y.stride(0),
                                                         w.stride(0), BM=block_m, BN=block_n, BK=block_k,
                                                         num_warps=NUM_WARPS)
    return y


__all__ = ["ROWS_MAX", "gemv", "gemv_rows", "rows_tiles", "tiles"]
