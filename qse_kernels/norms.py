"""Row norms and the GDN gate in Triton; the naive twins are naive.rms_norm, naive.gated_rms_norm and
naive.gdn_gating.

A norm program holds BR whole rows; BR and the tile width depend on the row length D alone, so a row's
result never depends on how many rows came with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

# rows per program: about this many elements a tile
NORM_TILE_ELEMENTS = 4096
NORM_NUM_WARPS = 4
GATING_BLOCK_T = 64

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _tl_dtype(dtype: torch.dtype):
    if dtype not in _TL_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the Triton norms (float32, float16, bfloat16)")
    return _TL_DTYPES[dtype]


@triton.jit
def _store_rms_norm(b_x, w_ptr, y_ptr, o_r, o_d, m, stride_y, eps, D: tl.constexpr):
    """y = x / rms(x) * (1 + w) of the fp32 rows b_x [BR, BD], stored in y's dtype (every RMSNorm kernel)."""
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w_ptr + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    b_y = (b_x * b_rstd[:, None]) * (1.0 + b_w)[None, :]
    tl.store(y_ptr + o_r[:, None] * stride_y + o_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, num_rows, stride_x, stride_y, eps,
    D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < num_rows)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    _store_rms_norm(b_x, w_ptr, y_ptr, o_r, o_d, m, stride_y, eps, D)


