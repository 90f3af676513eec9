"""The gated delta rule: chunk (prefill) and recurrent (decode) kernels against their naive twins, and the
entries that gate the raw projections themselves (*_from_gates) against the gating kernel then the rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qse_kernels import gdn_chunk, gdn_recurrent, naive, norms

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

CHUNK_CASES = {
    "one-chunk": (64, 1, 1, 16, 16, torch.float32),
    "gqa-tail-T130": (130, 2, 4, 32, 16, torch.float32),
    "short-T5": (5, 2, 2, 16, 32, torch.float32),
    "odd-dims": (70, 1, 2, 24, 20, torch.float32),
    "bf16-T100": (100, 2, 2, 32, 32, torch.bfloat16),
}


def _inputs(num_tokens, num_k, num_v, dk, dv, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_k, dk, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_k, dk, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, num_v, dv, generator=gen).to(device, dtype)
    g = F.logsigmoid(torch.randn(num_tokens, num_v, generator=gen) + 2).to(device)  # decays near 1, some strong
    beta = torch.rand(num_tokens, num_v, generator=gen).to(device)
    state = torch.randn(num_v, dk, dv, generator=gen).to(device)
    return q, k, v, g, beta, state


def _check(rel, out, ref, dtype):
    o, s = out
    ref_o, ref_s = ref
    assert o.dtype == ref_o.dtype and o.shape == ref_o.shape and s.dtype == torch.float32
    assert rel(o, ref_o) < TOL[dtype]
    assert rel(s, ref_s) < TOL[torch.float32]


@pytest.mark.parametrize("num_tokens,num_k,num_v,dk,dv,dtype", CHUNK_CASES.values(), ids=CHUNK_CASES.keys())
def test_chunk_matches_twin(device, rel, num_tokens, num_k, num_v, dk, dv, dtype):
    args = _inputs(num_tokens, num_k, num_v, dk, dv, dtype, device)
    _check(rel, gdn_chunk.chunk_gated_delta_rule(*args), naive.chunk_gated_delta_rule(*args), dtype)


def test_chunk_strong_correlation(device, rel):
    """Nearly parallel keys with beta near 1 make (I + A) far from I: the substitution must stay exact."""
    q, k, v, g, beta, state = _inputs(64, 1, 1, 16, 16, torch.float32, device, seed=5)
    k = k[:1].expand_as(k) + 0.05 * k
    beta = 0.9 + 0.1 * beta
    g = torch.zeros_like(g) - 1e-3
    args = (q, k, v, g, beta, state)
    _check(rel, gdn_chunk.chunk_gated_delta_rule(*args), naive.chunk_gated_delta_rule(*args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("correlated", [False, True], ids=["random", "correlated"])
@pytest.mark.parametrize("dv", [16, 32], ids=["dv16", "dv32"])  # Dv 16: Triton once miscompiled it on 8 warps
def test_chunk_16bit_rows_carry_an_fp32_state(device, rel, dtype, correlated, dv):
    """16-bit q, k, v go through exact 16-bit row products and two tf32 products against the rows as
    stored: the carried state must keep fp32 accuracy against the float64 twin of the same values, also
    with nearly parallel keys (beta near 1: (I + A) far from I). Two chunks: the state crosses a chunk line."""
    q, k, v, g, beta, state = _inputs(128, 1, 2, 32, dv, dtype, device, seed=11)
    if correlated:
        k = (k[:1].float().expand_as(k) + 0.05 * k.float()).to(dtype)
        beta = 0.9 + 0.1 * beta
    _, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state)
    _, ref_s = naive.chunk_gated_delta_rule(*(t.double() for t in (q, k, v, g, beta, state)))
    assert rel(s.double(), ref_s) < 1e-5


def test_chunk_strided_views_like_the_model(device, rel):
    """q, k, v reshaped out of one conv output [T, C]; the state taken from a larger cache."""
    num_tokens, num_k, num_v, dk, dv = 40, 2, 4, 16, 16
    kd = num_k * dk
    qkv = torch.randn(num_tokens, 2 * kd + num_v * dv, device=device)
    q = qkv[:, :kd].reshape(num_tokens, num_k, dk)
    k = qkv[:, kd:2 * kd].reshape(num_tokens, num_k, dk)
    v = qkv[:, 2 * kd:].reshape(num_tokens, num_v, dv)
    _, _, _, g, beta, _ = _inputs(num_tokens, num_k, num_v, dk, dv, torch.float32, device)
    cache = torch.randn(3, num_v, dk, dv, device=device)
    args = (q, k, v, g, beta, cache[1])
    _check(rel, gdn_chunk.chunk_gated_delta_rule(*args), naive.chunk_gated_delta_rule(*args), torch.float32)
    _check(rel, gdn_recurrent.recurrent_gated_delta_rule(*args), naive.recurrent_gated_delta_rule(*args), torch.float32)


def test_chunk_split_on_chunk_lines_is_bitwise(device):
    """256 tokens in one call == 4 calls of 64 with the fp32 state carried: the same bits."""
    q, k, v, g, beta, state = _inputs(256, 1, 2, 16, 16, torch.float32, device, seed=1)
    o_whole, s_whole = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state)
    parts, s = [], state
    for start in range(0, 256, 64):
        sl = slice(start, start + 64)
        o, s = gdn_chunk.chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s)
        parts.append(o)
    assert torch.equal(torch.cat(parts), o_whole)
    assert torch.equal(s, s_whole)


@pytest.mark.parametrize("first", [37, 64, 100], ids=["37+93", "64+66", "100+30"])
def test_chunk_carried_state(device, rel, first):
    q, k, v, g, beta, state = _inputs(130, 2, 2, 16, 16, torch.float32, device, seed=2)
    o_whole, s_whole = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state)
    a, b = slice(0, first), slice(first, 130)
    o1, s1 = gdn_chunk.chunk_gated_delta_rule(q[a], k[a], v[a], g[a], beta[a], state)
    o2, s2 = gdn_chunk.chunk_gated_delta_rule(q[b], k[b], v[b], g[b], beta[b], s1)
    assert rel(torch.cat((o1, o2)), o_whole) < TOL[torch.float32]
    assert rel(s2, s_whole) < TOL[torch.float32]


def test_chunk_deterministic(device):
    args = _inputs(130, 1, 2, 32, 16, torch.bfloat16, device, seed=3)
    o1, s1 = gdn_chunk.chunk_gated_delta_rule(*args)
    o2, s2 = gdn_chunk.chunk_gated_delta_rule(*args)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


RECURRENT_CASES = {
    "decode-T1": (1, 2, 2, 32, 32, torch.float32),
    "decode-gqa-T1": (1, 1, 4, 16, 16, torch.float32),
    "steps-T3-odd-dims": (3, 2, 4, 24, 40, torch.float32),
    "decode-bf16": (1, 2, 4, 32, 16, torch.bfloat16),
}


@pytest.mark.parametrize("num_tokens,num_k,num_v,dk,dv,dtype", RECURRENT_CASES.values(), ids=RECURRENT_CASES.keys())
def test_recurrent_matches_twin(device, rel, num_tokens, num_k, num_v, dk, dv, dtype):
    args = _inputs(num_tokens, num_k, num_v, dk, dv, dtype, device)
    _check(rel, gdn_recurrent.recurrent_gated_delta_rule(*args), naive.recurrent_gated_delta_rule(*args), dtype)


def test_decode_after_prefill_matches_one_prefill(device, rel):
    """chunk over 70 tokens, then 3 recurrent steps, == the chunk twin over all 73."""
    q, k, v, g, beta, state = _inputs(73, 2, 4, 16, 16, torch.float32, device, seed=4)
    a = slice(0, 70)
    outs = []
    o, s = gdn_chunk.chunk_gated_delta_rule(q[a], k[a], v[a], g[a], beta[a], state)
    outs.append(o)
    for t in range(70, 73):
        b = slice(t, t + 1)
        o, s = gdn_recurrent.recurrent_gated_delta_rule(q[b], k[b], v[b], g[b], beta[b], s)
        outs.append(o)
    ref_o, ref_s = naive.chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert rel(torch.cat(outs), ref_o) < TOL[torch.float32]
    assert rel(s, ref_s) < TOL[torch.float32]


def test_recurrent_deterministic(device):
    args = _inputs(1, 2, 4, 32, 32, torch.bfloat16, device, seed=6)
    o1, s1 = gdn_recurrent.recurrent_gated_delta_rule(*args)
    o2, s2 = gdn_recurrent.recurrent_gated_delta_rule(*args)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def _gates(num_tokens, num_v, dtype, device, seed=0):
    """a, b [T, Hv] sliced out of one wider projection row (strided, as the model's fused in_proj gives them),
    with a reaching softplus's x > 20 branch and its tiny end; A_log and dt_bias [Hv] fp32."""
    gen = torch.Generator().manual_seed(100 + seed)
    row = (torch.randn(num_tokens, 3 + 2 * num_v, generator=gen) * 3).to(device, dtype)
    b, a = row[:, 3 : 3 + num_v], row[:, 3 + num_v :]
    a[0, 0], a[-1, -1] = 30.0, -40.0
    a_log = torch.rand(num_v, generator=gen).mul(3).to(device)
    dt_bias = torch.randn(num_v, generator=gen).to(device)
    return a, b, a_log, dt_bias


def _same(out, ref, exact: bool, rel):
    """Interpreted: the same bits. Compiled: g may be contracted into the cumsum's first add (gdn_chunk's
    docstring), so the two agree to the rounding of g."""
    (o, s), (ref_o, ref_s) = out, ref
    if exact:
        assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    else:
        assert rel(o, ref_o) < (1e-5 if o.dtype == torch.float32 else 1e-2) and rel(s, ref_s) < 1e-5


# (entry, rule, T, GATE_IN_PREPARE): the chunk entry both ways it gates (in the prepare kernel, or the gating
# kernel before it: the default); the recurrent entry does not read the flag
FROM_GATES = {
    f"{how}-chunk-T{t}": (gdn_chunk.chunk_gated_delta_rule_from_gates, gdn_chunk.chunk_gated_delta_rule, t, flag)
    for how, flag in (("gate-in-prepare", True), ("gating-kernel", False)) for t in (70, 5)
} | {
    f"recurrent-T{t}": (gdn_recurrent.recurrent_gated_delta_rule_from_gates, gdn_recurrent.recurrent_gated_delta_rule,
                        t, False)
    for t in (1, 3)
}


@pytest.fixture(params=[True, False], ids=["gate-in-prepare", "gating-kernel"])
def gate_in_prepare(request, monkeypatch):
    """Both ways the chunk entry gates: in the prepare kernel, or the gating kernel before it (the default)."""
    monkeypatch.setattr(gdn_chunk, "GATE_IN_PREPARE", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused,rule,num_tokens,in_prepare", FROM_GATES.values(), ids=FROM_GATES.keys())
def test_from_gates_is_gating_then_rule(device, rel, fused, rule, num_tokens, in_prepare, dtype, monkeypatch):
    """The rule gating a, b in its own kernel == the gating kernel, then the rule on g, beta (a partial
    last chunk included: its padded tokens must stay ungated zeros); and close to the naive twin."""
    monkeypatch.setattr(gdn_chunk, "GATE_IN_PREPARE", in_prepare)
    q, k, v, _, _, state = _inputs(num_tokens, 1, 2, 16, 16, dtype, device, seed=8)
    gates = _gates(num_tokens, 2, dtype, device)
    out = fused(q, k, v, *gates, state)
    _same(out, rule(q, k, v, *norms.gdn_gating(*gates), state), device == "cpu", rel)
    twin = naive.chunk_gated_delta_rule_from_gates if num_tokens > 3 else naive.recurrent_gated_delta_rule_from_gates
    ref_o, ref_s = twin(q, k, v, *gates, state)
    # beta is rounded through b's dtype: a bf16 beta may sit one ulp off the twin's (the interpreter's casts
    # truncate), and the state moves with it
    assert rel(out[0], ref_o) < TOL[dtype] and rel(out[1], ref_s) < TOL[dtype]


def test_chunk_from_gates_split_on_chunk_lines_is_bitwise(device, gate_in_prepare):
    """The gated entry keeps the chunk rule's contract: one call == calls split on chunk lines, bit for bit."""
    q, k, v, _, _, state = _inputs(192, 1, 2, 16, 16, torch.bfloat16, device, seed=9)
    a, b, a_log, dt_bias = _gates(192, 2, torch.bfloat16, device, seed=1)
    o_whole, s_whole = gdn_chunk.chunk_gated_delta_rule_from_gates(q, k, v, a, b, a_log, dt_bias, state)
    parts, s = [], state
    for start in range(0, 192, 64):
        sl = slice(start, start + 64)
        o, s = gdn_chunk.chunk_gated_delta_rule_from_gates(q[sl], k[sl], v[sl], a[sl], b[sl], a_log, dt_bias, s)
        parts.append(o)
    assert torch.equal(torch.cat(parts), o_whole) and torch.equal(s, s_whole)


@pytest.mark.parametrize("rule", [gdn_chunk.chunk_gated_delta_rule_from_gates,
                                  gdn_recurrent.recurrent_gated_delta_rule_from_gates], ids=["chunk", "recurrent"])
def test_from_gates_rejects_bad_gate_shapes(device, rule):
    q, k, v, _, _, state = _inputs(3, 2, 4, 16, 16, torch.float32, device)
    a, b, a_log, dt_bias = _gates(3, 4, torch.float32, device)
    with pytest.raises(ValueError, match=r"a_log and dt_bias must be \[Hv\] = \[4\]"):
        rule(q, k, v, a, b, a_log[:3], dt_bias, state)
    with pytest.raises(ValueError, match=r"a and b must be \[T, Hv\]"):
        rule(q, k, v, a[:, :3], b, a_log, dt_bias, state)


@pytest.mark.gpu
@pytest.mark.parametrize("num_k,num_v", [(16, 16), (16, 48)], ids=["0.8B", "27B"])
def test_gdn_model_shapes_gpu(rel, num_k, num_v):
    q, k, v, g, beta, state = _inputs(512, num_k, num_v, 128, 128, torch.bfloat16, "cuda", seed=7)
    ref_o, ref_s = naive.chunk_gated_delta_rule(q, k, v, g, beta, state)
    o, s = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert rel(o, ref_o) < 1e-2 and rel(s, ref_s) < 1e-3
    parts, s8 = [], state
    for start in range(0, 512, 64):
        sl = slice(start, start + 64)
        o8, s8 = gdn_chunk.chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s8)
        parts.append(o8)
    assert torch.equal(torch.cat(parts), o) and torch.equal(s8, s)
    o2, s2 = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(o2, o) and torch.equal(s2, s)
    one = slice(0, 1)
    ro, rs = gdn_recurrent.recurrent_gated_delta_rule(q[one], k[one], v[one], g[one], beta[one], state)
    nro, nrs = naive.recurrent_gated_delta_rule(q[one], k[one], v[one], g[one], beta[one], state)
    assert rel(ro, nro) < 1e-2 and rel(rs, nrs) < 1e-4


@pytest.mark.gpu
def test_gdn_from_gates_model_shapes_gpu(rel, gate_in_prepare):
    """The 0.8B's shapes compiled: the gated entries against gating then the rule (to g's rounding), and
    the chunk entry split on chunk lines bit for bit."""
    q, k, v, _, _, state = _inputs(512, 16, 16, 128, 128, torch.bfloat16, "cuda", seed=10)
    gates = _gates(512, 16, torch.bfloat16, "cuda", seed=2)
    g, beta = norms.gdn_gating(*gates)
    whole = gdn_chunk.chunk_gated_delta_rule_from_gates(q, k, v, *gates, state)
    _same(whole, gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state), False, rel)
    parts, s = [], state
    for start in range(0, 512, 64):
        sl = slice(start, start + 64)
        o, s = gdn_chunk.chunk_gated_delta_rule_from_gates(q[sl], k[sl], v[sl], *(x[sl] for x in gates[:2]), *gates[2:], s)
        parts.append(o)
    assert torch.equal(torch.cat(parts), whole[0]) and torch.equal(s, whole[1])
    one = slice(0, 1)
    step = gdn_recurrent.recurrent_gated_delta_rule_from_gates(q[one], k[one], v[one], *(x[one] for x in gates[:2]),
                                                               *gates[2:], state)
    _same(step, gdn_recurrent.recurrent_gated_delta_rule(q[one], k[one], v[one], g[one], beta[one], state), False, rel)


