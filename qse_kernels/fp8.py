"""FP8 block weights read as they are stored: x @ dequant(w)^T without a dequantised copy of w.

w is e4m3 [N, K] with one fp32 scale per 128 x 128 block (`scale_inv` [ceil(N/128), ceil(K/128)], Qwen's FP8
checkpoints). The naive twins are naive.fp8_block_gemv and naive.fp8_block_gemm; both kernels give the twin's
bits under the interpreter, and a row's result never depends on how many rows a call holds.

GEMV (one row, decode): memory-bound, so the arithmetic is spelled out rather than left to a reduction
primitive. A program owns BN rows of w (inside one 128-row scale block) and 128 fp32 lanes a row; for each
128-column block kb, lane j adds (w[n, kb*128 + j] * x[kb*128 + j]) * scale[n, kb]; the 128 lanes are then
summed in a fixed pairwise tree (lanes 2i and 2i+1, then pairs of pairs). No fused multiply-add
(enable_fp_fusion=False), so every operation rounds as the twin's does, on the GPU too.

GEMM (several rows: prefill chunks, forks): the tensor cores. For each 128-column block, one dot of the x tile
with the w tile (e4m3 widened to x's dtype, exactly) accumulated in fp32, then acc += dot * scale (unfused). The
tile shape is pinned (no split-K, nothing depends on M), so each row's bits depend on that row alone. Under
Triton's interpreter the block dot runs in fp64 and is rounded once to fp32: the products of e4m3 and 16-bit
values are exact there, so the twin (the same in torch) gets the same bits; on the GPU the tensor cores'
fp32 accumulation agrees with it to rounding.

The interpreter casts fp32 to bf16 by truncation, the GPU (and torch) round to nearest even: interpreted, the
kernels store fp32 and the wrapper casts, so the bits are the GPU's rounding there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .gemm import grouped_tile, load_k_step, store_tile

SCALE_BLOCK = 128  # rows and columns of w under one scale
GEMV_WIDE_ROWS, GEMV_NARROW_ROWS = 16, 4  # BN for N >= GEMV_WIDE_FROM, and below it (both divide SCALE_BLOCK)
GEMV_WIDE_FROM = 8192
GEMV_WARPS = 4
GEMM_BM, GEMM_BN = 64, 128  # BK is SCALE_BLOCK: one scale a tile and K step
GEMM_WARPS, GEMM_STAGES = 8, 3
GEMM_GROUP_M = 8


def _check(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> None:
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w must be a 2-D float8_e4m3fn matrix, got {w.dtype} of shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., K] and w [N, K] must share K; got {tuple(x.shape)} and {tuple(w.shape)}")
    want = (triton.cdiv(w.shape[0], SCALE_BLOCK), triton.cdiv(w.shape[1], SCALE_BLOCK))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be float32 {want} for w {tuple(w.shape)}; got {scale_inv.dtype} "
                         f"{tuple(scale_inv.shape)}")


def _store_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """What the kernel stores: fp32 under the interpreter (its casts truncate; the wrapper rounds), else out_dtype."""
    return torch.float32 if interpreting() else out_dtype


@triton.jit
def _pair_sum(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, WIDTH] -> [ROWS, WIDTH // 2]: column i is t[:, 2i] + t[:, 2i + 1]."""
    a, b = tl.split(tl.reshape(t, (ROWS, WIDTH // 2, 2)))
    return a + b


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, num_cols, depth, stride_wn, stride_sn,
                     BN: tl.constexpr, BK: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < num_cols
    o_k = tl.arange(0, BK)
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn
    p_s = s_ptr + ((i_n * BN) // BK) * stride_sn  # the program's rows lie in one scale block
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, depth, BK):
        m_k = (k0 + o_k) < depth
        b_w = tl.load(p_w + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_x = tl.load(x_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_s = tl.load(p_s + k0 // BK)
        acc += (b_w * b_x[None, :]) * b_s
    t = _pair_sum(acc, BN, BK)  # BK == 128: seven halvings
    t = _pair_sum(t, BN, BK // 2)
    t = _pair_sum(t, BN, BK // 4)
    t = _pair_sum(t, BN, BK // 8)
    t = _pair_sum(t, BN, BK // 16)
    t = _pair_sum(t, BN, BK // 32)
    t = _pair_sum(t, BN, BK // 64)
    tl.store(y_ptr + o_n, tl.reshape(t, (BN,)).to(y_ptr.dtype.element_ty), mask=m_n)


def gemv_rows(num_cols: int) -> int:
    """BN of the GEMV, pinned by N alone."""
    return GEMV_WIDE_ROWS if num_cols >= GEMV_WIDE_FROM else GEMV_NARROW_ROWS


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One row x [1, K] (or [K]) @ dequant(w)^T -> [1, N] (or [N]) in out_dtype (default x's dtype)."""
    _check(x, w, scale_inv)
    if x.numel() != w.shape[1]:
        raise ValueError(f"x must be one row [1, K]; got {tuple(x.shape)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x1 = x.reshape(-1)
    x1 = x1 if x1.stride(0) == 1 else x1.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    scale_inv = scale_inv.contiguous()
    num_cols, depth = w.shape
    y = torch.empty(*x.shape[:-1], num_cols, dtype=_store_dtype(out_dtype), device=x.device)
    rows = gemv_rows(num_cols)
    _fp8_gemv_kernel[(triton.cdiv(num_cols, rows),)](
        x1, w, scale_inv, y, num_cols, depth, w.stride(0), scale_inv.stride(0), BN=rows, BK=SCALE_BLOCK,
        num_warps=GEMV_WARPS, enable_fp_fusion=False)
    return y.to(out_dtype)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, num_rows, num_cols, depth, stride_xm, stride_wn, stride_sn,
                     stride_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                     EXACT: tl.constexpr, IEEE: tl.constexpr):
    i_n, o_m, o_n, m_m, m_n = grouped_tile(num_rows, num_cols, BM, BN, GROUP)
    p_s = s_ptr + ((i_n * BN) // BK) * stride_sn  # BN == BK: the tile's columns lie in one scale block
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, depth, BK):
        b_x, b_w = load_k_step(x_ptr, w_ptr, o_m, o_n, m_m, m_n, k0, depth, stride_xm, stride_wn, BK)
        if EXACT:  # the interpreter: the block dot exact in fp64, rounded once
            # (e4m3 through fp32: the interpreter's direct e4m3 -> fp64 cast fails on subnormals)
            part = tl.dot(b_x.to(tl.float64), tl.trans(b_w.to(tl.float32).to(tl.float64))).to(tl.float32)
        elif IEEE:  # fp32 activations: full fp32 products
            part = tl.dot(b_x, tl.trans(b_w.to(tl.float32)), input_precision="ieee")
        else:  # 16-bit activations: e4m3 widens to their dtype exactly; fp32 accumulation
            part = tl.dot(b_x, tl.trans(b_w.to(b_x.dtype)))
        acc += part * tl.load(p_s + k0 // BK)
    store_tile(y_ptr, acc, o_m, o_n, m_m, m_n, stride_ym)


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(w)^T -> [..., N] in x's dtype, every row through the same pinned tiles."""
    _check(x, w, scale_inv)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    scale_inv = scale_inv.contiguous()
    num_rows, depth = x2.shape
    num_cols = w.shape[0]
    y = torch.empty(num_rows, num_cols, dtype=_store_dtype(x.dtype), device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, GEMM_BM) * triton.cdiv(num_cols, GEMM_BN),)
        _fp8_gemm_kernel[grid](
            x2, w, scale_inv, y, num_rows, num_cols, depth, x2.stride(0), w.stride(0), scale_inv.stride(0),
            y.stride(0), BM=GEMM_BM, BN=GEMM_BN, BK=SCALE_BLOCK, GROUP=GEMM_GROUP_M, EXACT=interpreting(),
            IEEE=x.dtype == torch.float32, num_warps=GEMM_WARPS, num_stages=GEMM_STAGES, enable_fp_fusion=False)
    return y.to(x.dtype).reshape(*lead, num_cols)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """One row through the GEMV, more through the GEMM (each row-invariant; a row's bits differ between the two)."""
    if x.numel() == x.shape[-1]:
        return fp8_gemv(x, w, scale_inv)
    return fp8_gemm(x, w, scale_inv)


__all__ = ["SCALE_BLOCK", "fp8_gemm", "fp8_gemv", "fp8_matmul", "gemv_rows"]
