"""Small fusions in Triton: the residual add with the next norm, SiLU(gate) * up, the attention layer's
q/k norm with the rotary embedding (on a paged KV also storing the layer's K/V rows), and its output gate;
the naive twins are naive.add_rms_norm, naive.silu_mul, naive.qk_norm_rotary, naive.qk_norm_rotary_paged
and naive.sigmoid_gate.

Each replaces a handful of torch launches by one. That matters most where a forward is one token (fork
decode, the served model's decode under a CUDA graph: ~500 launches of a few microseconds each), and the
bytes saved matter in the 512-row chunk. Every kernel rounds where its twin rounds (to the activation
dtype after the add, after the norm, after each rotary product), so the two agree to the dtype's ulp.
A program holds whole rows, sized by the row length alone: a row's result never depends on how many
rows came with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

from .norms import NORM_NUM_WARPS, _row_blocks, _rows, _store_rms_norm, _tl_dtype

SILU_BLOCK_T = 8
SILU_BLOCK_N = 512


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, h_ptr, w_ptr, s_ptr, y_ptr, num_rows, stride_x, stride_h, stride_s, stride_y, eps,
    D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < num_rows)[:, None] & (o_d < D)[None, :]
    b_s = _add_rows(x_ptr, h_ptr, s_ptr, o_r, o_d, m, m, stride_x, stride_h, stride_s)
    _store_rms_norm(b_s.to(tl.float32), w_ptr, y_ptr, o_r, o_d, m, stride_y, eps, D)


@triton.jit
def _add_rows(x_ptr, h_ptr, s_ptr, o_r, o_d, m, m_store, stride_x, stride_h, stride_s):
    """s = x + h of the rows o_r in s's dtype, stored where m_store holds, returned (the add_rms_norm kernel's
    add; moe's norm-and-router launch runs it on the same tile)."""
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_h = tl.load(h_ptr + o_r[:, None] * stride_h + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    # the residual stream is kept in its dtype: round the sum first, then normalise what was stored
    b_s = (b_x + b_h).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + o_r[:, None] * stride_s + o_d[None, :], b_s, mask=m_store)
    return b_s


