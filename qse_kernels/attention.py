"""Causal GQA attention in Triton, prefill chunks and decode alike; the naive twin is naive.attention.

Query rows of one KV head are packed: row m of kv head hk is token m // G of query head hk*G + m % G
(G = H / Hkv), so a K/V tile loaded once serves the whole group. Grid (M / BM, Hkv, splits).

    split s covers KV rows [s*R, (s+1)*R) (R a multiple of BN); within it a program walks its rows
    in blocks of BN with an fp32 online softmax (log2 domain), first the blocks every query row sees
    (no mask), then the causal edge (masked).

With one split the program writes the output; with several it writes each split's normalised
partial and log-sum-exp, and a second launch combines the splits in order 0..S-1. R is a fixed
function of (T, H, Hkv, L) alone (`split_rows`), never of the device or its load, so a result
depends on nothing but the inputs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# split-K sizing: aim at about this many programs, with splits of at least this many rows
TARGET_PROGRAMS = 264
PREFILL_MIN_SPLIT_ROWS = 1024
DECODE_MIN_SPLIT_ROWS = 256
COMBINE_BLOCK_SPLITS = 16
LOG2_E = 1.4426950408889634


def _interpreting() -> bool:
    """Triton 3.9's interpreter multiplies 16-bit float dot operands as raw integers: widen them there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _config(num_q: int, group: int, head_dim: int) -> dict:
    """Tile sizes pinned by the shape: (BM, BN, num_warps, num_stages)."""
    if num_q * group <= 16:  # decode: the group's heads of one token
        return dict(BM=16, BN=64, num_warps=4, num_stages=3)
    if head_dim > 128:
        return dict(BM=128, BN=64, num_warps=8, num_stages=2)
    return dict(BM=128, BN=64, num_warps=4, num_stages=3)