@pytest.mark.parametrize("num_tokens", [5, 64, 70], ids=lambda t: f"T{t}")
def test_chunk_rows_padded_neutral_are_inert(device, gate_in_prepare, num_tokens):
    """A tail read in a graph of more rows (qse/models/qwen3_5/model.py `_neutral_padding`): rows past the
    real ones with q, k, v zero and a raw decay gate that gates to decay 1 (their write strength is whatever
    b gives: with k and v zero it writes nothing) leave the real rows' outputs and the state after them as a
    call on the real rows alone gives them, bit for bit."""
    from qse.models.qwen3_5.model import _PAD_GATE

    rows = 128
    q, k, v, _, _, state = _inputs(rows, 1, 2, 16, 16, torch.bfloat16, device, seed=11)
    a, b, a_log, dt_bias = _gates(rows, 2, torch.bfloat16, device, seed=3)
    want_o, want_s = gdn_chunk.chunk_gated_delta_rule_from_gates(q[:num_tokens], k[:num_tokens], v[:num_tokens],
                                                                  a[:num_tokens], b[:num_tokens], a_log, dt_bias, state)
    pad = slice(num_tokens, rows)
    for x in (q, k, v):
        x[pad] = 0.0
    a[pad] = _PAD_GATE
    got_o, got_s = gdn_chunk.chunk_gated_delta_rule_from_gates(q, k, v, a, b, a_log, dt_bias, state)
    assert torch.equal(got_o[:num_tokens], want_o) and torch.equal(got_s, want_s)
    assert not got_o[pad].any()  # (q is zero there)
