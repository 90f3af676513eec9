"""One row times a weight, x [1, K] @ w [N, K]^T, in Triton: the decode step's projections and the logits
head of one row; the naive twin is naive.dense_matmul (and, for a float32 output, the head's fp32 GEMM).

A decode step reads every weight once for one row: it is bound by memory, and cuBLAS's choice for
M = 1 read the 0.8B's 1.5 GB at ~1.9 TB/s on the H200 (0.78 ms of the 1.79 ms fork-decode step).
Here each program owns BN whole rows of w and streams them in BK-column steps, accumulating x * w
elementwise in fp32 and reducing once at the end, so a row's result depends only on x, that row and
the pinned (BN, BK); no split-K, no atomics. Small N takes narrow programs so that enough of them run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

TILE_ELEMENTS = 4096  # BN * BK: 32 fp32 accumulators a thread at 4 warps
WIDE_ROWS, NARROW_ROWS = 16, 4  # BN for N >= WIDE_FROM, and below it
WIDE_FROM = 8192
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, num_cols, depth, stride_wn, BN: tl.constexpr, BK: tl.constexpr,
                 PDL: tl.constexpr = 0):
    pdl.start(PDL)
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
                                                     num_warps=NUM_WARPS, **pdl.options())
    return y


__all__ = ["gemv", "tiles"]