def split_rows(num_q: int, num_heads: int, num_kv: int, head_dim: int, num_rows: int) -> int:
    """KV rows per split: a multiple of BN; num_rows or more means one split (no combine pass)."""
    cfg = _config(num_q, num_heads // num_kv, head_dim)
    base_programs = triton.cdiv(num_q * (num_heads // num_kv), cfg["BM"]) * num_kv
    want = triton.cdiv(TARGET_PROGRAMS, base_programs)
    min_rows = DECODE_MIN_SPLIT_ROWS if cfg["BM"] == 16 else PREFILL_MIN_SPLIT_ROWS
    rows = max(min_rows, triton.cdiv(triton.cdiv(max(num_rows, 1), want), cfg["BN"]) * cfg["BN"])
    return rows


@triton.jit
def _attn_block(b_q, k_ptr, v_ptr, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                b_m, b_l, b_acc, scale_log2, MASKED: tl.constexpr, DOT_FP32: tl.constexpr):
    """One BN block of keys into the online softmax state (b_m, b_l, b_acc)."""
    o_key = n + o_n
    if MASKED:
        m_key = o_key < num_rows
        b_k = tl.load(k_ptr + o_key[:, None] * stride_kl + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_ptr + o_key[:, None] * stride_vl + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0)
    else:
        b_k = tl.load(k_ptr + o_key[:, None] * stride_kl + o_d[None, :], mask=m_d[None, :], other=0.0)
        b_v = tl.load(v_ptr + o_key[:, None] * stride_vl + o_d[None, :], mask=m_d[None, :], other=0.0)
    if DOT_FP32:
        b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2
    if MASKED:
        b_s = tl.where((o_key[None, :] <= pos[:, None]) & (o_key < num_rows)[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # a row with no visible key yet keeps m = -inf; subtract 0 there so nothing turns into NaN
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_m_new, b_l, b_acc


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, lse_ptr,
    q_start, num_q, num_heads, num_rows, rows_per_split, scale_log2,
    stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    i_m, i_hk, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_t = o_m // G
    o_head = i_hk * G + o_m % G
    m_m = o_t < num_q
    pos = q_start + o_t
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_n = tl.arange(0, BN)
    p_q = q_ptr + o_t[:, None] * stride_qt + o_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)

    t_first = (i_m * BM) // G
    t_last = tl.minimum((i_m * BM + BM - 1) // G, num_q - 1)
    lo = i_s * rows_per_split
    hi = tl.minimum(tl.minimum(lo + rows_per_split, q_start + t_last + 1), num_rows)
    # keys below q_start + t_first + 1 are seen by every row of the block: no mask
    full_hi = tl.maximum(lo, tl.minimum(hi, q_start + t_first + 1))
    full_hi = lo + ((full_hi - lo) // BN) * BN

    b_m = tl.full((BM,), float("-inf"), tl.float32)
    b_l = tl.zeros((BM,), tl.float32)
    b_acc = tl.zeros((BM, BD), tl.float32)
    k_head = k_ptr + i_hk * stride_kh
    v_head = v_ptr + i_hk * stride_vh
    for n in range(lo, full_hi, BN):
        b_m, b_l, b_acc = _attn_block(b_q, k_head, v_head, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                                      b_m, b_l, b_acc, scale_log2, MASKED=False, DOT_FP32=DOT_FP32)
    for n in range(full_hi, hi, BN):
        b_m, b_l, b_acc = _attn_block(b_q, k_head, v_head, n, o_n, o_d, m_d, pos, num_rows, stride_kl, stride_vl,
                                      b_m, b_l, b_acc, scale_log2, MASKED=True, DOT_FP32=DOT_FP32)

    m_out = m_m[:, None] & m_d[None, :]
    if SPLIT:
        b_has = b_l > 0.0
        b_part = b_acc / tl.where(b_has, b_l, 1.0)[:, None]
        b_lse = tl.where(b_has, b_m + tl.log2(tl.where(b_has, b_l, 1.0)), float("-inf"))
        o_row = (i_s * num_q + o_t) * num_heads + o_head
        tl.store(part_ptr + o_row[:, None] * D + o_d[None, :], b_part, mask=m_out)
        tl.store(lse_ptr + o_row, b_lse, mask=m_m)
    else:
        b_out = b_acc / b_l[:, None]
        p_o = o_ptr + o_t[:, None] * stride_ot + o_head[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_out.to(o_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _attn_combine_kernel(
    part_ptr, lse_ptr, o_ptr, num_splits, num_q, num_heads, stride_ot, stride_oh,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):
    """out = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M), splits in order 0..S-1."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_max = tl.full((BS,), float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BS):
        o_s = s0 + tl.arange(0, BS)
        b_lse = tl.load(lse_ptr + (o_s * num_q + i_t) * num_heads + i_h, mask=o_s < num_splits, other=float("-inf"))
        b_max = tl.maximum(b_max, b_lse)
    b_top = tl.max(b_max, 0)  # finite: key 0 is in split 0 and every row sees it
    b_acc = tl.zeros((BD,), tl.float32)
    b_den = tl.zeros((BS,), tl.float32)
    for s0 in range(0, num_splits, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < num_splits
        o_row = (o_s * num_q + i_t) * num_heads + i_h
        b_lse = tl.load(lse_ptr + o_row, mask=m_s, other=float("-inf"))
        b_w = tl.exp2(b_lse - b_top)
        b_part = tl.load(part_ptr + o_row[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_acc = b_acc + tl.sum(b_w[:, None] * b_part, 0)
        b_den = b_den + b_w
    b_out = b_acc / tl.sum(b_den, 0)
    tl.store(o_ptr + i_t * stride_ot + i_h * stride_oh + o_d, b_out.to(o_ptr.dtype.element_ty), mask=m_d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None = None) -> torch.Tensor:
    """Triton twin of naive.attention: q [T, H, D] at positions q_start.., k, v [L, Hkv, D] -> [T, H, D]."""
    return attention_split(q, k, v, q_start, scale, None)


def attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None,
                    rows_per_split: int | None) -> torch.Tensor:
    """attention with the KV split length given (a multiple of the kernel's BN; tests use it to force
    splits); None takes `split_rows`."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k, v [L, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_q, num_heads, head_dim = q.shape
    num_rows, num_kv = k.shape[0], k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} must be a multiple of KV heads {num_kv}")
    if q_start < 0 or num_rows < q_start + num_q:
        raise ValueError(f"k, v hold {num_rows} rows; queries at {q_start}..{q_start + num_q - 1} need at least {q_start + num_q}")
    group = num_heads // num_kv
    cfg = _config(num_q, group, head_dim)
    if rows_per_split is None:
        rows_per_split = split_rows(num_q, num_heads, num_kv, head_dim, num_rows)
    if rows_per_split <= 0 or rows_per_split % cfg["BN"]:
        raise ValueError(f"rows_per_split must be a multiple of {cfg['BN']}; got {rows_per_split}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(num_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else scale
    num_splits = triton.cdiv(num_rows, rows_per_split)
    is_split = num_splits > 1
    if is_split:
        part = torch.empty(num_splits, num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, num_q, num_heads, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (triton.cdiv(num_q * group, cfg["BM"]), num_kv, num_splits)
    _attn_kernel[grid](
        q, k, v, out, part, lse,
        q_start, num_q, num_heads, num_rows, rows_per_split, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        G=group, D=head_dim, BD=block_d, BM=cfg["BM"], BN=cfg["BN"], SPLIT=is_split,
        DOT_FP32=_interpreting() and q.dtype != torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if is_split:
        _attn_combine_kernel[(num_q, num_heads)](
            part, lse, out, num_splits, num_q, num_heads, out.stride(0), out.stride(1),
            D=head_dim, BD=block_d, BS=COMBINE_BLOCK_SPLITS, num_warps=4,
        )
    return out


__all__ = ["attention", "attention_split", "split_rows"]