@triton.jit
def _gated_rms_norm_rows(x_ptr, gate_ptr, w_ptr, y_ptr, o_r, num_rows, stride_x, gate_heads, stride_gate_t,
                         stride_gate_h, stride_y, eps, D: tl.constexpr, BD: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
                         X_CACHE: tl.constexpr = ""):
    """Rows o_r (those < num_rows) of the gated norm, stored in y's dtype. Row r of the gate is head r %
    gate_heads of token r // gate_heads: a gate sliced out of a fused projection [T, ...] is read where it
    lies. Every gated norm runs this on a tile of the same shape ([BR, BD], _row_blocks), so its row sum
    takes one layout and a row's bits do not depend on the launch (gdn_decode's fused step calls it too, its
    x loads then past L1: X_CACHE '.cg')."""
    o_d = tl.arange(0, BD)
    m = (o_r < num_rows)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.0, cache_modifier=X_CACHE)
    b_x = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    # the twin rounds the normalised value to x's dtype, then multiplies by w in the promoted dtype
    b_normed = (b_x * b_rstd[:, None]).to(x_ptr.dtype.element_ty)
    b_w = tl.load(w_ptr + o_d, mask=o_d < D, other=0.0)
    b_wn = (b_w.to(tl.float32)[None, :] * b_normed.to(tl.float32)).to(PRODUCT_DTYPE).to(tl.float32)
    o_gate = (o_r // gate_heads) * stride_gate_t + (o_r % gate_heads) * stride_gate_h
    b_gate = tl.load(gate_ptr + o_gate[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = b_wn * (b_gate * tl.sigmoid(b_gate))
    tl.store(y_ptr + o_r[:, None] * stride_y + o_d[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, y_ptr, num_rows, stride_x, gate_heads, stride_gate_t, stride_gate_h, stride_y, eps,
    D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, PRODUCT_DTYPE: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    _gated_rms_norm_rows(x_ptr, gate_ptr, w_ptr, y_ptr, o_r, num_rows, stride_x, gate_heads, stride_gate_t,
                         stride_gate_h, stride_y, eps, D, BD, PRODUCT_DTYPE)


@triton.jit
def _gdn_gates(b_a, b_b, b_a_log, b_dt_bias):
    """naive.gdn_gating on tiles: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), both fp32, from
    a and b as loaded and fp32 A_log, dt_bias of a's shape. The one copy of the formula: the gating kernel
    and the GDN kernels that gate their own inputs (gdn_chunk, gdn_recurrent) compute the same values."""
    b_x = b_a.to(tl.float32) + b_dt_bias
    # softplus as torch's (threshold 20), with log1p(y) = log(1 + y) * y / ((1 + y) - 1) for accuracy at small y
    b_e = tl.exp(tl.minimum(b_x, 20.0))
    b_1e = 1.0 + b_e
    b_tiny = b_1e == 1.0
    b_log1p = tl.where(b_tiny, b_e, tl.log(b_1e) * (b_e / tl.where(b_tiny, 1.0, b_1e - 1.0)))
    b_softplus = tl.where(b_x > 20.0, b_x, b_log1p)
    b_g = -tl.exp(b_a_log) * b_softplus
    # the twin's sigmoid runs in b's dtype
    b_beta = tl.sigmoid(b_b.to(tl.float32)).to(b_b.dtype).to(tl.float32)
    return b_g, b_beta


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    num_tokens, stride_at, stride_bt,
    HV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    m = (o_t < num_tokens)[:, None] & m_h[None, :]
    b_a = tl.load(a_ptr + o_t[:, None] * stride_at + o_h[None, :], mask=m, other=0.0)
    b_b = tl.load(b_ptr + o_t[:, None] * stride_bt + o_h[None, :], mask=m, other=0.0)
    b_a_log = tl.load(a_log_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_g, b_beta = _gdn_gates(b_a, b_b, b_a_log[None, :], b_dt[None, :])
    tl.store(g_ptr + o_t[:, None] * HV + o_h[None, :], b_g, mask=m)
    tl.store(beta_ptr + o_t[:, None] * HV + o_h[None, :], b_beta, mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit column stride; a view when the layout allows."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 or x2.shape[1] == 1 else x2.contiguous()


def _row_blocks(dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(dim)
    return block_d, max(1, NORM_TILE_ELEMENTS // block_d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of naive.rms_norm: x / rms(x) * (1 + w) over the last dim, fp32 inside, x's dtype out."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] for x of shape {tuple(x.shape)}; got {tuple(weight.shape)}")
    _tl_dtype(x.dtype)
    weight = weight.contiguous()
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, dim)
    block_d, block_r = _row_blocks(dim)
    num_rows = x2.shape[0]
    if num_rows:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x2, weight, y2, num_rows, x2.stride(0), y2.stride(0), eps,
            D=dim, BD=block_d, BR=block_r, num_warps=NORM_NUM_WARPS, **pdl.options()
        )
    return y


def _gate_layout(gate: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """(the gate's tensor, its heads, (token stride, head stride)) as _gated_rms_norm_rows reads it: a [T, H, D]
    with unit last stride (a slice of a fused projection) as it lies, else its rows."""
    if gate.dim() == 3 and gate.stride(2) == 1:
        return gate, gate.shape[1], (gate.stride(0), gate.stride(1))
    gate2 = _rows(gate)
    return gate2, 1, (gate2.stride(0), 0)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of naive.gated_rms_norm: (x / rms(x)) * w * silu(gate), x's dtype out."""
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"gate must match x {tuple(x.shape)} and weight be [{dim}]; got {tuple(gate.shape)}, {tuple(weight.shape)}")
    _tl_dtype(x.dtype)
    product_dtype = _tl_dtype(torch.promote_types(weight.dtype, x.dtype))
    weight = weight.contiguous()
    x2 = _rows(x)
    gate2, gate_heads, gate_strides = _gate_layout(gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, dim)
    block_d, block_r = _row_blocks(dim)
    num_rows = x2.shape[0]
    if num_rows:
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x2, gate2, weight, y2, num_rows, x2.stride(0), gate_heads, *gate_strides, y2.stride(0), eps,
            D=dim, BD=block_d, BR=block_r, PRODUCT_DTYPE=product_dtype, num_warps=NORM_NUM_WARPS, **pdl.options()
        )
    return y


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """Triton twin of naive.gdn_gating: a, b [T, Hv] -> g fp32 [T, Hv], beta fp32 [T, Hv]."""
    if a.dim() != 2 or b.shape != a.shape or a_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(f"a, b must be [T, Hv] and a_log, dt_bias [Hv]; got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    _tl_dtype(b.dtype)
    num_tokens, num_heads = a.shape
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    if num_tokens:
        _gdn_gating_kernel[(triton.cdiv(num_tokens, GATING_BLOCK_T),)](
            a, b, a_log, dt_bias, g, beta, num_tokens, a.stride(0), b.stride(0),
            HV=num_heads, BT=GATING_BLOCK_T, BH=triton.next_power_of_2(num_heads), num_warps=NORM_NUM_WARPS,
            **pdl.options()
        )
    return g, beta
