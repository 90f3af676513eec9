"""Causal GQA attention against its twin: prefill chunks, decode with split-K, the combine pass."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import attention, naive

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

CASES = {
    # T, H, Hkv, D, q_start, dtype
    "prefill-gqa": (100, 4, 2, 32, 50, torch.float32),
    "first-chunk-mha": (64, 4, 4, 16, 0, torch.float32),
    "odd-head-dim": (33, 2, 1, 24, 40, torch.float32),
    "prefill-bf16": (70, 4, 2, 32, 130, torch.bfloat16),
    "decode-split": (1, 4, 1, 32, 299, torch.float32),
    "decode-short": (1, 8, 2, 16, 10, torch.float32),
    "decode-bf16-split": (1, 8, 2, 32, 280, torch.bfloat16),
}


def _inputs(num_q, num_heads, num_kv, head_dim, q_start, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(q_start + num_q, num_kv, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(q_start + num_q, num_kv, head_dim, generator=gen).to(device, dtype)
    return q, k, v


def _tol(dtype, device):
    # on a GPU an fp32 tl.dot runs in tf32
    return 3e-3 if (dtype == torch.float32 and device == "cuda") else TOL[dtype]


@pytest.mark.parametrize("num_q,num_heads,num_kv,head_dim,q_start,dtype", CASES.values(), ids=CASES.keys())
def test_attention_matches_twin(device, rel, num_q, num_heads, num_kv, head_dim, q_start, dtype):
    q, k, v = _inputs(num_q, num_heads, num_kv, head_dim, q_start, dtype, device)
    out = attention.attention(q, k, v, q_start)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel(out, naive.attention(q, k, v, q_start)) < _tol(dtype, device)


def test_decode_uses_splits():
    """The decode cases above do run the combine pass."""
    assert attention.split_rows(1, 4, 1, 32, 300) < 300
    assert attention.split_rows(1, 8, 2, 32, 281) < 281
    assert attention.split_rows(100, 4, 2, 32, 150) >= 150


SPLIT_CASES = {"rows64": (37, 200, 64), "rows128": (100, 150, 128), "one-split": (40, 20, 64)}


@pytest.mark.parametrize("num_q,q_start,rows", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_prefill_forced_splits(device, rel, num_q, q_start, rows):
    q, k, v = _inputs(num_q, 4, 2, 16, q_start, torch.float32, device, seed=1)
    out = attention.attention_split(q, k, v, q_start, None, rows)
    assert rel(out, naive.attention(q, k, v, q_start)) < _tol(torch.float32, device)


def test_strided_inputs_and_scale(device, rel):
    """q sliced from a wider projection, k and v views of a bigger cache; an explicit scale."""
    q_start, num_q = 20, 12
    qg = torch.randn(num_q, 4, 64, device=device)
    q = qg[..., :32]
    cache = torch.randn(2, 64, 2, 32, device=device)
    k, v = cache[0, : q_start + num_q], cache[1, : q_start + num_q]
    out = attention.attention(q, k, v, q_start, scale=0.3)
    assert rel(out, naive.attention(q, k, v, q_start, scale=0.3)) < _tol(torch.float32, device)


def test_query_chunks_are_row_independent(device):
    """128 queries in one call == two calls of 64 over the same rows (one split each): the same bits."""
    q, k, v = _inputs(128, 4, 2, 16, 64, torch.float32, device, seed=2)
    whole = attention.attention(q, k, v, 64)
    first = attention.attention(q[:64], k[:128], v[:128], 64)
    second = attention.attention(q[64:], k, v, 128)
    assert torch.equal(torch.cat((first, second)), whole)


def test_attention_deterministic(device):
    for num_q, q_start in ((1, 290), (50, 100)):
        q, k, v = _inputs(num_q, 8, 2, 32, q_start, torch.bfloat16, device, seed=3)
        assert torch.equal(attention.attention(q, k, v, q_start), attention.attention(q, k, v, q_start))


def test_rejects_short_kv(device):
    q, k, v = _inputs(4, 2, 1, 16, 0, torch.float32, device)
    with pytest.raises(ValueError, match="rows"):
        attention.attention(q, k[:3], v[:3], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q,q_start", [(512, 1536), (512, 0), (1, 5000), (1, 100)],
                         ids=["chunk-L2048", "chunk-L512", "decode-L5001", "decode-L101"])
def test_attention_model_shapes_gpu(rel, num_q, q_start):
    q, k, v = _inputs(num_q, 8, 2, 256, q_start, torch.bfloat16, "cuda", seed=4)
    out = attention.attention(q, k, v, q_start)
    assert rel(out, naive.attention(q, k, v, q_start)) < 1e-2
    assert torch.equal(out, attention.attention(q, k, v, q_start))