@triton.jit
def _silu_mul_kernel(
    gu_ptr, y_ptr, num_rows, width, stride_gu, stride_y,
    BT: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (o_t < num_rows)[:, None] & (o_n < width)[None, :]
    p_g = gu_ptr + o_t[:, None] * stride_gu + o_n[None, :]
    b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(p_g + width, mask=m, other=0.0)
    # the twin: silu in fp32 rounded to the dtype, then the product rounded again
    b_act = (b_g * tl.sigmoid(b_g)).to(b_u.dtype)
    b_y = b_act.to(tl.float32) * b_u.to(tl.float32)
    tl.store(y_ptr + o_t[:, None] * stride_y + o_n[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _sigmoid_gated(b_x, p_gate, m):
    """b_x * sigmoid(gate) for b_x in the output's dtype, rounded where the twin rounds (the sigmoid to that
    dtype, then the product): the sigmoid_gate kernel and the attention kernels' epilogues (attention.py)
    share it, so a gate applied in the epilogue has the bits of sigmoid_gate applied after."""
    b_g = tl.load(p_gate, mask=m, other=0.0)
    b_s = tl.sigmoid(b_g.to(tl.float32)).to(b_x.dtype)
    return (b_x.to(tl.float32) * b_s.to(tl.float32)).to(b_x.dtype)


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr, gate_ptr, y_ptr, num_rows, num_heads, stride_xt, stride_xh, stride_gt, stride_gh,
    D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < num_rows)[:, None] & (o_d < D)[None, :]
    o_t, o_h = o_r // num_heads, o_r % num_heads
    b_x = tl.load(x_ptr + (o_t * stride_xt + o_h * stride_xh)[:, None] + o_d[None, :], mask=m, other=0.0)
    b_y = _sigmoid_gated(b_x, gate_ptr + (o_t * stride_gt + o_h * stride_gh)[:, None] + o_d[None, :], m)
    tl.store(y_ptr + o_r[:, None] * D + o_d[None, :], b_y, mask=m)


@triton.jit
def _norm_rotary_rows(
    x_ptr, w_ptr, p_y, cos_ptr, sin_ptr, o_r, num_rows, num_heads, stride_t, stride_h, stride_c, eps,
    D: tl.constexpr, BD: tl.constexpr, RD: tl.constexpr,
):
    """BR rows (token, head) of x [T, H, D]: y = rotary(rms_norm(x) * (1 + w)), row i stored at p_y[i] (the
    pointers to the rows' first elements: a contiguous output, or the rows' places in a paged KV)."""
    o_d = tl.arange(0, BD)
    m_r = o_r < num_rows
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    o_t = o_r // num_heads
    base = x_ptr + o_t[:, None] * stride_t + (o_r % num_heads)[:, None] * stride_h
    b_x = tl.load(base + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    y_dtype = p_y.dtype.element_ty
    b_n = ((b_x * b_rstd[:, None]) * (1.0 + b_w)[None, :]).to(y_dtype)
    # rotate-half on the first RD dims: the partner of d is d + RD/2 (first half, taken negated) or d - RD/2;
    # it is loaded again and normalised by the same arithmetic, so it has the same bits as its own entry
    HALF: tl.constexpr = RD // 2
    is_rot = o_d < RD
    o_p = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    m_p = m & is_rot[None, :]
    b_xp = tl.load(base + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)
    b_wp = tl.load(w_ptr + o_p, mask=is_rot, other=0.0).to(tl.float32)
    # (negated in fp32: exact as well, and Triton's interpreter negates 16-bit floats as integers)
    b_np = ((b_xp * b_rstd[:, None]) * (1.0 + b_wp)[None, :]).to(y_dtype).to(tl.float32)
    b_np = tl.where((o_d < HALF)[None, :], -b_np, b_np)
    p_cs = o_t[:, None] * stride_c + o_d[None, :]
    b_cos = tl.load(cos_ptr + p_cs, mask=m_p, other=0.0)
    b_sin = tl.load(sin_ptr + p_cs, mask=m_p, other=0.0)
    # the twin computes x*cos and rot*sin in the dtype, then their sum: three roundings
    b_a = (b_n.to(tl.float32) * b_cos.to(tl.float32)).to(y_dtype)
    b_b = (b_np * b_sin.to(tl.float32)).to(y_dtype)
    b_rot = (b_a.to(tl.float32) + b_b.to(tl.float32)).to(y_dtype)
    b_y = tl.where(is_rot[None, :], b_rot, b_n)
    tl.store(p_y[:, None] + o_d[None, :], b_y, mask=m)


@triton.jit
def _qk_norm_rotary_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    v_ptr, kp_ptr, vp_ptr, table_ptr, start_ptr, page_rows,
    num_q_rows, num_k_rows, num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c, eps,
    stride_vt, stride_vh, stride_kpp, stride_kpr, stride_kph, stride_vpp, stride_vpr, stride_vph, stride_tb,
    D: tl.constexpr, BD: tl.constexpr, RD: tl.constexpr, BR: tl.constexpr, PAGED: tl.constexpr,
    BATCHED: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """The first programs take q's rows, the rest k's: one launch for both. PAGED: a k program stores its
    rows, and the same rows of v as they are, at sequence rows start.. of the paged KV (start read here,
    on the device, so a captured graph serves every position) instead of into ko. BATCHED: token t is the
    one new token of sequence t, at position start[t] of the pages in table row t (decode rounds)."""
    pdl.start(PDL)
    pid = tl.program_id(0)
    q_programs = tl.cdiv(num_q_rows, BR)
    if pid < q_programs:
        o_r = pid * BR + tl.arange(0, BR)
        _norm_rotary_rows(q_ptr, wq_ptr, qo_ptr + o_r * D, cos_ptr, sin_ptr, o_r, num_q_rows, num_q_heads,
                          stride_qt, stride_qh, stride_c, eps, D, BD, RD)
    else:
        o_r = (pid - q_programs) * BR + tl.arange(0, BR)
        if PAGED:
            m_r = o_r < num_k_rows
            o_t, o_h = o_r // num_k_heads, o_r % num_k_heads
            if BATCHED:
                o_pos = tl.load(start_ptr + o_t, mask=m_r, other=0)
                i_page = tl.load(table_ptr + o_t * stride_tb + o_pos // page_rows, mask=m_r, other=0).to(tl.int64)
            else:
                o_pos = tl.load(start_ptr) + o_t
                i_page = tl.load(table_ptr + o_pos // page_rows, mask=m_r, other=0).to(tl.int64)
            i_row = (o_pos % page_rows).to(tl.int64)
            p_k = kp_ptr + i_page * stride_kpp + i_row * stride_kpr + o_h * stride_kph
            _norm_rotary_rows(k_ptr, wk_ptr, p_k, cos_ptr, sin_ptr, o_r, num_k_rows, num_k_heads,
                              stride_kt, stride_kh, stride_c, eps, D, BD, RD)
            o_d = tl.arange(0, BD)
            m = m_r[:, None] & (o_d < D)[None, :]
            b_v = tl.load(v_ptr + (o_t * stride_vt + o_h * stride_vh)[:, None] + o_d[None, :], mask=m)
            p_v = vp_ptr + i_page * stride_vpp + i_row * stride_vpr + o_h * stride_vph
            tl.store(p_v[:, None] + o_d[None, :], b_v, mask=m)
        else:
            _norm_rotary_rows(k_ptr, wk_ptr, ko_ptr + o_r * D, cos_ptr, sin_ptr, o_r, num_k_rows, num_k_heads,
                              stride_kt, stride_kh, stride_c, eps, D, BD, RD)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.add_rms_norm: s = x + h (x's dtype), y = rms_norm(s, weight, eps)."""
    dim = x.shape[-1]
    if h.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"h must match x {tuple(x.shape)} and weight be [{dim}]; got {tuple(h.shape)}, {tuple(weight.shape)}")
    _tl_dtype(x.dtype)
    weight = weight.contiguous()
    x2, h2 = _rows(x), _rows(h)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s2, y2 = s.view(-1, dim), y.view(-1, dim)
    block_d, block_r = _row_blocks(dim)
    num_rows = x2.shape[0]
    if num_rows:
        _add_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x2, h2, weight, s2, y2, num_rows, x2.stride(0), h2.stride(0), s2.stride(0), y2.stride(0), eps,
            D=dim, BD=block_d, BR=block_r, num_warps=NORM_NUM_WARPS, **pdl.options()
        )
    return s, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.silu_mul: gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I]; got {tuple(gate_up.shape)}")
    _tl_dtype(gate_up.dtype)
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(num_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, SILU_BLOCK_T), triton.cdiv(width, SILU_BLOCK_N))
        _silu_mul_kernel[grid](gate_up, y, num_rows, width, gate_up.stride(0), y.stride(0),
                               BT=SILU_BLOCK_T, BN=SILU_BLOCK_N, num_warps=NORM_NUM_WARPS, **pdl.options())
    return y


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.sigmoid_gate: x * sigmoid(gate), x and gate [T, H, D] (strided views welcome),
    contiguous out in x's dtype."""
    x, gate = _heads_view(x, "x"), _heads_view(gate, "gate")
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"gate must match x {tuple(x.shape)} {x.dtype}; got {tuple(gate.shape)} {gate.dtype}")
    _tl_dtype(x.dtype)
    num_tokens, num_heads, dim = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_d, block_r = _row_blocks(dim)
    num_rows = num_tokens * num_heads
    if num_rows:
        _sigmoid_gate_kernel[(triton.cdiv(num_rows, block_r),)](
            x, gate, y, num_rows, num_heads, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
            D=dim, BD=block_d, BR=block_r, num_warps=NORM_NUM_WARPS, **pdl.options()
        )
    return y


def _heads_view(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D]; got {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.qk_norm_rotary: q [T, H, D], k [T, Hkv, D] (strided views welcome) -> both
    rms-normed with (1 + w) and rotated on their first cos.shape[-1] dims, contiguous, in q's dtype."""
    q, k = _check_qk(q, k, q_weight, k_weight, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_qk(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out, None)
    return q_out, k_out


def qk_norm_rotary_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                         start: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.qk_norm_rotary_paged: qk_norm_rotary's q returned, and its k (the same bits) with
    v [T, Hkv, D] as it is stored at sequence rows start.. of a paged KV, row r at k_pages[page_table[r //
    page_rows], r % page_rows] (k_pages, v_pages [P, page_rows, Hkv, D], any page stride, in q's dtype;
    page_table and start int32, start [1] on the device). One launch instead of the norm and two scatters."""
    q, k = _check_qk(q, k, q_weight, k_weight, cos, sin)
    v = _heads_view(v, "v")
    _check_pages(k, v, k_pages, v_pages)
    check_page_table(page_table, start)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_qk(q, k, q_weight, k_weight, cos, sin, eps, q_out, None, (v, k_pages, v_pages, page_table, start))
    return q_out


def _check_pages(k, v, k_pages, v_pages) -> None:
    """v like k, and the pages [P, page_rows, Hkv, D] of k's heads and dtype with contiguous rows."""
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k {tuple(k.shape)} {k.dtype}; got {tuple(v.shape)} {v.dtype}")
    if (k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[2:] != k.shape[1:]
            or k_pages.dtype != k.dtype or v_pages.dtype != k.dtype or k_pages.stride(3) != 1 or v_pages.stride(3) != 1):
        raise ValueError(f"k, v pages must be [P, page_rows, {k.shape[1]}, {k.shape[2]}] in {k.dtype} with contiguous "
                         f"rows; got {tuple(k_pages.shape)} {k_pages.dtype}, {tuple(v_pages.shape)} {v_pages.dtype}")


def qk_norm_rotary_paged_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                              k_pages: torch.Tensor, v_pages: torch.Tensor, page_tables: torch.Tensor,
                              positions: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.qk_norm_rotary_paged_rows: qk_norm_rotary_paged for B sequences of one token each
    in one launch, row b's k and v stored at position positions[b] (int32 [B]) of the pages page_tables[b]
    (int32 [B, >= pages used]). Every row has the arithmetic of qk_norm_rotary_paged; returns q."""
    q, k = _check_qk(q, k, q_weight, k_weight, cos, sin)
    v = _heads_view(v, "v")
    _check_pages(k, v, k_pages, v_pages)
    check_page_tables(page_tables, positions, q.shape[0])
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_qk(q, k, q_weight, k_weight, cos, sin, eps, q_out, None, (v, k_pages, v_pages, page_tables, positions),
               batched=True)
    return q_out


def check_page_tables(page_tables: torch.Tensor, positions: torch.Tensor, num_rows: int) -> None:
    """B sequences' page tables and positions as the batched kernels read them on the device: int32 [B, pages]
    (rows of unit stride) and int32 [B]."""
    if (page_tables.dtype != torch.int32 or positions.dtype != torch.int32 or page_tables.dim() != 2
            or page_tables.shape[0] != num_rows or positions.shape != (num_rows,) or page_tables.stride(1) != 1):
        raise ValueError(f"page_tables must be int32 [{num_rows}, pages] (contiguous rows) and positions int32 "
                         f"[{num_rows}]; got {page_tables.dtype} {tuple(page_tables.shape)}, {positions.dtype} "
                         f"{tuple(positions.shape)}")


def check_page_table(page_table: torch.Tensor, start: torch.Tensor) -> None:
    """A paged KV's page table and start position as the kernels read them on the device (here and in
    attention.paged_attention): int32, start of one element."""
    if page_table.dtype != torch.int32 or start.dtype != torch.int32 or start.numel() != 1:
        raise ValueError(f"page_table and start must be int32 tensors (start of one element); got "
                         f"{page_table.dtype}, {start.dtype} x {start.numel()}")


def _check_qk(q, k, q_weight, k_weight, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _heads_view(q, "q"), _heads_view(k, "k")
    num_tokens, _, dim = q.shape
    rotary_dim = cos.shape[-1]
    if k.shape[0] != num_tokens or k.shape[2] != dim or k.dtype != q.dtype:
        raise ValueError(f"k must be [T, Hkv, D] = [{num_tokens}, *, {dim}] in {q.dtype}; got {tuple(k.shape)} {k.dtype}")
    if q_weight.shape != (dim,) or k_weight.shape != (dim,):
        raise ValueError(f"norm weights must be [{dim}]; got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    if cos.shape != sin.shape or cos.shape[0] != num_tokens or rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"cos, sin must be [T, RD] with RD even and <= {dim}; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    _tl_dtype(q.dtype)
    return q, k


def _launch_qk(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out, paged, batched=False):
    """paged: None (k into k_out), or (v, k_pages, v_pages, page_table, start); batched: a page-table row and a
    start for each token (qk_norm_rotary_paged_rows)."""
    num_tokens, num_q_heads, dim = q.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    block_d, block_r = _row_blocks(dim)
    num_q_rows, num_k_rows = num_tokens * num_q_heads, num_tokens * k.shape[1]
    if not num_tokens:
        return
    if paged is None:
        v, k_pages, v_pages, page_table, start = k, k_out, k_out, k_out, k_out  # unread without PAGED
        page_rows, v_strides, page_strides = 1, (0, 0), (0,) * 6
    else:
        v, k_pages, v_pages, page_table, start = paged
        page_rows, v_strides = k_pages.shape[1], (v.stride(0), v.stride(1))
        page_strides = (*k_pages.stride()[:3], *v_pages.stride()[:3])
    grid = (triton.cdiv(num_q_rows, block_r) + triton.cdiv(num_k_rows, block_r),)
    _qk_norm_rotary_kernel[grid](
        q, k, q_weight.contiguous(), k_weight.contiguous(), q_out, k_out if k_out is not None else q_out, cos, sin,
        v, k_pages, v_pages, page_table, start, page_rows,
        num_q_rows, num_k_rows, num_q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
        *v_strides, *page_strides, page_table.stride(0) if batched else 0,
        D=dim, BD=block_d, RD=cos.shape[-1], BR=block_r, PAGED=paged is not None, BATCHED=batched,
        num_warps=NORM_NUM_WARPS, **pdl.options()
    )


__all__ = ["add_rms_norm", "check_page_tables", "qk_norm_rotary", "qk_norm_rotary_paged", "qk_norm_rotary_paged_rows",
           "sigmoid_gate", "silu_mul"]
