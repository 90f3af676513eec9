"""Causal depthwise conv1d with carried state, then SiLU, in Triton; the naive twin is naive.causal_conv1d.

Grid (T / BT, C / BC). Row t of the output reads seq[t .. t+K-1] of seq = cat(state, x) (state first cast
to x's dtype, as the twin does) and accumulates in fp32 over the taps in order 0..K-1. The programs of
the first row block also write the new state, the last K-1 rows of seq, so prefill (any T) and the T = 1
update are one launch each.

causal_conv1d_slots steps B sequences by one input each in one launch, grid (B, C / BC): program row b runs
the T = 1 update of sequence b (x row b, state slot slots[b] of a slot stack, in place), the same code as a
T = 1 launch of causal_conv1d on that sequence alone.

causal_conv1d_window is a speculative verify's conv in one launch, grid (B, C / BC): program row b takes the
T rows of sequence b, from the state in slot slots[b], and writes the state after its row j into slot
scratch[b, j] (never slots[b]): the bits of T causal_conv1d_slots steps, row j from scratch[b, j - 1] (row 0
from slots[b]). Row j's taps on the window's earlier rows read them through the state's dtype, as those steps
read them back from the state they were written to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

CONV_BLOCK_T = 16
CONV_BLOCK_C = 128
CONV_NUM_WARPS = 4


@triton.jit
def _seq_rows(x_ptr, state_ptr, o_src, o_c, m_rows, m_c, stride_xt, stride_st, WIDTH: tl.constexpr,
              VIA_STATE: tl.constexpr = False):
    """Rows of seq = cat(state, x) for x-row indices o_src (negative: state rows), in x's dtype. VIA_STATE: x
    rows cast to the state's dtype and back, as a row stored into a state and read back from it."""
    m_x = m_rows & (o_src >= 0)
    m_state = m_rows & (o_src < 0)
    b_x = tl.load(x_ptr + o_src[:, None] * stride_xt + o_c[None, :], mask=m_x[:, None] & m_c[None, :], other=0.0)
    if VIA_STATE:
        b_x = b_x.to(state_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
    p_state = state_ptr + (o_src + WIDTH - 1)[:, None] * stride_st + o_c[None, :]
    b_state = tl.load(p_state, mask=m_state[:, None] & m_c[None, :], other=0.0).to(x_ptr.dtype.element_ty)
    return tl.where(m_x[:, None], b_x, b_state)


@triton.jit
def _conv_rows(x_ptr, w_ptr, state_ptr, o_t, m_t, o_c, m_c, stride_xt, stride_wc, stride_wk, stride_st,
               WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WINDOW: tl.constexpr = False):
    """Output rows o_t (fp32, after the SiLU): the taps in order 0..K-1, accumulated in fp32. WINDOW: the taps
    before the last read the x rows before their own through the state's dtype (_seq_rows VIA_STATE)."""
    b_acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # output row t, tap j reads seq[t + j] = x[t + j - (K-1)]
        b_in = _seq_rows(x_ptr, state_ptr, o_t + j - (WIDTH - 1), o_c, m_t, m_c, stride_xt, stride_st, WIDTH,
                         WINDOW and j < WIDTH - 1)
        b_w = tl.load(w_ptr + o_c * stride_wc + j * stride_wk, mask=m_c, other=0.0).to(tl.float32)
        b_acc = b_acc + b_in.to(tl.float32) * b_w[None, :]
    return b_acc * tl.sigmoid(b_acc)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, new_state_ptr,
    num_tokens, num_channels, stride_xt, stride_wc, stride_wk, stride_st, stride_yt, stride_nt,
    slots_ptr, stride_slot,
    WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr, SLOTS: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    if SLOTS:  # program row i_b: the one new input of sequence i_b (num_tokens == 1), its state in slot slots[i_b]
        i_b = i_t
        i_t = 0
        i_slot = tl.load(slots_ptr + i_b).to(tl.int64)
        x_ptr = x_ptr + i_b * stride_xt
        y_ptr = y_ptr + i_b * stride_yt
        state_ptr = state_ptr + i_slot * stride_slot
        new_state_ptr = new_state_ptr + i_slot * stride_slot
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < num_tokens
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < num_channels
    b_y = _conv_rows(x_ptr, w_ptr, state_ptr, o_t, m_t, o_c, m_c, stride_xt, stride_wc, stride_wk, stride_st,
                     WIDTH, BT, BC)
    tl.store(y_ptr + o_t[:, None] * stride_yt + o_c[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if i_t == 0:
        # new state row m is seq[T + m] = x[T + m - (K-1)]
        o_m = tl.arange(0, BS)
        m_m = o_m < WIDTH - 1
        b_new = _seq_rows(x_ptr, state_ptr, num_tokens + o_m - (WIDTH - 1), o_c, m_m, m_c, stride_xt, stride_st, WIDTH)
        # the new state may be the old one (written in place): every read of the old state in this program
        # (only the first row block reads it) is done before any warp writes
        tl.debug_barrier()
        p_new = new_state_ptr + o_m[:, None] * stride_nt + o_c[None, :]
        tl.store(p_new, b_new.to(new_state_ptr.dtype.element_ty), mask=m_m[:, None] & m_c[None, :])


@triton.jit
def _conv_window_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, num_rows, num_channels, stride_xt, stride_wc, stride_wk, stride_st, stride_yt,
    slots_ptr, stride_slots, scratch_ptr, stride_scratch_b, stride_scratch_t, stride_slot,
    WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl.start(PDL)
    # program row i_b: the num_rows (T) rows of sequence i_b, x rows i_b * T .., from the state in slot slots[i_b]
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    i_slot = tl.load(slots_ptr + i_b * stride_slots).to(tl.int64)
    x_ptr = x_ptr + i_b * num_rows * stride_xt
    y_ptr = y_ptr + i_b * num_rows * stride_yt
    source_ptr = state_ptr + i_slot * stride_slot
    o_t = tl.arange(0, BT)
    m_t = o_t < num_rows
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < num_channels
    b_y = _conv_rows(x_ptr, w_ptr, source_ptr, o_t, m_t, o_c, m_c, stride_xt, stride_wc, stride_wk, stride_st,
                     WIDTH, BT, BC, True)
    p_y = y_ptr + o_t[:, None] * stride_yt + o_c[None, :]
    tl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    o_m = tl.arange(0, BS)
    m_m = o_m < WIDTH - 1
    for j in range(num_rows):
        # the state after row j, row m: seq[j + 1 + m] = x[j + 1 + m - (K-1)] (a scratch slot, never the source)
        b_new = _seq_rows(x_ptr, source_ptr, j + 1 + o_m - (WIDTH - 1), o_c, m_m, m_c, stride_xt, stride_st, WIDTH)
        i_target = tl.load(scratch_ptr + i_b * stride_scratch_b + j * stride_scratch_t).to(tl.int64)
        p_new = state_ptr + i_target * stride_slot + o_m[:, None] * stride_st + o_c[None, :]
        tl.store(p_new, b_new.to(state_ptr.dtype.element_ty), mask=m_m[:, None] & m_c[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  out_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of naive.causal_conv1d: x [T, C], weight [C, K], state [K-1, C] -> y [T, C], new state [K-1, C]
    (written into `out_state` when given; it may be `state` itself)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, C] and weight [C, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    num_tokens, num_channels = x.shape
    width = weight.shape[1]
    if width < 2 or state.shape != (width - 1, num_channels):
        raise ValueError(f"state must be [K-1, C] = [{width - 1}, {num_channels}] with K >= 2; got {tuple(state.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    state = state if state.stride(1) == 1 else state.contiguous()
    y = torch.empty(num_tokens, num_channels, dtype=x.dtype, device=x.device)
    if out_state is None:
        new_state = torch.empty(width - 1, num_channels, dtype=state.dtype, device=state.device)
    elif out_state.shape != state.shape or out_state.dtype != state.dtype or out_state.stride(1) != 1:
        raise ValueError(f"out_state must be a {state.dtype} {tuple(state.shape)} with unit column stride; got "
                         f"{out_state.dtype} {tuple(out_state.shape)}")
    else:
        new_state = out_state
    grid = (max(1, triton.cdiv(num_tokens, CONV_BLOCK_T)), triton.cdiv(num_channels, CONV_BLOCK_C))
    _conv_kernel[grid](
        x, weight, state, y, new_state,
        num_tokens, num_channels, x.stride(0), weight.stride(0), weight.stride(1), state.stride(0), y.stride(0),
        new_state.stride(0), y, 0,
        WIDTH=width, BT=CONV_BLOCK_T, BC=CONV_BLOCK_C, BS=triton.next_power_of_2(width - 1),
        num_warps=CONV_NUM_WARPS, **pdl.options()
    )
    return y, new_state


def causal_conv1d_slots(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.causal_conv1d_slots: x [B, C] one new input per sequence, weight [C, K], states
    [S, K-1, C] (slot slots[b], a long [B] on the device, is sequence b's state, stepped in place). Returns y [B, C]."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [B, C] and weight [C, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    num_rows, num_channels = x.shape
    width = weight.shape[1]
    if width < 2 or states.dim() != 3 or states.shape[1:] != (width - 1, num_channels) or states.stride(2) != 1:
        raise ValueError(f"states must be [S, K-1, C] = [*, {width - 1}, {num_channels}] with K >= 2 and unit column "
                         f"stride; got {tuple(states.shape)}")
    if slots.shape != (num_rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be an integer tensor [{num_rows}]; got {slots.dtype} {tuple(slots.shape)}")
    slots = slots.contiguous()  # the kernel reads slots[b] at slots_ptr + b (a verify passes a column of a table)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(num_rows, num_channels, dtype=x.dtype, device=x.device)
    if num_rows:
        _conv_kernel[(num_rows, triton.cdiv(num_channels, CONV_BLOCK_C))](
            x, weight, states, y, states,
            1, num_channels, x.stride(0), weight.stride(0), weight.stride(1), states.stride(1), y.stride(0),
            states.stride(1), slots, states.stride(0),
            WIDTH=width, BT=CONV_BLOCK_T, BC=CONV_BLOCK_C, BS=triton.next_power_of_2(width - 1), SLOTS=True,
            num_warps=CONV_NUM_WARPS, **pdl.options()
        )
    return y


def causal_conv1d_window(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         scratch: torch.Tensor) -> torch.Tensor:
    """Triton twin of naive.causal_conv1d_window: x [B * T, C] the T rows of each of B sequences, row-major,
    weight [C, K], states [S, K-1, C]; sequence b's rows step from slot slots[b] (read only), the state after
    its row j written to slot scratch[b, j] (slots and scratch integer tensors [B], [B, T] on the device, all
    distinct). Returns y [B * T, C]."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [B * T, C] and weight [C, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    num_channels = x.shape[1]
    width = weight.shape[1]
    if width < 2 or states.dim() != 3 or states.shape[1:] != (width - 1, num_channels) or states.stride(2) != 1:
        raise ValueError(f"states must be [S, K-1, C] = [*, {width - 1}, {num_channels}] with K >= 2 and unit column "
                         f"stride; got {tuple(states.shape)}")
    num_seqs, num_rows = _check_window(slots, scratch, x.shape[0])
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], num_channels, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _conv_window_kernel[(num_seqs, triton.cdiv(num_channels, CONV_BLOCK_C))](
            x, weight, states, y, num_rows, num_channels, x.stride(0), weight.stride(0), weight.stride(1),
            states.stride(1), y.stride(0), slots, slots.stride(0), scratch, scratch.stride(0), scratch.stride(1),
            states.stride(0),
            WIDTH=width, BT=triton.next_power_of_2(num_rows), BC=CONV_BLOCK_C, BS=triton.next_power_of_2(width - 1),
            num_warps=CONV_NUM_WARPS, **pdl.options()
        )
    return y


def _check_window(slots: torch.Tensor, scratch: torch.Tensor, total_rows: int) -> tuple[int, int]:
    """(B, T) of a verify window over `total_rows` rows, or a ValueError naming the offending shape."""
    if scratch.dim() != 2 or slots.shape != scratch.shape[:1] or scratch.shape[0] * scratch.shape[1] != total_rows:
        raise ValueError(f"slots must be [B] and scratch [B, T] with B * T = {total_rows} rows; got "
                         f"{tuple(slots.shape)}, {tuple(scratch.shape)}")
    for name, t in (("slots", slots), ("scratch", scratch)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor; got {t.dtype}")
    return scratch.shape[0], scratch.shape[1]
