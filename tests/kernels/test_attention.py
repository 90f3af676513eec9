"""Causal GQA attention against its twin: prefill chunks, decode with split-K, the combine pass, the output gate
in either epilogue."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import attention, fused, naive

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


# Few queries (the combine runs a program a query and head: under the interpreter its cost), each case still
# on the chunk tiles (queries x group > 16): rows64: four splits, the causal edge in the last; rows128: two
# query tiles (33 x 4 = 132 rows of a 128-row tile, a partial tail) and a split of two key blocks, the
# second one masked; one-split: no combine.
SPLIT_CASES = {"rows64": (12, 200, 64, 4, 2), "rows128": (33, 200, 128, 4, 1), "one-split": (40, 20, 64, 4, 2)}


@pytest.mark.parametrize("num_q,q_start,rows,num_heads,num_kv", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_prefill_forced_splits(device, rel, num_q, q_start, rows, num_heads, num_kv):
    q, k, v = _inputs(num_q, num_heads, num_kv, 16, q_start, torch.float32, device, seed=1)
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


# ---- the paged form (what the model runs on a paged KV and what a CUDA graph captures) ------------
def _paged_copy(k, v, page_rows, num_pages, seed=5):
    """k, v [L, Hkv, D] scattered over pages of a bigger pool in a shuffled order; returns the pools and table."""
    num_rows = k.shape[0]
    used = -(-num_rows // page_rows)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[:used]
    k_pool = torch.randn(num_pages, page_rows, *k.shape[1:], dtype=k.dtype).to(k.device)  # garbage elsewhere
    v_pool = torch.randn(num_pages, page_rows, *v.shape[1:], dtype=v.dtype).to(v.device)
    for i, page in enumerate(order.tolist()):
        rows = slice(i * page_rows, min((i + 1) * page_rows, num_rows))
        k_pool[page, : rows.stop - rows.start] = k[rows]
        v_pool[page, : rows.stop - rows.start] = v[rows]
    return k_pool, v_pool, order.to(torch.int32).to(k.device)


PAGED_CASES = {"chunk": (40, 150, 64), "decode": (1, 299, 64), "first-page": (20, 0, 128)}


@pytest.mark.parametrize("num_q,q_start,page_rows", PAGED_CASES.values(), ids=PAGED_CASES.keys())
def test_paged_equals_contiguous_bit_for_bit(device, num_q, q_start, page_rows):
    """Shuffled pages, the start read from device memory: the same bits as the contiguous kernel."""
    q, k, v = _inputs(num_q, 4, 2, 16, q_start, torch.float32, device, seed=6)
    k_pool, v_pool, table = _paged_copy(k, v, page_rows, 9)
    start = torch.tensor([q_start], dtype=torch.int32, device=device)
    out = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
    assert torch.equal(out, attention.attention(q, k, v, q_start))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_through_tma_descriptors(device, rel, monkeypatch, dtype):
    """TMA_LOADS: a chunk's unmasked K/V tiles come through TMA descriptors of the shuffled pages, the
    masked edge through masked loads; the result matches the twin and repeats bit for bit. A decode
    launch (no descriptors) is unchanged."""
    monkeypatch.setattr(attention, "TMA_LOADS", True)
    num_q, q_start, page_rows = 40, 150, 64
    q, k, v = _inputs(num_q, 4, 2, 32, q_start, dtype, device, seed=9)
    k_pool, v_pool, table = _paged_copy(k, v, page_rows, 9)
    for pool in (k_pool, v_pool):  # rows past the sequence: a tile fetched whole there would give NaN
        pool[table.long()[-1], (q_start + num_q) % page_rows:] = float("nan")
    start = torch.tensor([q_start], dtype=torch.int32, device=device)
    assert attention._page_descriptors(k_pool, v_pool, 64) is not None
    out = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
    assert rel(out, naive.attention(q, k, v, q_start)) < _tol(dtype, device)
    again = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
    assert torch.equal(out, again)
    step = attention.paged_attention(q[-1:], k_pool, v_pool, table, start + num_q - 1, max_rows=q_start + num_q)
    monkeypatch.setattr(attention, "TMA_LOADS", False)
    assert torch.equal(step, attention.paged_attention(q[-1:], k_pool, v_pool, table, start + num_q - 1,
                                                       max_rows=q_start + num_q))
    # a layout TMA cannot take (a row's heads apart) has no descriptors and runs on the loads
    monkeypatch.setattr(attention, "TMA_LOADS", True)
    k_apart = k_pool.transpose(1, 2).contiguous().transpose(1, 2)
    v_apart = v_pool.transpose(1, 2).contiguous().transpose(1, 2)
    assert attention._page_descriptors(k_apart, v_apart, 64) is None
    apart = attention.paged_attention(q, k_apart, v_apart, table, start, max_rows=q_start + num_q)
    monkeypatch.setattr(attention, "TMA_LOADS", False)
    assert torch.equal(apart, attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q))


@pytest.mark.gpu
@pytest.mark.parametrize("num_q,q_start", [(512, 4096), (320, 2000)], ids=["chunk-L4608", "question-L2320"])
def test_tma_attention_model_shapes_gpu(rel, monkeypatch, num_q, q_start):
    """The TMA path at the 0.8B's attention shape on 512-row pages (what the graph runs when TMA_LOADS is on)."""
    monkeypatch.setattr(attention, "TMA_LOADS", True)
    q, k, v = _inputs(num_q, 8, 2, 256, q_start, torch.bfloat16, "cuda", seed=12)
    k_pool, v_pool, table = _paged_copy(k, v, 512, -(-(q_start + num_q) // 512) + 3)
    start = torch.tensor([q_start], dtype=torch.int32, device="cuda")
    assert attention._page_descriptors(k_pool, v_pool, 64) is not None
    out = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
    assert rel(out, naive.attention(q, k, v, q_start)) < 1e-2
    assert torch.equal(out, attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q))


def test_launching_every_split_gives_the_same_bits(device, monkeypatch):
    """A captured graph launches max_splits whatever the context; the splits past the rows add exact zeros.
    (A target of 40 programs instead of 264: every split program runs in the interpreter; 40 splits still
    take the combine through three blocks of splits, the last one partial.)"""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 40)
    assert attention.max_splits(1, 4, 1, 32) == 40 and 40 % attention.COMBINE_BLOCK_SPLITS
    num_q, q_start = 1, 299
    q, k, v = _inputs(num_q, 4, 1, 32, q_start, torch.float32, device, seed=7)
    needed = attention.attention(q, k, v, q_start)
    every = attention.attention_split(q, k, v, q_start, None, 0, num_splits=attention.max_splits(num_q, 4, 1, 32))
    assert attention.max_splits(num_q, 4, 1, 32) > 2  # the case does launch empty splits
    assert torch.equal(every, needed)
    pad = torch.zeros(320 - k.shape[0], *k.shape[1:], device=device)
    one_page = attention.paged_attention(q, torch.cat((k, pad))[None], torch.cat((v, pad))[None],
                                         torch.zeros(1, dtype=torch.int32, device=device),
                                         torch.tensor([q_start], dtype=torch.int32, device=device))
    assert torch.equal(one_page, needed)


