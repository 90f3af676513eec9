"""x @ w^T in Triton with one pinned tiling for every row count; the naive twin is naive.dense_matmul.

cuBLAS picks its algorithm (tile shape, split-K) by the problem's shape, so the same row multiplied
inside a call of 512 rows and inside a call of 2,048 rows may round differently. Here every output
tile is BM x BN, its K loop runs in BK steps from 0 upwards in one program (no split-K), and none of
this depends on M: a row's result depends on that row, the weight and its place inside a BM-row tile,
so calls that start on a multiple of BM rows (grid chunks and forks, which start on grid lines) give
each row the same bits however many rows came with it. That is what makes a forward grid-invariant (QSE_KERNELS=invariant): a state read on one grid equals the state read on
another, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3
GROUP_M = 8  # programs walk the output in groups of rows for L2 reuse (an order, not a reduction)


@triton.jit
def grouped_tile(num_rows, num_cols, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """This program's BM x BN output tile, walked GROUP tile rows at a time (for L2 reuse; an order, not a
    reduction): (its column tile, row offsets, column offsets, row mask, column mask)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows, BM)
    num_pid_n = tl.cdiv(num_cols, BN)
    per_group = GROUP * num_pid_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(num_pid_m - first_m, GROUP)
    i_m = first_m + (pid % per_group) % group_rows
    i_n = (pid % per_group) // group_rows
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    return i_n, o_m, o_n, o_m < num_rows, o_n < num_cols


@triton.jit
def load_k_step(x_ptr, w_ptr, o_m, o_n, m_m, m_n, k0, depth, stride_xm, stride_wn, BK: tl.constexpr):
    """The K step from `k0` of a tile: x's [BM, BK] and w's [BN, BK] (zeros past the edges)."""
    o_k = k0 + tl.arange(0, BK)
    m_k = o_k < depth
    b_x = tl.load(x_ptr + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                  other=0.0)
    b_w = tl.load(w_ptr + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                  other=0.0)
    return b_x, b_w


@triton.jit
def store_tile(y_ptr, acc, o_m, o_n, m_m, m_n, stride_ym):
    """The tile's fp32 accumulator into y, in y's dtype."""
    p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _gemm_kernel(
    x_ptr, w_ptr, y_ptr, num_rows, num_cols, depth, stride_xm, stride_wn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    _, o_m, o_n, m_m, m_n = grouped_tile(num_rows, num_cols, BM, BN, GROUP)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, depth, BK):
        b_x, b_w = load_k_step(x_ptr, w_ptr, o_m, o_n, m_m, m_n, k0, depth, stride_xm, stride_wn, BK)
        if DOT_FP32:
            b_x, b_w = b_x.to(tl.float32), b_w.to(tl.float32)
        if IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmul
            acc += tl.dot(b_x, tl.trans(b_w), input_precision="ieee")
        else:
            acc += tl.dot(b_x, tl.trans(b_w))
    store_tile(y_ptr, acc, o_m, o_n, m_m, m_n, stride_ym)


def dense_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in out_dtype (default x's dtype; fp32 accumulation either way)."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., K] and w [N, K] must share K; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    num_rows, depth = x2.shape
    num_cols = w.shape[0]
    y = torch.empty(num_rows, num_cols, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(num_cols, BLOCK_N),)
        _gemm_kernel[grid](
            x2, w, y, num_rows, num_cols, depth, x2.stride(0), w.stride(0), y.stride(0),
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, GROUP=GROUP_M,
            DOT_FP32=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return y.reshape(*lead, num_cols)


__all__ = ["dense_matmul"]
