"""Qwen3.5-MoE's sparse MLP block in Triton, batch-invariant; the naive twins are in moe_naive.py (the math,
the layouts, the tie rule and the rounding points are written there, and hold here).

One block is five Triton launches and a few small torch ops, none of which waits on the host (a CUDA
graph can hold it):

    router   logits [T, E] = x @ router_w^T                           _dense_kernel
    route    softmax (fp32), top-k by logit (lower index on ties),
             renormalised weights [T, k], the pairs' int32 sort keys   _route_kernel, a program a token
    plan     (token, expert) pairs grouped by expert: a stable sort of
             the pairs' expert ids, each expert's segment cut into
             BLOCK_M-row blocks, a block -> expert table               torch: sort, searchsorted, cumsum
    gate_up  h [P, I] = silu(x_t @ gate^T) * (x_t @ up^T) per block     _gate_up_kernel
    down     y [P, H] = h @ down^T per block, stored at the pair's
             own row (token t, rank r -> t * k + r; no atomics)        _down_kernel
    combine  out_t = sum_r w_tr * y_tr (+ sigmoid(gate_t) * shared_t)
             in fp32 in rank order, rounded once                       _combine_kernel, a program a token

The shared expert rides along as expert E: every token gets one more pair (row T * k + t of y), whose weights
are shared_gate_up / shared_down (its intermediate size may differ from the routed experts').

Batch invariance (a row's bits never depend on the other rows of the call): every tile shape below is
pinned, not chosen by T; a tile's K loop runs from 0 upwards in one program (no split-K); the top-k outputs
are summed in one program per token in rank order; no atomics anywhere. A row's place inside a BLOCK_M tile
does depend on the other rows, and on a GPU that does not change its bits (a tile product's row is that
row's dot products; the gpu test checks it bit for bit at the real shapes). Under Triton's interpreter it
would: tile products go through numpy's BLAS, whose result for a row depends on its place in the tile;
there (ROW_EXACT) the kernels multiply by broadcasting and sum over K instead, which is exact per row, so
the interpreted tests can check invariance bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

# pinned tiles, for every T (see the docstring): a block of BLOCK_M (token, expert) rows of one expert
BLOCK_M = 16  # a chunk of 512 tokens at top-8 over 256 experts is 16 rows an expert on average
GATE_UP_BLOCK_N, GATE_UP_BLOCK_K = 32, 128  # gate and up: 2 x 32 columns a program
DOWN_BLOCK_N, DOWN_BLOCK_K = 64, 128
ROUTER_BLOCK_N, ROUTER_BLOCK_K = 16, 256  # 16 programs for one token: its 1 MB of router weight in parallel
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _dot_acc(acc, b_a, b_b, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr):
    """acc + b_a [BM, BK] @ b_b [BN, BK]^T in fp32."""
    if ROW_EXACT:  # the interpreter: exact per row (the module docstring)
        return acc + tl.sum(b_a.to(tl.float32)[:, :, None] * tl.trans(b_b.to(tl.float32))[None, :, :], axis=1)
    elif IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmul
        return tl.dot(b_a, tl.trans(b_b), acc, input_precision="ieee")
    else:
        return tl.dot(b_a, tl.trans(b_b), acc)


@triton.jit(do_not_specialize=["num_rows"])
def _dense_kernel(
    x_ptr, w_ptr, y_ptr, num_rows, num_cols, depth, stride_x, stride_w, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr,
):
    """y [M, N] = x [M, K] @ w [N, K]^T, one BM x BN tile a program (the router's logits)."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < num_rows, o_n < num_cols
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, depth, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < depth
        b_x = tl.load(x_ptr + o_m[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        b_w = tl.load(w_ptr + o_n[:, None].to(tl.int64) * stride_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        acc = _dot_acc(acc, b_x, b_w, ROW_EXACT, IEEE)
    p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, keys_ptr, num_experts, num_routed, stride_l, TOP_K: tl.constexpr,
                  BE: tl.constexpr, KEYS: tl.constexpr, SHARED: tl.constexpr):
    """One token: softmax over its E logits (fp32), the TOP_K largest logits (equal ones: the lowest index
    first) into ids [T, TOP_K] by rank, their probabilities renormalised into w [T, TOP_K]. With KEYS, also
    the pairs' experts as int32 into keys (the plan's sort keys): t * TOP_K + r, and with SHARED the shared
    expert E at num_routed + t."""
    i_t = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    m_e = o_e < num_experts
    b_l = tl.load(logits_ptr + i_t * stride_l + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    b_l = tl.where(b_l == b_l, b_l, float("-inf"))  # NaN counts as -inf: every rank gets an expert in range
    b_ex = tl.where(m_e, tl.exp(b_l - tl.max(b_l, 0)), 0.0)
    b_p = b_ex / tl.sum(b_ex, 0)
    b_rank = tl.full((BE,), -1, tl.int32)
    for r in tl.static_range(TOP_K):
        is_free = m_e & (b_rank < 0)
        best = tl.max(tl.where(is_free, b_l, float("-inf")), 0)
        pick = tl.min(tl.where(is_free & (b_l == best), o_e, BE), 0)  # the tie rule, explicit
        b_rank = tl.where(o_e == pick, r, b_rank)
    is_top = b_rank >= 0
    b_w = b_p / tl.sum(tl.where(is_top, b_p, 0.0), 0)
    tl.store(ids_ptr + i_t * TOP_K + b_rank, o_e.to(tl.int64), mask=is_top)
    tl.store(w_ptr + i_t * TOP_K + b_rank, b_w.to(w_ptr.dtype.element_ty), mask=is_top)
    if KEYS:
        tl.store(keys_ptr + i_t * TOP_K + b_rank, o_e, mask=is_top)
        if SHARED:
            tl.store(keys_ptr + num_routed + i_t, num_experts)


@triton.jit
def _block_rows(e, order_ptr, block_end_ptr, bounds_ptr, num_routed, top_k, BM: tl.constexpr):
    """The rows of this program's block, of expert e: (their places in the sorted order, their mask, their
    pairs, their tokens). bounds[e]..bounds[e + 1] are expert e's rows in `order` (pair ids sorted by
    expert); block_end[e] is the number of blocks of experts 0..e."""
    i_b = tl.program_id(0)
    lo, hi = tl.load(bounds_ptr + e), tl.load(bounds_ptr + e + 1)
    first_block = tl.load(block_end_ptr + e) - (hi - lo + BM - 1) // BM
    o_m = lo + (i_b - first_block) * BM + tl.arange(0, BM)
    m_m = o_m < hi
    pair = tl.load(order_ptr + o_m, mask=m_m, other=0)
    # routed pair t * k + r, or the shared expert's pair num_routed + t
    token = tl.where(pair < num_routed, pair // top_k, pair - num_routed)
    return o_m, m_m, pair, token


@triton.jit(do_not_specialize=["num_routed"])
def _gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, order_ptr, block_expert_ptr, block_end_ptr, bounds_ptr,
    num_routed, top_k, num_experts, inter, inter_s, hidden, stride_x, stride_we, stride_h,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr,
):
    """h[row] = silu(x_t @ gate_e^T) * (x_t @ up_e^T) for a block's rows, BN columns of each."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e > num_experts:  # past the last block
        return
    if e == num_experts:  # the shared expert: [2 Is, H]
        p_w = ws_ptr
        width = inter_s
    else:  # [E, 2 I, H]
        p_w = w_ptr + e.to(tl.int64) * stride_we
        width = inter
    n0 = tl.program_id(1) * BN
    if n0 >= width:
        return
    o_m, m_m, _, token = _block_rows(e, order_ptr, block_end_ptr, bounds_ptr, num_routed, top_k, BM)
    o_n = n0 + tl.arange(0, BN)
    m_n = o_n < width
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, hidden, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < hidden
        b_x = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        p_g = p_w + o_n[:, None].to(tl.int64) * hidden + o_k[None, :]
        m_w = m_n[:, None] & m_k[None, :]
        b_g = tl.load(p_g, mask=m_w, other=0.0)
        b_u = tl.load(p_g + width.to(tl.int64) * hidden, mask=m_w, other=0.0)
        acc_g = _dot_acc(acc_g, b_x, b_g, ROW_EXACT, IEEE)
        acc_u = _dot_acc(acc_u, b_x, b_u, ROW_EXACT, IEEE)
    # the twin's rounding: each projection to the dtype, silu(gate) to the dtype, then the product
    dt = h_ptr.dtype.element_ty
    b_g = acc_g.to(dt).to(tl.float32)
    b_act = (b_g * tl.sigmoid(b_g)).to(dt)
    b_h = b_act.to(tl.float32) * acc_u.to(dt).to(tl.float32)
    tl.store(h_ptr + o_m[:, None].to(tl.int64) * stride_h + o_n[None, :], b_h.to(dt), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_routed"])
def _down_kernel(
    h_ptr, w_ptr, ws_ptr, y_ptr, order_ptr, block_expert_ptr, block_end_ptr, bounds_ptr,
    num_routed, top_k, num_experts, inter, inter_s, hidden, stride_h, stride_we, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_EXACT: tl.constexpr, IEEE: tl.constexpr,
):
    """y[pair] = h[row] @ down_e^T for a block's rows, BN of the H columns; each row lands at its pair's row."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e > num_experts:
        return
    if e == num_experts:  # the shared expert: [H, Is]
        p_w = ws_ptr
        depth = inter_s
    else:  # [E, H, I]
        p_w = w_ptr + e.to(tl.int64) * stride_we
        depth = inter
    o_m, m_m, pair, _ = _block_rows(e, order_ptr, block_end_ptr, bounds_ptr, num_routed, top_k, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_n = o_n < hidden
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, depth, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < depth
        b_h = tl.load(h_ptr + o_m[:, None].to(tl.int64) * stride_h + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * depth + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        acc = _dot_acc(acc, b_h, b_w, ROW_EXACT, IEEE)
    p_y = y_ptr + pair[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_routed"])
def _combine_kernel(
    y_ptr, w_ptr, x_ptr, gw_ptr, out_ptr, num_routed, hidden, stride_y, stride_x, stride_out,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BH: tl.constexpr,
):
    """One token: out = sum_r w[t, r] * y[t * k + r] (+ sigmoid(x_t . gw) * y[num_routed + t]) in fp32,
    in rank order, rounded once."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < hidden
    acc = tl.zeros((BH,), tl.float32)
    for r in tl.static_range(TOP_K):
        b_w = tl.load(w_ptr + i_t * TOP_K + r).to(tl.float32)
        acc += b_w * tl.load(y_ptr + (i_t * TOP_K + r) * stride_y + o_h, mask=m_h, other=0.0).to(tl.float32)
    if HAS_SHARED:
        b_x = tl.load(x_ptr + i_t * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_gw = tl.load(gw_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
        gate = tl.sum(b_x * b_gw, 0).to(out_ptr.dtype.element_ty).to(tl.float32)  # the logit rounded, as F.linear
        b_s = tl.load(y_ptr + (num_routed + i_t) * stride_y + o_h, mask=m_h, other=0.0).to(tl.float32)
        acc += tl.sigmoid(gate) * b_s
    tl.store(out_ptr + i_t * stride_out + o_h, acc.to(out_ptr.dtype.element_ty), mask=m_h)


def _dot_flags(dtype: torch.dtype) -> dict:
    return dict(ROW_EXACT=interpreting(), IEEE=dtype == torch.float32)


def router_logits(x: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ router_w [E, H]^T -> [T, E] in x's dtype, one pinned tiling for every T."""
    num_tokens, hidden = x.shape
    num_experts = router_w.shape[0]
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_experts, ROUTER_BLOCK_N))
        _dense_kernel[grid](x, router_w, logits, num_tokens, num_experts, hidden, x.stride(0), router_w.stride(0),
                            logits.stride(0), BM=BLOCK_M, BN=ROUTER_BLOCK_N, BK=ROUTER_BLOCK_K, **_dot_flags(x.dtype),
                            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return logits


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As moe_naive.moe_route: logits [T, E] -> (ids [T, k] int64, weights [T, k] in logits' dtype)."""
    return _route(logits, top_k)[:2]


def _route(logits: torch.Tensor, top_k: int, with_keys: bool = False, with_shared: bool = False):
    """moe_route, and with_keys the plan's sort keys [T * k (+ T with_shared)] int32 from the same launch."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts); got {top_k}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    num_routed = num_tokens * top_k
    keys = torch.empty(num_routed + num_tokens * with_shared if with_keys else 0, dtype=torch.int32,
                       device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, ids, weights, keys, num_experts, num_routed, logits.stride(0),
                                     TOP_K=top_k, BE=triton.next_power_of_2(num_experts), KEYS=with_keys,
                                     SHARED=with_shared)
    return ids, weights, keys


def _plan(keys: torch.Tensor, num_experts: int):
    """The pairs (keys [P] int32, each pair's expert, E for the shared one) grouped by expert: (order [P] pair
    ids sorted by expert, stable; bounds [E + 2], expert e's rows in order are bounds[e]..bounds[e + 1];
    block_end [E + 1], the blocks of experts 0..e; block_expert [max_blocks], each block's expert, E + 1 past
    the last block). Device ops only: nothing waits on the host."""
    sorted_keys, order = torch.sort(keys, stable=True)
    arange = torch.arange(num_experts + 2, dtype=torch.int32, device=keys.device)
    bounds = torch.searchsorted(sorted_keys, arange)
    block_end = torch.cumsum((bounds[1:] - bounds[:-1] + BLOCK_M - 1) // BLOCK_M, 0)
    num_pairs = keys.numel()
    # sum over experts of ceil(rows / BM) <= ceil(P / BM) + (experts with rows)
    max_blocks = triton.cdiv(num_pairs, BLOCK_M) + min(num_experts + 1, num_pairs)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=keys.device), right=True)
    return order, bounds, block_end, block_expert, max_blocks


def _check_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    num_experts, two_inter, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"need x [T, H], gate_up [E, 2I, H], down [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("expert weights must be contiguous (a copy each call would move all of them): "
                         "store gate_up and down contiguous")
    if not (x.dtype == gate_up.dtype == down.dtype):
        raise ValueError(f"x and the expert weights must share a dtype; got {x.dtype}, {gate_up.dtype}, {down.dtype}")


def _grouped_experts(x, keys, weights, gate_up, down, shared=None):
    """The routed experts (and the shared one as expert E when `shared` = (shared_gate_up, shared_down,
    shared_gate_w)) on x [T, H] -> [T, H]; keys [T * k (+ T)] int32 are the pairs' experts."""
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = gate_up.shape[0], weights.shape[1], gate_up.shape[1] // 2
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ws_gate_up, ws_down, ws_gate = shared if shared is not None else (gate_up, down, x)
    inter_s = ws_gate_up.shape[-2] // 2 if shared is not None else inter
    order, bounds, block_end, block_expert, max_blocks = _plan(keys, num_experts)
    num_routed = num_tokens * top_k
    num_pairs = order.numel()
    h = torch.empty(num_pairs, max(inter, inter_s), dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    table = (order, block_expert, block_end, bounds, num_routed, top_k, num_experts, inter, inter_s, hidden)
    flags = dict(BM=BLOCK_M, **_dot_flags(x.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _gate_up_kernel[(max_blocks, triton.cdiv(max(inter, inter_s), GATE_UP_BLOCK_N))](
        x, gate_up, ws_gate_up, h, *table, x.stride(0), gate_up.stride(0), h.stride(0),
        BN=GATE_UP_BLOCK_N, BK=GATE_UP_BLOCK_K, **flags)
    _down_kernel[(max_blocks, triton.cdiv(hidden, DOWN_BLOCK_N))](
        h, down, ws_down, y, *table, h.stride(0), down.stride(0), y.stride(0),
        BN=DOWN_BLOCK_N, BK=DOWN_BLOCK_K, **flags)
    weights = weights if weights.is_contiguous() else weights.contiguous()
    _combine_kernel[(num_tokens,)](y, weights, x, ws_gate, out, num_routed, hidden, y.stride(0), x.stride(0),
                                   out.stride(0), TOP_K=top_k, HAS_SHARED=shared is not None,
                                   BH=triton.next_power_of_2(hidden), num_warps=NUM_WARPS)
    return out


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """As moe_naive.moe_experts: x [T, H], ids [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I]
    -> sum_r weights[t, r] * expert_{ids[t, r]}(x[t]), [T, H] in x's dtype. ids must lie in 0..E-1 (not
    checked: that would wait on the device; moe_route's always do)."""
    _check_experts(x, gate_up, down)
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids and weights must both be [T, k] for x [T, H]; got {tuple(ids.shape)}, "
                         f"{tuple(weights.shape)} for {tuple(x.shape)}")
    return _grouped_experts(x, ids.reshape(-1).to(torch.int32), weights, gate_up, down)


def moe_block(x: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              shared_gate_up: torch.Tensor, shared_down: torch.Tensor, shared_gate_w: torch.Tensor,
              top_k: int) -> torch.Tensor:
    """As moe_naive.moe_block: Qwen3.5-MoE's sparse MLP block on x [T, H] -> [T, H]; router_w [E, H],
    gate_up [E, 2I, H], down [E, H, I], shared_gate_up [2Is, H], shared_down [H, Is], shared_gate_w [1, H]."""
    _check_experts(x, gate_up, down)
    hidden = x.shape[1]
    inter_s = shared_gate_up.shape[0] // 2
    if (router_w.shape != (gate_up.shape[0], hidden) or shared_gate_up.shape != (2 * inter_s, hidden)
            or shared_down.shape != (hidden, inter_s) or shared_gate_w.shape != (1, hidden)):
        raise ValueError(f"need router_w [E, H], shared_gate_up [2Is, H], shared_down [H, Is], shared_gate_w [1, H]"
                         f" for H = {hidden}; got {tuple(router_w.shape)}, {tuple(shared_gate_up.shape)}, "
                         f"{tuple(shared_down.shape)}, {tuple(shared_gate_w.shape)}")
    shared = tuple(w.contiguous() for w in (shared_gate_up, shared_down, shared_gate_w))
    x = x if x.stride(-1) == 1 else x.contiguous()
    _, weights, keys = _route(router_logits(x, router_w.contiguous()), top_k, with_keys=True, with_shared=True)
    return _grouped_experts(x, keys, weights, gate_up, down, shared)


__all__ = ["moe_block", "moe_experts", "moe_route", "router_logits"]
