"""The gated delta rule one token at a time (decode) in Triton; the naive twin is
naive.recurrent_gated_delta_rule.

Grid (Hv, Dv / BV): the state's Dv columns never mix, so each program holds a slice S [Dk, BV] in fp32
registers and walks the tokens in order (T is 1 in decode; any T works):
    S <- e^g S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
q and k are L2-normalised in fp32 (q also scaled by Dk^-1/2) per token, as the twin does.
recurrent_gated_delta_rule_from_gates gates the raw projections a, b in the same kernel (see gdn_chunk); it runs
the window kernel below on a stack of its one state.

recurrent_gated_delta_rule_slots steps B sequences by one token each in one launch, grid (Hv, Dv / BV, B):
program b runs the one-token step of sequence b on its state, slot slots[b] of a slot stack (in place). It is
the window kernel below with one row a sequence and its own slot as its window: a decode step and a verify's
rows run one compiled kernel, so their bits agree on a GPU as in the interpreter.

recurrent_gated_delta_rule_window is a speculative verify's rule in one launch, grid (Hv, Dv / BV, B):
program b loads sequence b's state from slot slots[b] once, steps its T rows in order and stores the state
after row j into slot scratch[b, j] (slots[b] is only read). Each row runs _recurrent_row, the step every
kernel here runs, so row j's output and state are the bits of T one-token slot steps, row j from
scratch[b, j - 1] (row 0 from slots[b]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

from .gdn_chunk import _check_gates, _check_gdn_shapes, _last_dim_contiguous, _load_gates, _new_state_buffer

RECURRENT_NUM_WARPS = 4
RECURRENT_BLOCK_V = 32


@triton.jit
def _recurrent_row(
    b_s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, o_ptr, t, num_tokens, i_h, i_kh,
    o_k, m_k, o_v, m_v, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh, GATES: tl.constexpr,
):
    """One token t of value head i_h on the state slice b_s [BK, BV] (fp32): stores its output o[t] and
    returns the new slice. Every kernel here steps a token through this, so a token's bits do not depend on
    which launch ran it."""
    b_q = tl.load(q_ptr + t * stride_qt + i_kh * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + t * stride_kt + i_kh * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
    b_q = b_q * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_v = tl.load(v_ptr + t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g, b_beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, i_h, t, t < num_tokens,
                              stride_gt, stride_gh, stride_bt, stride_bh, GATES)
    b_s = b_s * tl.exp(b_g)
    b_u = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(o_ptr + t * stride_ot + i_h * stride_oh + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def _state_slice(i_h, i_v, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (i_h, i_v)'s slice of a state [Hv, Dk, Dv]: its K and V offsets and masks, and the slice's offsets
    and mask (the window kernel's and gdn_decode's: one step code on one layout)."""
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    o_s = i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    return o_k, m_k, o_v, m_v, o_s, m_k[:, None] & m_v[None, :]


# T not specialised, as in the window kernel below: a T = 1 step here (a reader's fork decode, an eager step)
# then compiles as a round's slot step does, the same float ops in the same order (a specialised T == 1
# unrolls the loop and the compiler may fuse differently: the states parted on the H200)
@triton.jit(do_not_specialize=["num_tokens"])
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, new_state_ptr, o_ptr,
    num_tokens, heads_per_key, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATES: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // heads_per_key
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    o_s = i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(state_ptr + o_s, mask=m_s, other=0.0)  # [BK, BV] fp32
    for t in range(num_tokens):
        b_s = _recurrent_row(b_s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, o_ptr, t, num_tokens,
                             i_h, i_kh, o_k, m_k, o_v, m_v, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
                             GATES)
    tl.store(new_state_ptr + o_s, b_s, mask=m_s)


