"""The small fusions (residual add + norm, SiLU gate, q/k norm + rotary, also storing the K/V rows into pages),
the gated norm on a strided gate, and the GDN rules writing their state in place: each against its naive twin."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import fused, gdn_chunk, gdn_recurrent, naive, norms

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _randn(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_add_rms_norm_matches_twin(device, rel, dtype):
    gen = torch.Generator().manual_seed(0)
    x = _randn(19, 96, gen=gen, scale=3).to(device, dtype)
    h = _randn(19, 96, gen=gen).to(device, dtype)
    w = _randn(96, gen=gen, scale=0.2).to(device, dtype)
    s, y = fused.add_rms_norm(x, h, w, EPS)
    ref_s, ref_y = naive.add_rms_norm(x, h, w, EPS)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
    assert rel(s, ref_s) < TOL[dtype] and rel(y, ref_y) < TOL[dtype]
    # the norm is the one of the stored (rounded) sum: the same as the plain norm kernel on it
    assert torch.equal(y, norms.rms_norm(s, w, EPS))


def test_add_rms_norm_row_independent_of_batch(device):
    gen = torch.Generator().manual_seed(1)
    x, h, w = _randn(23, 64, gen=gen).to(device), _randn(23, 64, gen=gen).to(device), _randn(64, gen=gen).to(device)
    s, y = fused.add_rms_norm(x, h, w, EPS)
    s1, y1 = fused.add_rms_norm(x[7:8], h[7:8], w, EPS)
    assert torch.equal(s1, s[7:8]) and torch.equal(y1, y[7:8])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_silu_mul_matches_twin(device, rel, dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = _randn(11, 2 * 600, gen=gen, scale=3).to(device, dtype)  # width 600: a partial column block
    out = fused.silu_mul(gate_up)
    assert out.shape == (11, 600) and out.dtype == dtype
    assert rel(out, naive.silu_mul(gate_up)) < TOL[dtype]


def test_silu_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        fused.silu_mul(torch.zeros(2, 7, device=device))


QK_CASES = {
    # T, H, Hkv, D, rotary dims, dtype
    "partial-rotary-fp32": (5, 4, 2, 32, 8, torch.float32),
    "full-rotary-bf16": (3, 2, 1, 16, 16, torch.bfloat16),
    "odd-dim-fp32": (4, 2, 2, 24, 8, torch.float32),
}


@pytest.mark.parametrize("num_tokens,num_heads,num_kv,dim,rotary_dim,dtype", QK_CASES.values(), ids=QK_CASES.keys())
def test_qk_norm_rotary_matches_twin(device, rel, num_tokens, num_heads, num_kv, dim, rotary_dim, dtype):
    gen = torch.Generator().manual_seed(3)
    # q sliced out of a fused [T, H, 2D] projection and k out of a wider row, as the attention layer does
    qg = _randn(num_tokens, num_heads, 2 * dim, gen=gen, scale=2).to(device, dtype)
    kv = _randn(num_tokens, 3 * num_kv * dim, gen=gen, scale=2).to(device, dtype)
    q = qg[..., :dim]
    k = kv[:, num_kv * dim : 2 * num_kv * dim].view(num_tokens, num_kv, dim)
    wq = _randn(dim, gen=gen, scale=0.2).to(device, dtype)
    wk = _randn(dim, gen=gen, scale=0.2).to(device, dtype)
    cos, sin = naive.rotary_cos_sin(torch.arange(7, 7 + num_tokens), rotary_dim, 10000.0, dtype)
    cos, sin = cos.to(device), sin.to(device)
    out_q, out_k = fused.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    ref_q, ref_k = naive.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.is_contiguous()
    assert rel(out_q, ref_q) < TOL[dtype] and rel(out_k, ref_k) < TOL[dtype]


def test_qk_norm_rotary_rejects_bad_cos(device):
    q, k = torch.zeros(2, 2, 8, device=device), torch.zeros(2, 1, 8, device=device)
    w = torch.zeros(8, device=device)
    with pytest.raises(ValueError, match="cos, sin"):
        fused.qk_norm_rotary(q, k, w, w, torch.zeros(2, 3, device=device), torch.zeros(2, 3, device=device), EPS)


def test_gated_rms_norm_strided_gate(device, rel):
    """z sliced out of the fused GDN projection [T, C + H*D + ...] is read where it lies."""
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_heads, dim = 6, 3, 16
    x = _randn(num_tokens, num_heads, dim, gen=gen).to(device)
    row = _randn(num_tokens, 40 + num_heads * dim + 5, gen=gen, scale=2).to(device)
    gate = row[:, 40 : 40 + num_heads * dim].view(num_tokens, num_heads, dim)
    assert not gate.is_contiguous()
    w = (1 + 0.1 * _randn(dim, gen=gen)).to(device)
    out = norms.gated_rms_norm(x, gate, w, EPS)
    assert torch.equal(out, norms.gated_rms_norm(x, gate.contiguous(), w, EPS))
    assert rel(out, naive.gated_rms_norm(x, gate, w, EPS)) < TOL[torch.float32]


def _gdn_inputs(num_tokens, device, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q = _randn(num_tokens, 2, 16, gen=gen).to(device)
    k = _randn(num_tokens, 2, 16, gen=gen).to(device)
    v = _randn(num_tokens, 4, 16, gen=gen).to(device)
    g = torch.nn.functional.logsigmoid(_randn(num_tokens, 4, gen=gen) + 2).to(device)
    beta = torch.rand(num_tokens, 4, generator=gen).to(device)
    state = _randn(4, 16, 16, gen=gen).to(device)
    return q, k, v, g, beta, state


RULES = {
    "chunk-triton": (gdn_chunk.chunk_gated_delta_rule, 70),
    "chunk-naive": (naive.chunk_gated_delta_rule, 70),
    "recurrent-triton": (gdn_recurrent.recurrent_gated_delta_rule, 1),
    "recurrent-naive": (naive.recurrent_gated_delta_rule, 1),
}


@pytest.mark.parametrize("rule,num_tokens", RULES.values(), ids=RULES.keys())
def test_gdn_state_in_place_same_bits(device, rule, num_tokens):
    """out_state=state writes the new state over the old one: the same bits as a fresh buffer, at the
    state's own address (what the cache and a CUDA graph hold)."""
    q, k, v, g, beta, state = _gdn_inputs(num_tokens, device)
    o_ref, s_ref = rule(q, k, v, g, beta, state.clone())
    target = state.clone()
    address = target.data_ptr()
    o, s = rule(q, k, v, g, beta, target, out_state=target)
    assert s is target and target.data_ptr() == address
    assert torch.equal(o, o_ref) and torch.equal(target, s_ref)


