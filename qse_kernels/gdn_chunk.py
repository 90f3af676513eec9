"""Chunked gated delta rule (prefill) in Triton; the naive twin is naive.chunk_gated_delta_rule.

Three launches, no atomics, configurations pinned by the head dims alone:

  prepare  grid (chunks, Hv), every chunk in parallel. L2-normalises q and k (q also scaled by Dk^-1/2;
           row products run on the rows as stored, scaled by the norms after: exact for 16-bit rows),
           takes the chunk's cumulative log decay c, builds the strictly lower A of the chunk's system
           (I + A) U = beta V - beta e^c K S0, inverts the unit-lower (I + A) in fp32, and writes to an
           fp32 workspace:
             W  = (I + A)^-1 (beta e^c K)        [BT, Dk]
             U0 = (I + A)^-1 (beta V)            [BT, Dv]
             Qe = q e^c                          [BT, Dk]
             Kt = k e^(c_last - c)               [BT, Dk]  (16-bit rows: only the row scale, [BT])
             P  = (q k^T) e^(c_i - c_j), j <= i  [BT, BT]
             e^c_last                            scalar
  scan     grid (Hv, Dv / BV), chunks in order; the state slice S [Dk, BV] stays in fp32 registers and
           each chunk's starting state is kept:  S_c;  u = U0 - W S;  S <- e^c_last S + Kt^T u
  output   grid (chunks, Hv, Dv / BV), in parallel again:  o = Qe S_c + P (U0 - W S_c)

The Dv columns of the state never mix, so the scan splits them across programs. Each chunk runs the
same machine code whatever T is (the counts are not specialised), so T tokens in one call and the same
tokens in calls split on chunk lines give the same bits. Padded rows of a partial last chunk load
k = v = g = beta = 0 and so write zeros.

chunk_gated_delta_rule_from_gates takes the raw projections a, b instead of g, beta. With GATE_IN_PREPARE
the prepare kernel gates them itself (norms._gdn_gates, the gating kernel's own formula), one launch less
a GDN layer; it is off, as measured slower on the H200 (see the constant), and the gating kernel runs
first. Interpreted, both give the same bits; compiled, g may meet the cumulative sum in a register
instead of through memory, and the compiler may then contract the product into the first add (an FMA),
so they agree to the rounding of g. The exactness contract needs only one entry on both sides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .norms import _gdn_gates, _tl_dtype, gdn_gating

# fp32 operands through three tf32 products: close to fp32, still on the tensor cores. (One tf32
# product leaves ~1e-3 in the carried state, which then compounds from chunk to chunk.)
DOT_PRECISION = "tf32x3"
# the products that only reach the output (P = q k^T, and the output kernel's), never the carried state.
# A 16-bit output is rounded to ~3e-3 anyway, so one tf32 product does there: on the H200 it took the
# GDN rule from 114 to 99 us a 512-token chunk (0.8B shapes) and the state kept its bits
# (benchmarks/gdn_configs.py, output_products_tf32). A float32 output keeps the state's precision.
OUTPUT_DOT_PRECISION = "tf32x3"
OUTPUT_DOT_PRECISION_16BIT = "tf32"
# 16-bit q, k, v: the prepare kernel's row products (k k^T, q k^T) in one exact 16-bit product on the rows
# as stored, and W, U in two tf32 products against those rows (benchmarks/gdn_configs.py compares both)
EXACT_16BIT_PRODUCTS = True
INVERSE_BLOCK = 16
# 4 warps: with 8, Triton 3.6 miscompiled the 16-bit-row prepare for Dv = 16 on the H200 (a wrong state, an
# illegal address in the GPU tests) while every shape tried is right with 4, which is also faster at the
# model's shape (gdn_configs: 30.1 against 31.4 us)
PREPARE_NUM_WARPS = 4
# the gating inside the prepare kernel saves a launch a layer, but on the H200 the prepare then took 40.7
# instead of 35.3 us a layer (0.73 against 0.64 ms a 0.8B chunk, shadow_measure-graph-v10-*) while the
# gating kernel it replaces takes 2.7: so a chunk gates in its own kernel (decode gates in the recurrent
# kernel, where it pays: gdn_recurrent)
GATE_IN_PREPARE = False
SCAN_BLOCK_V = 16
SCAN_NUM_WARPS = 4
SCAN_NUM_STAGES = 1
OUTPUT_BLOCK_V = 64
OUTPUT_NUM_WARPS = 4


@triton.jit
def _dot_exact_left(a, b, EXACT16: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b for a of input rows as stored (16-bit: exact in tf32) and fp32 b: two tf32 products (b's
    leading 11 bits, then its remainder); fp32 a takes PRECISION."""
    a_f = a.to(tl.float32)
    if EXACT16:
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(a_f, b_hi, input_precision="tf32") + tl.dot(a_f, b - b_hi, input_precision="tf32")
    return tl.dot(a_f, b, input_precision=PRECISION)


