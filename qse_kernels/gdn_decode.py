"""A GDN layer's decode step between its two projections in one launch: the conv, the gated delta rule and
the gated norm of one new row for each of B sequences; the naive twin is naive.gdn_decode_slots.

Unfused, a decode round runs three launches a GDN layer here (conv1d.causal_conv1d_slots,
gdn_recurrent.recurrent_gated_delta_rule_slots, norms.gated_rms_norm), each a few microseconds of latency with
almost no bytes to move; at batch 1 the chain is most of what a GDN layer costs outside its two projections.
With FUSED set, gdn_decode_slots runs them as one kernel, grid (Hv, Dv / BV, B), the recurrent step's grid:

    conv    program (h, i, b) convolves the channels its step reads: its key head's q and k (shared with the
            other programs of that key head: each computes them, all store the same bits) and its BV columns of
            value head h's v, and stores them where the unfused conv would (y); the state rows of its v
            columns are its own to write; the key head's q and k rows are written by whichever of the key
            head's programs counts itself in last, after every one of them has read them (counts.zeroed)
    step    the window kernel's loop over the sequence's one row, _recurrent_row, reading q, k and v back from
            y as the unfused step loads them: its output o and new state are the slot step's bits
    norm    whichever of value head h's Dv / BV programs counts itself in last runs the gated norm's rows code
            (norms._gated_rms_norm_rows) on that head's row of o, on the norm kernel's own tile shape

Each stage runs the code of the launch it replaces, on the same loads, so the fused step's output and states
are the unfused chain's bits (the tests compare them with torch.equal, interpreted and at the real shapes on a
GPU), and a round may run either: a verify, a reader's fork decode and an eager step still run the unfused
kernels. The counters pick which program writes or norms, never the order of a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import counts, pdl
from .conv1d import _conv_rows, _seq_rows, causal_conv1d_slots
from .gdn_chunk import _check_gates
from .gdn_recurrent import (RECURRENT_BLOCK_V, RECURRENT_NUM_WARPS, _recurrent_row, _state_slice,
                            recurrent_gated_delta_rule_slots)
from .naive import gdn_decode_heads, gdn_decode_through
from .norms import NORM_NUM_WARPS, _gate_layout, _gated_rms_norm_rows, _row_blocks, _tl_dtype, gated_rms_norm

# one launch for the three (measured against the three on the device before it is the default: benchmarks/NOTES.md)
FUSED = False


@triton.jit(do_not_specialize=["num_rows"])
def _gdn_decode_kernel(
    x_ptr, conv_w_ptr, conv_states_ptr, y_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, states_ptr, o_ptr,
    z_ptr, norm_w_ptr, out_ptr, counts_ptr, slots_ptr,
    num_rows, heads_per_key, scale, eps, key_dim,
    stride_xt, stride_wc, stride_wk, stride_cslot, stride_ct, stride_yt,
    stride_qh, stride_vh, stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh, stride_slot,
    stride_orow, gate_heads, stride_zt, stride_zh, stride_out,
    NUM_K_HEADS: tl.constexpr, NUM_V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, WIDTH: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    i_h, i_v, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_slot = tl.load(slots_ptr + i_b).to(tl.int64)
    i_kh = i_h // heads_per_key
    o_k, m_k, o_v, m_v, o_s, m_s = _state_slice(i_h, i_v, DK, DV, BK, BV)
    # the step's state slice first: the largest read, in flight while the conv runs
    b_s = tl.load(states_ptr + i_slot * stride_slot + o_s, mask=m_s, other=0.0)  # [BK, BV] fp32

    # conv: sequence i_b's one row (row 0 of x_row), from the state in its slot (the slot conv's code)
    x_row = x_ptr + i_b * stride_xt
    y_row = y_ptr + i_b * stride_yt
    conv_state = conv_states_ptr + i_slot * stride_cslot
    o_t = tl.arange(0, 1)
    m_t = o_t < 1
    o_m = tl.arange(0, BS)
    m_m = o_m < WIDTH - 1
    c_q = i_kh * DK + o_k
    c_k = key_dim + i_kh * DK + o_k
    c_v = 2 * key_dim + i_h * DV + o_v
    b_yq = _conv_rows(x_row, conv_w_ptr, conv_state, o_t, m_t, c_q, m_k, stride_xt, stride_wc, stride_wk, stride_ct,
                      WIDTH, 1, BK)
    b_yk = _conv_rows(x_row, conv_w_ptr, conv_state, o_t, m_t, c_k, m_k, stride_xt, stride_wc, stride_wk, stride_ct,
                      WIDTH, 1, BK)
    b_yv = _conv_rows(x_row, conv_w_ptr, conv_state, o_t, m_t, c_v, m_v, stride_xt, stride_wc, stride_wk, stride_ct,
                      WIDTH, 1, BV)
    tl.store(y_row + c_q[None, :], b_yq.to(y_ptr.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])
    tl.store(y_row + c_k[None, :], b_yk.to(y_ptr.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])
    tl.store(y_row + c_v[None, :], b_yv.to(y_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    # the new state's row m is seq[1 + m] = x[1 + m - (K-1)]
    b_new_q = _seq_rows(x_row, conv_state, 1 + o_m - (WIDTH - 1), c_q, m_m, m_k, stride_xt, stride_ct, WIDTH)
    b_new_k = _seq_rows(x_row, conv_state, 1 + o_m - (WIDTH - 1), c_k, m_m, m_k, stride_xt, stride_ct, WIDTH)
    b_new_v = _seq_rows(x_row, conv_state, 1 + o_m - (WIDTH - 1), c_v, m_m, m_v, stride_xt, stride_ct, WIDTH)
    # every thread's reads of the old state done, and its y stored, before a write or a count
    tl.debug_barrier()
    p_new = conv_state + o_m[:, None] * stride_ct
    tl.store(p_new + c_v[None, :], b_new_v.to(conv_states_ptr.dtype.element_ty), mask=m_m[:, None] & m_v[None, :])
    i_group = i_b * (NUM_K_HEADS + NUM_V_HEADS) + i_kh
    if tl.atomic_add(counts_ptr + i_group, 1, sem="acq_rel", scope="gpu") == heads_per_key * tl.num_programs(1) - 1:
        # the key head's last program: every other one has read its q and k state rows
        tl.atomic_xchg(counts_ptr + i_group, 0, sem="relaxed", scope="gpu")
        tl.store(p_new + c_q[None, :], b_new_q.to(conv_states_ptr.dtype.element_ty), mask=m_m[:, None] & m_k[None, :])
        tl.store(p_new + c_k[None, :], b_new_k.to(conv_states_ptr.dtype.element_ty), mask=m_m[:, None] & m_k[None, :])

    # step: the window kernel's loop on the sequence's row, its slot its own target (the slot step's code)
    q_ptr = y_ptr + i_b * num_rows * stride_yt
    k_ptr = q_ptr + key_dim
    v_ptr = q_ptr + 2 * key_dim
    a_ptr = a_ptr + i_b * num_rows * stride_at
    b_ptr = b_ptr + i_b * num_rows * stride_bt
    o_row = o_ptr + i_b * num_rows * stride_ot
    for t in range(num_rows):
        b_s = _recurrent_row(b_s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_row, t, num_rows,
                             i_h, i_kh, o_k, m_k, o_v, m_v, scale, stride_yt, stride_qh, stride_yt, stride_qh,
                             stride_yt, stride_vh, stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
                             True)
        tl.store(states_ptr + i_slot * stride_slot + o_s, b_s, mask=m_s)

    # norm: value head i_h's row of o, by the last of its Dv / BV programs (the gated norm kernel's code)
    tl.debug_barrier()  # every thread's o stored before the count releases it
    i_norm = i_b * (NUM_K_HEADS + NUM_V_HEADS) + NUM_K_HEADS + i_h
    if tl.atomic_add(counts_ptr + i_norm, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        tl.atomic_xchg(counts_ptr + i_norm, 0, sem="relaxed", scope="gpu")
        row = i_b * NUM_V_HEADS + i_h
        _gated_rms_norm_rows(o_ptr, z_ptr, norm_w_ptr, out_ptr, row + tl.arange(0, BR), row + 1, stride_orow,
                             gate_heads, stride_zt, stride_zh, stride_out, eps, DV, BD, PRODUCT_DTYPE, ".cg")


def gdn_decode_slots(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.gdn_decode_slots: qkv [B, C] (the conv's input rows), z [B, Hv, Dv], raw gates a, b
    [B, Hv] (any strides), conv_weight [C, K], a_log, dt_bias [Hv], norm_weight [Dv]; conv_states [S, K-1, C]
    and states [S, Hv, Dk, Dv] fp32, slot slots[b] (an integer tensor [B] on the device) stepped in place.
    Returns the gated norm's output [B, Hv, Dv] in qkv's dtype: one launch with FUSED, else the three."""
    num_k_heads, num_v_heads, dk, dv, key_dim = gdn_decode_heads(qkv, states)
    num_rows, channels = qkv.shape
    width = conv_weight.shape[-1]
    if conv_weight.shape != (channels, width) or conv_states.dim() != 3 or conv_states.shape[1:] != (width - 1, channels):
        raise ValueError(f"conv_weight must be [C, K] = [{channels}, K] and conv_states [S, K-1, C]; got "
                         f"{tuple(conv_weight.shape)}, {tuple(conv_states.shape)}")
    if z.shape != (num_rows, num_v_heads, dv) or norm_weight.shape != (dv,):
        raise ValueError(f"z must be [B, Hv, Dv] = [{num_rows}, {num_v_heads}, {dv}] and norm_weight [{dv}]; got "
                         f"{tuple(z.shape)}, {tuple(norm_weight.shape)}")
    if a.shape != (num_rows, num_v_heads) or b.shape != a.shape:
        raise ValueError(f"a and b must be [B, Hv] = [{num_rows}, {num_v_heads}]; got {tuple(a.shape)}, {tuple(b.shape)}")
    if slots.shape != (num_rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be an integer tensor [{num_rows}]; got {slots.dtype} {tuple(slots.shape)}")
    if not _fusable(qkv, conv_states, states):
        return gdn_decode_through((causal_conv1d_slots, recurrent_gated_delta_rule_slots, gated_rms_norm), qkv, z, a,
                                  b, conv_weight, a_log, dt_bias, norm_weight, eps, conv_states, states, slots)
    a_log, dt_bias = _check_gates(a, b, a_log, dt_bias, num_v_heads)
    _tl_dtype(qkv.dtype)
    product_dtype = _tl_dtype(torch.promote_types(norm_weight.dtype, qkv.dtype))
    norm_weight = norm_weight.contiguous()
    slots = slots.contiguous()
    z, gate_heads, (stride_zt, stride_zh) = _gate_layout(z if z.stride(2) == 1 else z.contiguous())
    y = torch.empty_like(qkv)
    o = torch.empty(num_rows, num_v_heads, dv, dtype=qkv.dtype, device=qkv.device)
    out = torch.empty_like(o)
    if not num_rows:
        return out
    group = counts.zeroed(conv_weight, num_rows * (num_k_heads + num_v_heads))
    block_v = min(RECURRENT_BLOCK_V, triton.next_power_of_2(dv))
    block_d, block_r = _row_blocks(dv)
    _gdn_decode_kernel[(num_v_heads, triton.cdiv(dv, block_v), num_rows)](
        qkv, conv_weight, conv_states, y, a, b, a_log, dt_bias, states, o, z, norm_weight, out, group, slots,
        1, num_v_heads // num_k_heads, dk ** -0.5, eps, key_dim,
        qkv.stride(0), conv_weight.stride(0), conv_weight.stride(1), conv_states.stride(0), conv_states.stride(1),
        y.stride(0), dk, dv, a.stride(0), a.stride(1), b.stride(0), b.stride(1), o.stride(0), o.stride(1),
        states.stride(0), dv, gate_heads, stride_zt, stride_zh, dv,
        NUM_K_HEADS=num_k_heads, NUM_V_HEADS=num_v_heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        WIDTH=width, BS=triton.next_power_of_2(width - 1), BR=block_r, BD=block_d, PRODUCT_DTYPE=product_dtype,
        num_warps=RECURRENT_NUM_WARPS, **pdl.options()
    )
    return out


def _fusable(qkv: torch.Tensor, conv_states: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the one launch runs: FUSED, and the layouts the unfused kernels would read as they lie (the
    fused one reads them so too); the norm's and the step's warps alike, as their row sums' layouts assume."""
    return (FUSED and RECURRENT_NUM_WARPS == NORM_NUM_WARPS and qkv.stride(1) == 1 and conv_states.stride(2) == 1
            and states.dtype == torch.float32 and states.is_contiguous() and len(states) > 0)


__all__ = ["FUSED", "gdn_decode_slots"]