def test_gdn_out_state_must_be_fp32_contiguous(device):
    q, k, v, g, beta, state = _gdn_inputs(3, device)
    with pytest.raises(ValueError, match="out_state must be a contiguous float32"):
        gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state, out_state=torch.zeros(4, 16, 16, device=device).half())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sigmoid_gate_matches_twin(device, rel, dtype):
    gen = torch.Generator().manual_seed(6)
    x = _randn(5, 3, 24, gen=gen).to(device, dtype)
    qg = _randn(5, 3, 48, gen=gen, scale=3).to(device, dtype)
    gate = qg[..., 24:]  # the gate half of the fused q projection, as the attention layer slices it
    out = fused.sigmoid_gate(x, gate)
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == dtype
    assert rel(out, naive.sigmoid_gate(x, gate)) < TOL[dtype]


CONVS = {"triton": "conv1d", "naive": "naive"}


@pytest.mark.parametrize("num_tokens", [1, 2, 40], ids=["decode", "shorter-than-state", "prefill"])
@pytest.mark.parametrize("impl", CONVS.values(), ids=CONVS.keys())
def test_conv_state_in_place_same_bits(device, impl, num_tokens):
    from qse_kernels import conv1d

    conv = conv1d.causal_conv1d if impl == "conv1d" else naive.causal_conv1d
    gen = torch.Generator().manual_seed(7)
    x = _randn(num_tokens, 200, gen=gen).to(device)  # 200 channels: two channel blocks
    w = _randn(200, 4, gen=gen).to(device)
    state = _randn(3, 200, gen=gen).to(device)
    y_ref, s_ref = conv(x, w, state.clone())
    target = state.clone()
    y, s = conv(x, w, target, out_state=target)
    assert s is target and torch.equal(y, y_ref) and torch.equal(target, s_ref)


def _pool_and_table(num_pages, page_rows, num_kv, dim, dtype, device, seed):
    """k, v pools of 3 layer slots [P, slots, page_rows, Hkv, D] filled with noise (rows not written must keep
    their bits), and a shuffled page table."""
    gen = torch.Generator().manual_seed(seed)
    pools = [_randn(num_pages, 3, page_rows, num_kv, dim, gen=gen).to(device, dtype) for _ in range(2)]
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).to(device)
    return pools, table


PAGED_QK_CASES = {
    # T, start, page_rows, dtype: rows crossing a page line, one decode row, a partial rotary
    "chunk-across-pages-fp32": (20, 9, 16, torch.float32),
    "chunk-across-pages-bf16": (20, 9, 16, torch.bfloat16),
    "decode-bf16": (1, 31, 16, torch.bfloat16),
    "first-rows-fp32": (5, 0, 8, torch.float32),
}