# T and the window's row stride are not specialised: a decode step (T = 1, its slot its own window) and a
# verify run one compiled kernel, so a row's bits cannot depend on which of them ran it (a kernel specialised on
# T == 1 unrolls its loop and may fuse its float ops otherwise; measured on the H200: the states differed)
@triton.jit(do_not_specialize=["num_rows", "stride_scratch_b"])
def _recurrent_window_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, states_ptr, o_ptr,
    num_rows, heads_per_key, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    slots_ptr, stride_slots, scratch_ptr, stride_scratch_b, stride_scratch_t, stride_slot,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    # program i_b: the num_rows (T) rows of sequence i_b (rows i_b * T ..), from the state in slot slots[i_b]
    i_h, i_v, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_slot = tl.load(slots_ptr + i_b * stride_slots).to(tl.int64)
    q_ptr = q_ptr + i_b * num_rows * stride_qt
    k_ptr = k_ptr + i_b * num_rows * stride_kt
    v_ptr = v_ptr + i_b * num_rows * stride_vt
    a_ptr = a_ptr + i_b * num_rows * stride_at
    b_ptr = b_ptr + i_b * num_rows * stride_bt
    o_ptr = o_ptr + i_b * num_rows * stride_ot
    i_kh = i_h // heads_per_key
    o_k, m_k, o_v, m_v, o_s, m_s = _state_slice(i_h, i_v, DK, DV, BK, BV)
    b_s = tl.load(states_ptr + i_slot * stride_slot + o_s, mask=m_s, other=0.0)  # [BK, BV] fp32
    for t in range(num_rows):
        b_s = _recurrent_row(b_s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_ptr, t, num_rows,
                             i_h, i_kh, o_k, m_k, o_v, m_v, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_vt, stride_vh, stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
                             True)
        i_target = tl.load(scratch_ptr + i_b * stride_scratch_b + t * stride_scratch_t).to(tl.int64)
        tl.store(states_ptr + i_target * stride_slot + o_s, b_s, mask=m_s)


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.recurrent_gated_delta_rule: o [T, Hv, Dv] (v's dtype), new state [Hv, Dk, Dv] fp32
    (in `out_state` when given; it may be `state`)."""
    shapes = _check_gdn_shapes(q, k, v, g, beta, state)
    return _recurrent_rule(q, k, v, g, beta, None, state, out_state, shapes)


def recurrent_gated_delta_rule_from_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.recurrent_gated_delta_rule_from_gates: recurrent_gated_delta_rule of gdn_gating(a,
    b, a_log, dt_bias), the gating done in the same kernel (a, b [T, Hv], any strides; a_log, dt_bias [Hv])."""
    num_tokens, num_k_heads, num_v_heads, dk, dv = _check_gdn_shapes(q, k, v, a, b, state, "a and b")
    a_log, dt_bias = _check_gates(a, b, a_log, dt_bias, num_v_heads)
    # the window kernel on a stack of one state, its own slot the target of every row: the one compiled step
    # a round's slot step and a verify run, so a sequence stepped here and in a round gets the same bits (the
    # one-token _recurrent_kernel parted from the slot step in the states' last bits on the H200, outputs equal)
    if out_state is None:
        new_state = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    else:
        new_state = _new_state_buffer(state, out_state)
    if new_state.data_ptr() != state.data_ptr():
        new_state.copy_(state)
    if new_state.dtype != torch.float32 or not new_state.is_contiguous():
        raise ValueError(f"the state stepped must be a contiguous float32 [Hv, Dk, Dv]; got {new_state.dtype} "
                         f"{tuple(new_state.shape)}, strides {new_state.stride()}")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    if num_tokens:
        slots = torch.zeros(1, 1 + num_tokens, dtype=torch.int32, device=v.device)  # slot 0, its rows' targets 0
        _launch_window(q, k, v, a, b, a_log, dt_bias, new_state[None], out, slots[:, 0], slots[:, 1:], 1, num_tokens,
                       num_k_heads, num_v_heads, dk, dv)
    return out, new_state


def _recurrent_rule(q, k, v, g, beta, gates, state, out_state, shapes):
    """The launch. gates: None (g, beta given), or (a_log, dt_bias) with g, beta the raw a, b."""
    num_tokens, num_k_heads, num_v_heads, dk, dv = shapes
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    state = state.float().contiguous()
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    new_state = _new_state_buffer(state, out_state)
    block_k = triton.next_power_of_2(dk)
    block_v = min(RECURRENT_BLOCK_V, triton.next_power_of_2(dv))
    a_log, dt_bias = gates or (g, g)  # unread without GATES
    _recurrent_kernel[(num_v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, a_log, dt_bias, state, new_state, out,
        num_tokens, num_v_heads // num_k_heads, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        DK=dk, DV=dv, BK=block_k, BV=block_v, GATES=gates is not None,
        num_warps=RECURRENT_NUM_WARPS, **pdl.options()
    )
    return out, new_state


def recurrent_gated_delta_rule_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of naive.recurrent_gated_delta_rule_slots: B sequences of one token each, q, k [B, Hk, Dk],
    v [B, Hv, Dv], raw gates a, b [B, Hv]; states [S, Hv, Dk, Dv] fp32 contiguous, slot slots[b] (an integer
    tensor [B] on the device) stepped in place. Returns o [B, Hv, Dv] in v's dtype."""
    if states.dim() != 4 or not len(states) or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states must be a contiguous float32 [S, Hv, Dk, Dv], S >= 1; got {states.dtype} "
                         f"{tuple(states.shape)}, strides {states.stride()}")
    num_rows, num_k_heads, num_v_heads, dk, dv = _check_gdn_shapes(q, k, v, a, b, states[0], "a and b")
    a_log, dt_bias = _check_gates(a, b, a_log, dt_bias, num_v_heads)
    if slots.shape != (num_rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be an integer tensor [{num_rows}]; got {slots.dtype} {tuple(slots.shape)}")
    slots = slots.contiguous()  # the kernel reads slots[b] at slots_ptr + b (a verify passes a column of a table)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out = torch.empty(num_rows, num_v_heads, dv, dtype=v.dtype, device=v.device)
    if num_rows:  # the verify's kernel with one row a sequence, its own slot as its window (in place)
        _launch_window(q, k, v, a, b, a_log, dt_bias, states, out, slots, slots[:, None], num_rows, 1,
                       num_k_heads, num_v_heads, dk, dv)
    return out


def recurrent_gated_delta_rule_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of naive.recurrent_gated_delta_rule_window: the T rows of each of B sequences, row-major,
    q, k [B * T, Hk, Dk], v [B * T, Hv, Dv], raw gates a, b [B * T, Hv]; states [S, Hv, Dk, Dv] fp32
    contiguous; sequence b's rows step from slot slots[b] (read only), the state after its row j written to
    slot scratch[b, j] (integer tensors [B], [B, T] on the device, all distinct). Returns o [B * T, Hv, Dv]."""
    from .conv1d import _check_window

    if states.dim() != 4 or not len(states) or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states must be a contiguous float32 [S, Hv, Dk, Dv], S >= 1; got {states.dtype} "
                         f"{tuple(states.shape)}, strides {states.stride()}")
    total_rows, num_k_heads, num_v_heads, dk, dv = _check_gdn_shapes(q, k, v, a, b, states[0], "a and b")
    a_log, dt_bias = _check_gates(a, b, a_log, dt_bias, num_v_heads)
    num_seqs, num_rows = _check_window(slots, scratch, total_rows)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out = torch.empty(total_rows, num_v_heads, dv, dtype=v.dtype, device=v.device)
    if total_rows:
        _launch_window(q, k, v, a, b, a_log, dt_bias, states, out, slots, scratch, num_seqs, num_rows,
                       num_k_heads, num_v_heads, dk, dv)
    return out


def _launch_window(q, k, v, a, b, a_log, dt_bias, states, out, slots, scratch, num_seqs, num_rows,
                   num_k_heads, num_v_heads, dk, dv) -> None:
    """_recurrent_window_kernel over num_seqs sequences of num_rows rows (the slot step's launch too)."""
    block_v = min(RECURRENT_BLOCK_V, triton.next_power_of_2(dv))
    _recurrent_window_kernel[(num_v_heads, triton.cdiv(dv, block_v), num_seqs)](
        q, k, v, a, b, a_log, dt_bias, states, out,
        num_rows, num_v_heads // num_k_heads, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        slots, slots.stride(0), scratch, scratch.stride(0), scratch.stride(1), states.stride(0),
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        num_warps=RECURRENT_NUM_WARPS, **pdl.options()
    )