@triton.jit
def _unit_lower_inverse(b_a, b_at, BT: tl.constexpr, SB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for strictly lower A [BT, BT] (b_at = A^T), in diagonal blocks of SB rows.

    The BT/SB diagonal blocks are inverted together by SB steps of forward substitution,
    X[i, :] = e_i - sum_{j<i} A[i, j] X[j, :], giving the block diagonal D = (I + A_diag)^-1 (A^T lets
    a row of A be read as a column, with no layout change). With N = D A_off (A below the diagonal
    blocks; N^(BT/SB) = 0), (I + A)^-1 = (I + N)^-1 D = (I - N + N^2 - ...) D: a few small matmuls.
    """
    NB: tl.constexpr = BT // SB
    o_b = tl.arange(0, NB)
    o_i = tl.arange(0, SB)
    same = o_b[:, None] == o_b[None, :]
    # diagonal blocks of A^T: at3[b, j, i] = A[b*SB + i, b*SB + j]
    at3 = tl.sum(tl.where(same[:, None, :, None], tl.reshape(b_at, (NB, SB, NB, SB)), 0.0), 2)
    x3 = tl.zeros((NB, SB, SB), tl.float32) + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)[None, :, :]
    for i in range(1, SB):
        b_ai = tl.sum(tl.where(o_i[None, None, :] == i, at3, 0.0), 2)  # [NB, SB] over j: A_b[i, j]
        b_s = tl.sum(b_ai[:, :, None] * x3, 1)  # [NB, SB] over columns
        x3 = x3 - tl.where(o_i[None, :, None] == i, b_s[:, None, :], 0.0)
    b_d = tl.reshape(tl.where(same[:, None, :, None], x3[:, :, None, :], 0.0), (BT, BT))
    o_r = tl.arange(0, BT)
    b_n = tl.dot(b_d, tl.where(o_r[:, None] // SB > o_r[None, :] // SB, b_a, 0.0), input_precision=PRECISION)
    b_eye = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    b_y = b_eye - b_n
    for _ in tl.static_range(NB - 2):
        b_y = b_eye - tl.dot(b_n, b_y, input_precision=PRECISION)
    return tl.dot(b_y, b_d, input_precision=PRECISION)


@triton.jit
def _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, i_h, o_t, m_t, stride_gt, stride_gh, stride_bt, stride_bh,
                GATES: tl.constexpr):
    """g and beta (fp32) of tokens o_t of value head i_h, zeros where m_t is false. GATES: g_ptr and beta_ptr
    hold the raw projections a and b, gated here by gdn_gating's own formula (one launch less a layer);
    else g and beta themselves."""
    b_x = tl.load(g_ptr + o_t * stride_gt + i_h * stride_gh, mask=m_t, other=0.0)
    b_y = tl.load(beta_ptr + o_t * stride_bt + i_h * stride_bh, mask=m_t, other=0.0)
    if GATES:
        b_a_log = tl.load(a_log_ptr + i_h).to(tl.float32)
        b_dt_bias = tl.load(dt_bias_ptr + i_h).to(tl.float32)
        b_g, b_beta = _gdn_gates(b_x, b_y, b_a_log, b_dt_bias)
        # a padded token is gated from a = 0 to a nonzero g: zero it, as a padded g loads
        return tl.where(m_t, b_g, 0.0), tl.where(m_t, b_beta, 0.0)
    return b_x.to(tl.float32), b_y.to(tl.float32)


@triton.jit
def _load_rows(ptr, o_t, m_t, stride_t, o_k, m_k):
    """[BT, BK] rows as stored (the input's dtype) and the inverse of each row's L2 norm (fp32)."""
    b_x = tl.load(ptr + o_t[:, None] * stride_t + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_f = b_x.to(tl.float32)
    return b_x, tl.rsqrt(tl.sum(b_f * b_f, 1) + 1e-6)


@triton.jit
def _dot_rows(a, b_t, EXACT16: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """a b^T of two blocks of input rows as stored: 16-bit rows in one 16-bit product (each product of two
    16-bit floats is exact in fp32, and so is all but the fp32 accumulation); fp32 rows by PRECISION."""
    if EXACT16 and not WIDEN:
        return tl.dot(a, tl.trans(b_t))
    if EXACT16:  # the interpreter's 16-bit products are wrong (qse_kernels.interpreting): widen, same values
        return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), input_precision="ieee")
    return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), input_precision=PRECISION)


@triton.jit
def _dot_exact_right(a, b, EXACT16: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b for fp32 a and a b of input rows as stored. 16-bit b is exact in tf32, so two tf32 products
    (a's leading 11 bits, then its remainder) carry what three carry for two fp32 operands; fp32 b takes
    PRECISION."""
    b_f = b.to(tl.float32)
    if EXACT16:
        a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(a_hi, b_f, input_precision="tf32") + tl.dot(a - a_hi, b_f, input_precision="tf32")
    return tl.dot(a, b_f, input_precision=PRECISION)


# The counts stay run-time arguments (Triton would otherwise compile a count of 1 as a constant): one call
# of N chunks and N calls of one chunk must run the same machine code.
@triton.jit(do_not_specialize=["num_tokens"])
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qe_ptr, kt_ptr, p_ptr, decay_ptr,
    num_tokens, num_v_heads, heads_per_key, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SB: tl.constexpr, PRECISION: tl.constexpr, OUT_PRECISION: tl.constexpr,
    EXACT16: tl.constexpr, WIDEN: tl.constexpr, GATES: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // heads_per_key
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < num_tokens
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = tl.arange(0, BV)
    m_v = o_v < DV
    i_w = i_c * num_v_heads + i_h  # this (chunk, head)'s slot in the workspace
    o_wk = (i_w * BT + o_r[:, None]) * DK + o_k[None, :]
    m_wk = m_k[None, :]

    b_g, b_beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, i_h, o_t, m_t,
                              stride_gt, stride_gh, stride_bt, stride_bh, GATES)
    b_c = tl.cumsum(b_g, 0)  # [BT]; flat past the last token, so b_c[BT-1] is the last token's
    b_c_last = tl.sum(tl.where(o_r == BT - 1, b_c, 0.0), 0)
    tl.store(decay_ptr + i_w, tl.exp(b_c_last))
    causal = o_r[:, None] >= o_r[None, :]  # [i, j]: j <= i
    b_decay = tl.exp(tl.where(causal, b_c[:, None] - b_c[None, :], float("-inf")))  # e^(c_i - c_j), j <= i

    # The products of rows run on the rows as stored and are scaled by the norms after (k_i/|k_i| . k_j/|k_j|
    # = (k_i . k_j) r_i r_j): for 16-bit inputs one exact 16-bit product instead of three tf32 products of
    # the normalised rows. First what needs q (P, Qe), so that q is dead before the inverse.
    b_k, b_rk = _load_rows(k_ptr + i_kh * stride_kh, o_t, m_t, stride_kt, o_k, m_k)
    if EXACT16:  # the scan reads the rows as stored and this row scale: Kt = diag(scale) K
        tl.store(kt_ptr + i_w * BT + o_r, b_rk * tl.exp(b_c_last - b_c))
    else:
        tl.store(kt_ptr + o_wk, b_k.to(tl.float32) * (b_rk * tl.exp(b_c_last - b_c))[:, None], mask=m_wk)
    b_q, b_rq = _load_rows(q_ptr + i_kh * stride_qh, o_t, m_t, stride_qt, o_k, m_k)
    b_rq = b_rq * scale
    b_qk = _dot_rows(b_q, b_k, EXACT16, WIDEN, OUT_PRECISION)
    b_p = tl.where(causal, b_qk * b_rq[:, None] * b_rk[None, :] * b_decay, 0.0)
    tl.store(p_ptr + (i_w * BT + o_r[:, None]) * BT + o_r[None, :], b_p)
    tl.store(qe_ptr + o_wk, b_q.to(tl.float32) * (b_rq * tl.exp(b_c))[:, None], mask=m_wk)

    # A[i, j] = beta_i (k_i . k_j) e^(c_i - c_j) for j < i; k k^T is symmetric, so A^T comes from the same tile
    b_kk = _dot_rows(b_k, b_k, EXACT16, WIDEN, PRECISION) * b_rk[:, None] * b_rk[None, :]
    b_a = tl.where(o_r[:, None] > o_r[None, :], b_beta[:, None] * b_kk * b_decay, 0.0)
    b_decay_t = tl.exp(tl.where(o_r[:, None] < o_r[None, :], b_c[None, :] - b_c[:, None], float("-inf")))
    b_at = tl.where(o_r[:, None] < o_r[None, :], b_beta[None, :] * b_kk * b_decay_t, 0.0)
    b_x = _unit_lower_inverse(b_a, b_at, BT, SB, PRECISION)

    # W = X diag(beta e^c r) K and U = X diag(beta) V: the scales go to X's columns, so that the right
    # operand is the rows as stored. k again rather than kept live through the inverse (registers)
    b_k, b_rk = _load_rows(k_ptr + i_kh * stride_kh, o_t, m_t, stride_kt, o_k, m_k)
    b_w = _dot_exact_right(b_x * (b_beta * tl.exp(b_c) * b_rk)[None, :], b_k, EXACT16, PRECISION)
    tl.store(w_ptr + o_wk, b_w, mask=m_wk)
    p_v = v_ptr + o_t[:, None] * stride_vt + i_h * stride_vh + o_v[None, :]
    b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_u = _dot_exact_right(b_x * b_beta[None, :], b_v, EXACT16, PRECISION)
    tl.store(u_ptr + (i_w * BT + o_r[:, None]) * DV + o_v[None, :], b_u, mask=m_v[None, :])


@triton.jit(do_not_specialize=["num_chunks", "num_tokens"])
def _chunk_scan_kernel(
    w_ptr, u_ptr, kt_ptr, k_ptr, decay_ptr, state_ptr, states_ptr, new_state_ptr,
    num_chunks, num_tokens, num_v_heads, heads_per_key, stride_kt, stride_kh,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, EXACT16: tl.constexpr,
):
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    o_s = o_k[:, None] * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(state_ptr + i_h * DK * DV + o_s, mask=m_s, other=0.0)  # [BK, BV] fp32
    for i_c in range(num_chunks):
        i_w = i_c * num_v_heads + i_h
        tl.store(states_ptr + i_w * DK * DV + o_s, b_s, mask=m_s)
        o_wk = (i_w * BT + o_r[:, None]) * DK + o_k[None, :]
        b_w = tl.load(w_ptr + o_wk, mask=m_k[None, :], other=0.0)
        b_u = tl.load(u_ptr + (i_w * BT + o_r[:, None]) * DV + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_u = b_u - tl.dot(b_w, b_s, input_precision=PRECISION)
        b_decay = tl.load(decay_ptr + i_w)
        if EXACT16:  # Kt^T u = K^T (diag(scale) u), K the 16-bit rows as stored
            o_t = i_c * BT + o_r
            p_k = k_ptr + o_t[:, None] * stride_kt + (i_h // heads_per_key) * stride_kh + o_k[None, :]
            b_k = tl.load(p_k, mask=(o_t < num_tokens)[:, None] & m_k[None, :], other=0.0)
            b_scale = tl.load(kt_ptr + i_w * BT + o_r)
            b_s = b_s * b_decay + _dot_exact_left(tl.trans(b_k), b_u * b_scale[:, None], EXACT16, PRECISION)
        else:
            b_kt = tl.load(kt_ptr + o_wk, mask=m_k[None, :], other=0.0)
            b_s = b_s * b_decay + tl.dot(tl.trans(b_kt), b_u, input_precision=PRECISION)
    tl.store(new_state_ptr + i_h * DK * DV + o_s, b_s, mask=m_s)


@triton.jit(do_not_specialize=["num_tokens"])
def _chunk_output_kernel(
    w_ptr, u_ptr, qe_ptr, p_ptr, states_ptr, o_ptr,
    num_tokens, num_v_heads, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OUT_PRECISION: tl.constexpr,
):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_w = i_c * num_v_heads + i_h
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    b_s = tl.load(states_ptr + i_w * DK * DV + o_k[:, None] * DV + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
    o_wk = (i_w * BT + o_r[:, None]) * DK + o_k[None, :]
    b_w = tl.load(w_ptr + o_wk, mask=m_k[None, :], other=0.0)
    b_u = tl.load(u_ptr + (i_w * BT + o_r[:, None]) * DV + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_u = b_u - tl.dot(b_w, b_s, input_precision=OUT_PRECISION)
    b_qe = tl.load(qe_ptr + o_wk, mask=m_k[None, :], other=0.0)
    b_p = tl.load(p_ptr + (i_w * BT + o_r[:, None]) * BT + o_r[None, :])
    b_o = tl.dot(b_qe, b_s, input_precision=OUT_PRECISION) + tl.dot(b_p, b_u, input_precision=OUT_PRECISION)
    o_t = i_c * BT + o_r
    p_o = o_ptr + o_t[:, None] * stride_ot + i_h * stride_oh + o_v[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=(o_t < num_tokens)[:, None] & m_v[None, :])


def _check_gdn_shapes(q, k, v, g, beta, state, gate_names: str = "g and beta") -> tuple[int, int, int, int, int]:
    """Shared by the chunk and recurrent wrappers: (T, Hk, Hv, Dk, Dv) or a ValueError naming the shape."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv] with one T; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != (num_tokens, num_v_heads):
        raise ValueError(f"{gate_names} must be [T, Hv] = [{num_tokens}, {num_v_heads}]; got {tuple(g.shape)}, {tuple(beta.shape)}")
    if state.shape != (num_v_heads, dk, dv):
        raise ValueError(f"state must be [Hv, Dk, Dv] = [{num_v_heads}, {dk}, {dv}]; got {tuple(state.shape)}")
    return num_tokens, num_k_heads, num_v_heads, dk, dv


def _check_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                 num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a_log, dt_bias [Hv] made contiguous, or a ValueError (a and b are checked with q, k, v)."""
    if a_log.shape != (num_v_heads,) or dt_bias.shape != (num_v_heads,):
        raise ValueError(f"a_log and dt_bias must be [Hv] = [{num_v_heads}]; got {tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    _tl_dtype(b.dtype)  # beta's sigmoid rounds to b's dtype, as in gdn_gating
    return a_log.contiguous(), dt_bias.contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _new_state_buffer(state: torch.Tensor, out_state: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel writes the new state: `out_state` (it may be the state itself: each program reads its
    tile of the state before it writes the same tile, and no program reads another's), or a fresh one."""
    if out_state is None:
        return torch.empty_like(state)
    if out_state.shape != state.shape or out_state.dtype != torch.float32 or not out_state.is_contiguous():
        raise ValueError(f"out_state must be a contiguous float32 {tuple(state.shape)}; got "
                         f"{out_state.dtype} {tuple(out_state.shape)}")
    return out_state


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.chunk_gated_delta_rule: o [T, Hv, Dv] (v's dtype), new state [Hv, Dk, Dv] fp32
    (in `out_state` when given; it may be `state`)."""
    shapes = _check_gdn_shapes(q, k, v, g, beta, state)
    return _chunk_rule(q, k, v, g, beta, None, state, chunk, out_state, shapes)


def chunk_gated_delta_rule_from_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, chunk: int = 64, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.chunk_gated_delta_rule_from_gates: chunk_gated_delta_rule of gdn_gating(a, b,
    a_log, dt_bias) (a, b [T, Hv], any strides; a_log, dt_bias [Hv]); the prepare kernel gates them itself
    where GATE_IN_PREPARE is on."""
    shapes = _check_gdn_shapes(q, k, v, a, b, state, "a and b")
    gates = _check_gates(a, b, a_log, dt_bias, shapes[2])
    if not GATE_IN_PREPARE:
        g, beta = gdn_gating(a, b, *gates)
        return _chunk_rule(q, k, v, g, beta, None, state, chunk, out_state, shapes)
    return _chunk_rule(q, k, v, a, b, gates, state, chunk, out_state, shapes)


def _chunk_rule(q, k, v, g, beta, gates, state, chunk, out_state, shapes):
    """The three launches. gates: None (g, beta given), or (a_log, dt_bias) with g, beta the raw a, b."""
    num_tokens, num_k_heads, num_v_heads, dk, dv = shapes
    if chunk < INVERSE_BLOCK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {INVERSE_BLOCK}; got {chunk}")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    state = state.float().contiguous()
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    new_state = _new_state_buffer(state, out_state)
    if num_tokens == 0:
        new_state.copy_(state)
        return out, new_state
    num_chunks = triton.cdiv(num_tokens, chunk)
    # 16-bit q, k, v of one dtype: the prepare kernel's row products are exact 16-bit products
    exact16 = EXACT_16BIT_PRODUCTS and q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)
    out_precision = OUTPUT_DOT_PRECISION if out.element_size() >= 4 else OUTPUT_DOT_PRECISION_16BIT
    block_k, block_v = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    ws = dict(dtype=torch.float32, device=v.device)
    w = torch.empty(num_chunks, num_v_heads, chunk, dk, **ws)
    u = torch.empty(num_chunks, num_v_heads, chunk, dv, **ws)
    qe = torch.empty(num_chunks, num_v_heads, chunk, dk, **ws)
    # Kt, or with 16-bit rows only its row scale (the scan reads k itself)
    kt = torch.empty(num_chunks, num_v_heads, chunk, *(() if exact16 else (dk,)), **ws)
    p = torch.empty(num_chunks, num_v_heads, chunk, chunk, **ws)
    decay = torch.empty(num_chunks, num_v_heads, **ws)
    states = torch.empty(num_chunks, num_v_heads, dk, dv, **ws)  # each chunk's starting state
    a_log, dt_bias = gates or (g, g)  # unread without GATES
    _chunk_prepare_kernel[(num_chunks, num_v_heads)](
        q, k, v, g, beta, a_log, dt_bias, w, u, qe, kt, p, decay,
        num_tokens, num_v_heads, num_v_heads // num_k_heads, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        DK=dk, DV=dv, BT=chunk, BK=block_k, BV=block_v, SB=INVERSE_BLOCK, PRECISION=DOT_PRECISION,
        OUT_PRECISION=out_precision, EXACT16=exact16, WIDEN=exact16 and interpreting(), GATES=gates is not None,
        num_warps=PREPARE_NUM_WARPS, num_stages=1,
    )
    scan_block_v = min(SCAN_BLOCK_V, block_v)
    _chunk_scan_kernel[(num_v_heads, triton.cdiv(dv, scan_block_v))](
        w, u, kt, k, decay, state, states, new_state, num_chunks, num_tokens, num_v_heads,
        num_v_heads // num_k_heads, k.stride(0), k.stride(1),
        DK=dk, DV=dv, BT=chunk, BK=block_k, BV=scan_block_v, PRECISION=DOT_PRECISION, EXACT16=exact16,
        num_warps=SCAN_NUM_WARPS, num_stages=SCAN_NUM_STAGES,
    )
    output_block_v = min(OUTPUT_BLOCK_V, block_v)
    _chunk_output_kernel[(num_chunks, num_v_heads, triton.cdiv(dv, output_block_v))](
        w, u, qe, p, states, out, num_tokens, num_v_heads, out.stride(0), out.stride(1),
        DK=dk, DV=dv, BT=chunk, BK=block_k, BV=output_block_v, OUT_PRECISION=out_precision,
        num_warps=OUTPUT_NUM_WARPS, num_stages=1,
    )
    return out, new_state