@pytest.mark.parametrize("num_tokens,start,page_rows,dtype", PAGED_QK_CASES.values(), ids=PAGED_QK_CASES.keys())
def test_qk_norm_rotary_paged_writes_the_rows_of_the_unfused_path(device, rel, num_tokens, start, page_rows, dtype):
    """The fused store == qk_norm_rotary then the two scatters the attention layer did, bit for bit: the same
    q, the same k and v rows at the same places, every other row of the pool (other slots included) untouched;
    and close to the naive twin."""
    gen = torch.Generator().manual_seed(8)
    num_heads, num_kv, dim, rotary_dim = 4, 2, 32, 8
    qg = _randn(num_tokens, num_heads, 2 * dim, gen=gen, scale=2).to(device, dtype)
    kv = _randn(num_tokens, 3 * num_kv * dim, gen=gen, scale=2).to(device, dtype)
    q = qg[..., :dim]
    k = kv[:, num_kv * dim : 2 * num_kv * dim].view(num_tokens, num_kv, dim)
    v = kv[:, 2 * num_kv * dim :].view(num_tokens, num_kv, dim)
    wq = _randn(dim, gen=gen, scale=0.2).to(device, dtype)
    wk = _randn(dim, gen=gen, scale=0.2).to(device, dtype)
    cos, sin = naive.rotary_cos_sin(torch.arange(start, start + num_tokens), rotary_dim, 10000.0, dtype)
    cos, sin = cos.to(device), sin.to(device)
    (k_pool, v_pool), table = _pool_and_table(7, page_rows, num_kv, dim, dtype, device, seed=9)
    start_t = torch.tensor([start], dtype=torch.int32, device=device)

    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    ref_q, ref_k = fused.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    positions = torch.arange(start, start + num_tokens, device=device)
    page, row = table[positions // page_rows].long(), positions % page_rows
    ref_k_pool[:, 1][page, row] = ref_k
    ref_v_pool[:, 1][page, row] = v

    out_q = fused.qk_norm_rotary_paged(q, k, v, wq, wk, cos, sin, EPS, k_pool[:, 1], v_pool[:, 1], table, start_t)
    assert out_q.is_contiguous() and torch.equal(out_q, ref_q)
    assert torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)

    twin_k_pool, twin_v_pool = k_pool.clone(), v_pool.clone()
    twin_q = naive.qk_norm_rotary_paged(q, k, v, wq, wk, cos, sin, EPS, twin_k_pool[:, 1], twin_v_pool[:, 1], table,
                                        start_t)
    assert rel(out_q, twin_q) < TOL[dtype]
    assert rel(k_pool, twin_k_pool) < TOL[dtype] and torch.equal(v_pool, twin_v_pool)


def test_qk_norm_rotary_paged_rejects_pages_of_another_dtype(device):
    q, k = torch.zeros(2, 2, 8, device=device), torch.zeros(2, 1, 8, device=device)
    w, cos = torch.zeros(8, device=device), torch.zeros(2, 8, device=device)
    pages = torch.zeros(3, 4, 1, 8, device=device, dtype=torch.float16)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k, v pages must be"):
        fused.qk_norm_rotary_paged(q, k, k, w, w, cos, cos, EPS, pages, pages, torch.zeros(3, dtype=torch.int32,
                                   device=device), start)


@pytest.mark.gpu
def test_qk_norm_rotary_paged_model_shapes_gpu():
    """The 0.8B's attention shapes (8 heads, 2 KV heads, D 256, 64 rotary dims) on 512-row pages, a chunk
    crossing a page line: the same bits as qk_norm_rotary and the scatters."""
    gen = torch.Generator().manual_seed(10)
    num_tokens, start, page_rows, dtype = 512, 700, 512, torch.bfloat16
    q = _randn(num_tokens, 8, 256, gen=gen).to("cuda", dtype)
    k = _randn(num_tokens, 2, 256, gen=gen).to("cuda", dtype)
    v = _randn(num_tokens, 2, 256, gen=gen).to("cuda", dtype)
    wq, wk = (_randn(256, gen=gen, scale=0.2).to("cuda", dtype) for _ in range(2))
    cos, sin = (t.to("cuda") for t in naive.rotary_cos_sin(torch.arange(start, start + num_tokens), 64, 1e7, dtype))
    (k_pool, v_pool), table = _pool_and_table(5, page_rows, 2, 256, dtype, "cuda", seed=11)
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    ref_q, ref_k = fused.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS)
    positions = torch.arange(start, start + num_tokens, device="cuda")
    page, row = table[positions // page_rows].long(), positions % page_rows
    ref_k_pool[:, 1][page, row] = ref_k
    ref_v_pool[:, 1][page, row] = v
    start_t = torch.tensor([start], dtype=torch.int32, device="cuda")
    out_q = fused.qk_norm_rotary_paged(q, k, v, wq, wk, cos, sin, EPS, k_pool[:, 1], v_pool[:, 1], table, start_t)
    assert torch.equal(out_q, ref_q) and torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)
