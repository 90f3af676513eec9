"""The batched decode kernels (one launch for B sequences of one token each) against their naive twins, and
each row against the one-sequence kernel run on that sequence alone, bit for bit: a row of a round must not
depend on the other rows. Small shapes run interpreted on CPU; the gpu cases take the 9B's shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qse_kernels import attention, conv1d, fused, gdn_recurrent, naive

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# (H, Hkv, D, page_rows, positions): decode tiles (G <= 16); positions past a page line, and a split's
ATTENTION_CASES = {
    "gqa-3seq": (4, 2, 32, 64, [5, 130, 70]),
    "one-seq": (2, 1, 16, 64, [63]),
}


def _pages(num_pages, page_rows, num_kv, dim, dtype, device, gen):
    k = torch.randn(num_pages, page_rows, num_kv, dim, generator=gen).to(device, dtype)
    v = torch.randn(num_pages, page_rows, num_kv, dim, generator=gen).to(device, dtype)
    return k, v


def _tables(positions, page_rows, num_pages, gen, device):
    """Each sequence's pages: distinct page ids in a scrambled order, as many as its position needs."""
    width = max(p // page_rows + 1 for p in positions)
    order = torch.randperm(num_pages, generator=gen)
    rows = [order[i * width:(i + 1) * width] for i in range(len(positions))]
    return torch.stack(rows).to(device, torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("invariant", [False, True], ids=["tiles", "invariant"])
@pytest.mark.parametrize("heads,kv,dim,page_rows,positions", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_paged_decode_attention(device, rel, heads, kv, dim, page_rows, positions, invariant, dtype):
    gen = torch.Generator().manual_seed(3)
    num_rows = len(positions)
    tables = _tables(positions, page_rows, 3 * len(positions) + 1, gen, device)
    k_pages, v_pages = _pages(3 * len(positions) + 1, page_rows, kv, dim, dtype, device, gen)
    q = torch.randn(num_rows, heads, dim, generator=gen).to(device, dtype)
    gate = torch.randn(num_rows, heads, dim, generator=gen).to(device, dtype)
    pos = torch.tensor(positions, dtype=torch.int32, device=device)
    max_rows = page_rows * tables.shape[1]
    batched = attention.paged_decode_attention_invariant if invariant else attention.paged_decode_attention
    one = attention.paged_attention_invariant if invariant else attention.paged_attention
    # a small forced split size (a multiple of BN) makes the launch split, and combine, at these lengths
    kwargs = {} if invariant else {"rows_per_split": 64}
    out = batched(q, k_pages, v_pages, tables, pos, max_rows, gate=gate, **kwargs)
    ref = naive.paged_decode_attention(q, k_pages, v_pages, tables, pos, gate=gate)
    # on a GPU an fp32 tl.dot runs in tf32 (as tests/kernels/test_attention.py allows)
    tol = 3e-3 if (dtype == torch.float32 and device == "cuda") else TOL[dtype]
    assert out.shape == ref.shape and rel(out, ref) < tol
    for b in range(num_rows):
        alone = one(q[b:b + 1], k_pages, v_pages, tables[b], pos[b:b + 1], max_rows, gate=gate[b:b + 1], **kwargs)
        assert torch.equal(out[b:b + 1], alone)


def test_qk_norm_rotary_paged_rows(device, rel):
    gen = torch.Generator().manual_seed(4)
    num_rows, heads, kv, dim, rd, page_rows = 3, 4, 2, 32, 8, 16
    positions = [3, 17, 40]
    tables = _tables(positions, page_rows, 10, gen, device)
    q = torch.randn(num_rows, heads, dim, generator=gen).to(device)
    k = torch.randn(num_rows, kv, dim, generator=gen).to(device)
    v = torch.randn(num_rows, kv, dim, generator=gen).to(device)
    wq, wk = (torch.randn(dim, generator=gen).to(device) for _ in range(2))
    cos, sin = naive.rotary_cos_sin(torch.tensor(positions), rd, 1e7, torch.float32)
    cos, sin = cos.to(device), sin.to(device)
    pos = torch.tensor(positions, dtype=torch.int32, device=device)
    pages = {name: [torch.zeros(10, page_rows, kv, dim, device=device) for _ in range(2)] for name in ("rows", "naive", "one")}
    out = fused.qk_norm_rotary_paged_rows(q, k, v, wq, wk, cos, sin, 1e-6, *pages["rows"], tables, pos)
    ref = naive.qk_norm_rotary_paged_rows(q, k, v, wq, wk, cos, sin, 1e-6, *pages["naive"], tables, pos)
    assert rel(out, ref) < 1e-5
    assert all(rel(a, b) < 1e-5 for a, b in zip(pages["rows"], pages["naive"]))
    for b in range(num_rows):
        alone = fused.qk_norm_rotary_paged(q[b:b + 1], k[b:b + 1], v[b:b + 1], wq, wk, cos[b:b + 1], sin[b:b + 1], 1e-6,
                                           *pages["one"], tables[b], pos[b:b + 1])
        assert torch.equal(out[b:b + 1], alone)
    assert all(torch.equal(a, b) for a, b in zip(pages["rows"], pages["one"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_conv1d_slots(device, rel, dtype):
    gen = torch.Generator().manual_seed(5)
    num_rows, channels, width, num_slots = 3, 200, 4, 5
    x = torch.randn(num_rows, channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, width, generator=gen).to(device, dtype)
    states = torch.randn(num_slots, width - 1, channels, generator=gen).to(device, dtype)
    slots = torch.tensor([4, 0, 2], device=device)
    mine, theirs, one = states.clone(), states.clone(), states.clone()
    y = conv1d.causal_conv1d_slots(x, weight, mine, slots)
    ref = naive.causal_conv1d_slots(x, weight, theirs, slots)
    assert rel(y, ref) < TOL[dtype] and rel(mine, theirs) < TOL[dtype]
    assert torch.equal(mine[1], states[1]) and torch.equal(mine[3], states[3])  # slots no row names: untouched
    for b, slot in enumerate(slots.tolist()):
        alone, _ = conv1d.causal_conv1d(x[b:b + 1], weight, one[slot], out_state=one[slot])
        assert torch.equal(y[b:b + 1], alone)
    assert torch.equal(mine, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recurrent_gated_delta_rule_slots(device, rel, dtype):
    gen = torch.Generator().manual_seed(6)
    num_rows, num_k, num_v, dk, dv, num_slots = 3, 2, 4, 16, 32, 5
    q = torch.randn(num_rows, num_k, dk, generator=gen).to(device, dtype)
    k = torch.randn(num_rows, num_k, dk, generator=gen).to(device, dtype)
    v = torch.randn(num_rows, num_v, dv, generator=gen).to(device, dtype)
    a = torch.randn(num_rows, num_v, generator=gen).to(device, dtype)
    b_ = torch.randn(num_rows, num_v, generator=gen).to(device, dtype)
    a_log = torch.rand(num_v, generator=gen).to(device)
    dt_bias = torch.randn(num_v, generator=gen).to(device)
    states = torch.randn(num_slots, num_v, dk, dv, generator=gen).to(device)
    slots = torch.tensor([3, 1, 4], device=device)
    mine, theirs, one = states.clone(), states.clone(), states.clone()
    o = gdn_recurrent.recurrent_gated_delta_rule_slots(q, k, v, a, b_, a_log, dt_bias, mine, slots)
    ref = naive.recurrent_gated_delta_rule_slots(q, k, v, a, b_, a_log, dt_bias, theirs, slots)
    # (bf16 gates: the interpreter truncates the gate's casts where the twin rounds them)
    assert o.dtype == v.dtype and rel(o, ref) < TOL[dtype] and rel(mine, theirs) < TOL[dtype]
    assert torch.equal(mine[0], states[0]) and torch.equal(mine[2], states[2])
    for i, slot in enumerate(slots.tolist()):
        alone, _ = gdn_recurrent.recurrent_gated_delta_rule_from_gates(
            q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1], b_[i:i + 1], a_log, dt_bias, one[slot], out_state=one[slot])
        assert torch.equal(o[i:i + 1], alone)
    assert torch.equal(mine, one)


def test_batched_kernels_refuse_mismatched_tables(device):
    q = torch.zeros(2, 4, 32, device=device)
    pages = torch.zeros(4, 64, 2, 32, device=device)
    tables = torch.zeros(3, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"int32 \[2, pages\]"):
        attention.paged_decode_attention(q, pages, pages, tables, torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.gpu
def test_round_kernels_at_the_9b_shapes(rel):
    """B = 32 sequences of the 9B's attention and GDN shapes, each row the bits of its sequence alone."""
    device, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    num_rows, page_rows = 32, 512
    positions = [int(p) for p in torch.randint(0, 6000, (num_rows,), generator=gen)]
    tables = _tables(positions, page_rows, num_rows * 12 + 1, gen, device)
    k_pages, v_pages = _pages(num_rows * 12 + 1, page_rows, 4, 256, dtype, device, gen)
    q = torch.randn(num_rows, 16, 256, generator=gen).to(device, dtype)
    gate = torch.randn(num_rows, 16, 256, generator=gen).to(device, dtype)
    pos = torch.tensor(positions, dtype=torch.int32, device=device)
    max_rows = (num_rows * 12 + 1) * page_rows
    for batched, one in ((attention.paged_decode_attention, attention.paged_attention),
                         (attention.paged_decode_attention_invariant, attention.paged_attention_invariant)):
        out = batched(q, k_pages, v_pages, tables, pos, max_rows, gate=gate)
        for b in range(num_rows):
            assert torch.equal(out[b:b + 1], one(q[b:b + 1], k_pages, v_pages, tables[b], pos[b:b + 1], max_rows,
                                                 gate=gate[b:b + 1]))
    channels, slots = 8192, torch.randperm(num_rows + 1, generator=gen)[:num_rows].to(device)
    x = torch.randn(num_rows, channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, 4, generator=gen).to(device, dtype)
    conv_states = torch.randn(num_rows + 1, 3, channels, generator=gen).to(device, dtype)
    one_states = conv_states.clone()
    y = conv1d.causal_conv1d_slots(x, weight, conv_states, slots)
    for b, slot in enumerate(slots.tolist()):
        assert torch.equal(y[b:b + 1], conv1d.causal_conv1d(x[b:b + 1], weight, one_states[slot], out_state=one_states[slot])[0])
    assert torch.equal(conv_states, one_states)
    qk = F.normalize(torch.randn(num_rows, 2, 16, 128, generator=gen), dim=-1).to(device, dtype)
    v = torch.randn(num_rows, 32, 128, generator=gen).to(device, dtype)
    a, b_ = (torch.randn(num_rows, 32, generator=gen).to(device, dtype) for _ in range(2))
    a_log, dt_bias = torch.rand(32, generator=gen).to(device), torch.randn(32, generator=gen).to(device)
    states = torch.randn(num_rows + 1, 32, 128, 128, generator=gen).to(device)
    one_states = states.clone()
    o = gdn_recurrent.recurrent_gated_delta_rule_slots(qk[:, 0], qk[:, 1], v, a, b_, a_log, dt_bias, states, slots)
    for i, slot in enumerate(slots.tolist()):
        alone, _ = gdn_recurrent.recurrent_gated_delta_rule_from_gates(
            qk[i:i + 1, 0], qk[i:i + 1, 1], v[i:i + 1], a[i:i + 1], b_[i:i + 1], a_log, dt_bias, one_states[slot],
            out_state=one_states[slot])
        assert torch.equal(o[i:i + 1], alone)
    assert torch.equal(states, one_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_keep_their_bits_with_many_empty_splits(device, dtype):
    """A captured round launches the splits of the longest context the pool holds; a short row uses few of
    them, and the combine skips the blocks of splits it does not use. The bits must be those of a launch
    sized to the row (3 splits here, against 40: three blocks of 16 of which the short rows use one), and of
    the launch whose splits all have keys (the longest row)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv, dim, page_rows = 4, 2, 32, 64
    positions = [5, 130, 70]
    tables = _tables(positions + [40 * 64 - 1], page_rows, 160, gen, device)  # 40 pages a row
    k_pages, v_pages = _pages(160, page_rows, kv, dim, dtype, device, gen)
    q = torch.randn(len(positions), heads, dim, generator=gen).to(device, dtype)
    pos = torch.tensor(positions, dtype=torch.int32, device=device)
    wide = attention.paged_decode_attention(q, k_pages, v_pages, tables[:3], pos, 40 * 64, rows_per_split=64)
    for b in range(len(positions)):
        fitted = attention.paged_decode_attention(q[b:b + 1], k_pages, v_pages, tables[b:b + 1], pos[b:b + 1],
                                                  positions[b] + 1, rows_per_split=64)
        assert torch.equal(wide[b:b + 1], fitted), b
    ref = naive.paged_decode_attention(q, k_pages, v_pages, tables[:3], pos)
    assert (wide.float() - ref.float()).abs().max() < (3e-3 if dtype == torch.float32 else 2e-2) * 8