def test_paged_rejects_bad_tables(device):
    q, k, v = _inputs(4, 2, 1, 16, 0, torch.float32, device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int32"):
        attention.paged_attention(q, k[None], v[None], torch.zeros(1, dtype=torch.long, device=device), start)
    with pytest.raises(ValueError, match="multiple of 64"):
        attention.paged_attention(q, k[:3][None], v[:3][None], torch.zeros(1, dtype=torch.int32, device=device), start)


def test_invariant_attention_rows_do_not_depend_on_the_call(device, rel, monkeypatch):
    """One tile shape and constant splits: a query row's bits are the same in a call of 2, 6 or 66 queries
    (two query tiles, the second partial), contiguous or paged, four splits deep, for calls that start on a
    tile line (BM / G = 64 queries here; grid chunks and forks start on grid lines). (Under the interpreter
    a tile's products go through numpy, which also rounds by a row's place inside the tile: hence the
    aligned starts. The combine runs a program a query and head: hence few queries.)"""
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_ROWS", 64)
    q_start, num_q = 150, 66
    q, k, v = _inputs(num_q, 2, 1, 16, q_start, torch.float32, device, seed=8)
    whole = attention.attention_invariant(q, k, v, q_start)
    for lo, hi in ((0, 2), (0, 6), (64, 66)):
        part = attention.attention_invariant(q[lo:hi], k[: q_start + hi], v[: q_start + hi], q_start + lo)
        assert torch.equal(part, whole[lo:hi]), (lo, hi)
    k_pool, v_pool, table = _paged_copy(k, v, 64, 5)
    start = torch.tensor([q_start + 64], dtype=torch.int32, device=device)  # the last queries, over every page
    paged = attention.paged_attention_invariant(q[64:], k_pool, v_pool, table, start, max_rows=5 * 64)
    assert torch.equal(paged, whole[64:])
    assert rel(whole, naive.attention(q, k, v, q_start)) < _tol(torch.float32, device)


def test_a_forced_split_size_needs_a_bound(device):
    q, _, _ = _inputs(4, 2, 1, 16, 0, torch.float32, device)
    page = torch.zeros(1, 64, 1, 16, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_rows"):
        attention.paged_attention(q, page, page, torch.zeros(1, dtype=torch.int32, device=device), start,
                                  rows_per_split=64)


@pytest.mark.parametrize("num_q,num_heads,num_kv,head_dim", [(1, 8, 2, 256), (320, 8, 2, 256), (512, 8, 2, 256),
                                                             (512, 16, 4, 256), (4096, 32, 8, 128)])
def test_a_launch_never_exceeds_the_target_programs(num_q, num_heads, num_kv, head_dim):
    """Splits round down: a launch of max_splits fills at most its target (decode: TARGET_PROGRAMS, two waves
    of the H200's SMs; chunks and questions: PREFILL_TARGET_PROGRAMS, one wave at one program an SM), never
    a further wave of a few programs."""
    cfg = attention._config(num_q, num_heads // num_kv, head_dim)
    target = attention.TARGET_PROGRAMS if num_q * (num_heads // num_kv) <= 16 else attention.PREFILL_TARGET_PROGRAMS
    assert cfg["TARGET"] == target
    base = -(-num_q * (num_heads // num_kv) // cfg["BM"]) * num_kv
    splits = attention.max_splits(num_q, num_heads, num_kv, head_dim)
    assert splits >= 1
    assert base * splits <= max(target, base)
    assert base * (splits + 1) > target  # and no fewer than fit


# ---- the output gate in the epilogue (what the model runs on a paged KV) ---------------------------------
GATE_CASES = {
    # T, H, Hkv, D, q_start, forced rows a split (0: the launch's own), dtype
    "chunk-one-split-fp32": (40, 4, 2, 32, 150, 0, torch.float32),
    "chunk-one-split-bf16": (40, 4, 2, 32, 150, 0, torch.bfloat16),
    "chunk-splits-bf16": (9, 4, 2, 32, 150, 64, torch.bfloat16),  # few queries: a combine program each
    "decode-splits-bf16": (1, 8, 2, 32, 280, 0, torch.bfloat16),
    "decode-splits-fp32": (1, 4, 1, 32, 299, 0, torch.float32),
}


@pytest.mark.parametrize("num_q,num_heads,num_kv,head_dim,q_start,rows,dtype", GATE_CASES.values(), ids=GATE_CASES.keys())
def test_gate_in_the_epilogue_is_sigmoid_gate_after(device, rel, num_q, num_heads, num_kv, head_dim, q_start, rows, dtype):
    """gate= in the attention kernel's epilogue (one split) or the combine's (several): the bits of
    fused.sigmoid_gate applied to the ungated output, with the gate a strided half of the fused q projection."""
    q, k, v = _inputs(num_q, num_heads, num_kv, head_dim, q_start, dtype, device, seed=13)
    gate = (torch.randn(num_q, num_heads, 2 * head_dim, generator=torch.Generator().manual_seed(14)) * 3).to(device, dtype)
    gate = gate[..., head_dim:]
    k_pool, v_pool, table = _paged_copy(k, v, 64, 9)
    start = torch.tensor([q_start], dtype=torch.int32, device=device)
    max_rows = q_start + num_q
    splits = attention.splits_for(num_q, num_heads, num_kv, head_dim, max_rows, rows)
    assert (splits > 1) == (rows > 0 or num_q == 1)  # the cases cover both epilogues
    plain = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=max_rows, rows_per_split=rows)
    gated = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=max_rows, rows_per_split=rows, gate=gate)
    assert torch.equal(gated, fused.sigmoid_gate(plain, gate))
    twin = naive.paged_attention(q, k_pool, v_pool, table, start, gate=gate)
    assert torch.equal(twin, naive.sigmoid_gate(naive.paged_attention(q, k_pool, v_pool, table, start), gate))
    assert rel(gated, twin) < _tol(dtype, device)


def test_invariant_attention_gate_is_sigmoid_gate_after(device, monkeypatch):
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_ROWS", 64)
    q, k, v = _inputs(6, 4, 2, 16, 150, torch.bfloat16, device, seed=15)  # few queries: a combine program each
    gate = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(16)).to(device, torch.bfloat16)
    k_pool, v_pool, table = _paged_copy(k, v, 64, 7)
    start = torch.tensor([150], dtype=torch.int32, device=device)
    plain = attention.paged_attention_invariant(q, k_pool, v_pool, table, start, max_rows=7 * 64)
    gated = attention.paged_attention_invariant(q, k_pool, v_pool, table, start, max_rows=7 * 64, gate=gate)
    assert torch.equal(gated, fused.sigmoid_gate(plain, gate))


def test_gate_must_match_q(device):
    q, k, v = _inputs(4, 2, 1, 16, 0, torch.float32, device)
    k_pool, v_pool, table = _paged_copy(k, v, 64, 2)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="gate must match q"):
        attention.paged_attention(q, k_pool, v_pool, table, start, gate=q[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
@pytest.mark.parametrize("num_q,q_start", [(512, 1536), (512, 0), (320, 2000), (1, 5000)],
                         ids=["chunk-L2048", "chunk-L512", "question-L2320", "decode-L5001"])
def test_gate_in_the_epilogue_model_shapes_gpu(monkeypatch, num_q, q_start, tma):
    """The 0.8B's attention shape on 512-row pages, compiled: the gate in the epilogue has the bits of
    sigmoid_gate after, on one split and on several."""
    monkeypatch.setattr(attention, "TMA_LOADS", tma)
    q, k, v = _inputs(num_q, 8, 2, 256, q_start, torch.bfloat16, "cuda", seed=17)
    gate = (torch.randn(num_q, 8, 512, device="cuda") * 3).to(torch.bfloat16)[..., 256:]
    k_pool, v_pool, table = _paged_copy(k, v, 512, -(-(q_start + num_q) // 512) + 3)
    start = torch.tensor([q_start], dtype=torch.int32, device="cuda")
    plain = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
    gated = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q, gate=gate)
    assert torch.equal(gated, fused.sigmoid_gate(plain, gate))


# Each flag's branches are independent of the others' (_attn_update): "all" takes every one, the default flags
# (every other test) the other side, and the lazy rescale, the one that changes the arithmetic's order,
# runs alone too.
FLAG_SETS = {
    "lazy8": dict(LAZY_RESCALE_LOG2=8),
    "all": dict(LAZY_RESCALE_LOG2=8, FUSED_SCALE=True, WARP_SPECIALIZE=True),
}


@pytest.mark.parametrize("flags", FLAG_SETS.values(), ids=FLAG_SETS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softmax_variants_match_twin(device, rel, monkeypatch, flags, dtype):
    """The candidate softmax forms (lazy rescale, the scale inside the exponent, warp specialisation) on the
    TMA path and on the loads, with keys whose scores jump by ~2^12 and ~2^3 in later blocks (the lazy
    reference must move for the first and may stay for the second), and on several splits: each matches
    the twin and repeats bit for bit."""
    for name, value in flags.items():
        monkeypatch.setattr(attention, name, value)
    num_q, q_start, page_rows = 9, 230, 64  # 18 rows of a group: still the chunk tiles, few combine programs
    q, k, v = _inputs(num_q, 4, 2, 32, q_start, dtype, device, seed=21)
    k = k.clone()
    k[100:110] = k[100:110] * 6.0  # scores ~36x larger than the first blocks' (2^12 in the log2 domain)
    k[200:205] = k[200:205] * 1.5
    k_pool, v_pool, table = _paged_copy(k, v, page_rows, 9)
    start = torch.tensor([q_start], dtype=torch.int32, device=device)
    want = naive.attention(q, k, v, q_start)
    for tma in (True, False):
        monkeypatch.setattr(attention, "TMA_LOADS", tma)
        out = attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q)
        assert rel(out, want) < _tol(dtype, device)
        assert torch.equal(out, attention.paged_attention(q, k_pool, v_pool, table, start, max_rows=q_start + num_q))
    split = attention.attention_split(q, k, v, q_start, None, 64)
    assert rel(split, want) < _tol(dtype, device)
    step = attention.attention(q[-1:], k, v, q_start + num_q - 1)
    assert rel(step, naive.attention(q[-1:], k, v, q_start + num_q - 1)) < _tol(dtype, device)
