"""Qwen3.5-MoE's sparse block: the naive twin against transformers, the Triton kernels against the twin, the
tie rule, and the property the kernels exist for: a row's bits never depend on the rows that come with it."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import moe_naive

try:
    from qse_kernels import moe
except ModuleNotFoundError:  # no Triton: the twin's own tests still run
    moe = None

needs_triton = pytest.mark.skipif(moe is None, reason="needs Triton")

H, E, I, I_SHARED = 64, 8, 32, 48  # shapes the interpreter runs in well under a second a block


def _weights(top_k_seed: int = 0, *, num_experts: int = E, dtype=torch.float32, device="cpu", inter_s=I_SHARED):
    gen = torch.Generator().manual_seed(top_k_seed)

    def draw(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) * fan_in ** -0.5).to(device, dtype)

    return dict(router_w=draw(num_experts, H, fan_in=H) * 4,  # logits of a few units: routing far from uniform
                gate_up=draw(num_experts, 2 * I, H, fan_in=H), down=draw(num_experts, H, I, fan_in=I),
                shared_gate_up=draw(2 * inter_s, H, fan_in=H), shared_down=draw(H, inter_s, fan_in=inter_s),
                shared_gate_w=draw(1, H, fan_in=H))


def _tokens(num_tokens: int, weights: dict, top_k: int, *, seed: int = 1, margin: float = 0.0):
    """x [T, H]; with a margin, only tokens whose k-th and (k+1)-th logits lie that far apart (the two paths'
    logits round differently in bf16, and a token on the edge could pick another expert)."""
    gen = torch.Generator().manual_seed(seed)
    w = weights["router_w"]
    x = torch.randn(64 * max(num_tokens, 1), H, generator=gen).to(w.device, w.dtype)
    if margin:
        top = (x.double() @ w.double().T).sort(-1, descending=True).values
        x = x[top[:, top_k - 1] - top[:, top_k] > margin]
    return x[:num_tokens].contiguous()


# --- the naive twin against transformers, fp32 --------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_block():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                                  shared_expert_intermediate_size=I_SHARED)
    config._experts_implementation = "eager"
    block = Qwen3_5MoeSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    sh = block.shared_expert
    weights = dict(router_w=block.gate.weight, gate_up=block.experts.gate_up_proj, down=block.experts.down_proj,
                   shared_gate_up=torch.cat([sh.gate_proj.weight, sh.up_proj.weight]), shared_down=sh.down_proj.weight,
                   shared_gate_w=block.shared_expert_gate.weight)
    return block, {k: v.detach() for k, v in weights.items()}


def test_naive_route_matches_transformers_router(hf_block):
    block, w = hf_block
    x = _tokens(33, w, 3)
    with torch.no_grad():
        _, ref_weights, ref_ids = block.gate(x)
    ids, weights = moe_naive.moe_route(x @ w["router_w"].T, 3)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_naive_block_matches_transformers(hf_block, num_tokens):
    block, w = hf_block
    x = _tokens(num_tokens, w, 3, seed=num_tokens)
    with torch.no_grad():
        ref = block(x[None])[0]
    torch.testing.assert_close(moe_naive.moe_block(x, **w, top_k=3), ref, rtol=1e-5, atol=1e-6)


# --- routing: the tie rule -----------------------------------------------------------------------------------

TIE_ROWS = [
    # logits, top-3 ids by the rule: largest first, equal logits the lower index first
    ([0.0] * 8, [0, 1, 2]),
    ([1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0], [1, 2, 4]),
    ([5.0, 1.0, 2.0, 2.0, 0.0, 2.0, 9.0, 1.0], [6, 0, 2]),  # the tie at the edge of the top k
    ([-1.0, -0.0, 0.0, -1.0, -2.0, -0.0, -3.0, -4.0], [1, 2, 5]),  # -0.0 == 0.0
    ([float("nan"), 1.0, float("nan"), 0.5, 0.0, 0.0, 0.0, 0.0], [1, 3, 4]),  # NaN counts as -inf
]


@pytest.mark.parametrize("impl", ["naive", pytest.param("triton", marks=needs_triton)])
def test_route_breaks_ties_by_the_lower_index(device, impl):
    route = moe_naive.moe_route if impl == "naive" else moe.moe_route
    logits = torch.tensor([row for row, _ in TIE_ROWS], device=device)
    ids, weights = route(logits, 3)
    assert ids.dtype == torch.int64 and ids.tolist() == [want for _, want in TIE_ROWS]
    assert torch.allclose(weights[0], torch.full((3,), 1 / 3, device=device))  # renormalised over the three
    assert torch.allclose(weights.sum(-1), torch.ones(len(TIE_ROWS), device=device))


ROUTE_CASES = {
    # num_experts, top_k, dtype, ties: logits drawn from a few integers (many ties) or continuous
    "fp32-E8-k3": (8, 3, torch.float32, False),
    "bf16-E8-k2": (8, 2, torch.bfloat16, False),
    "fp32-E6-k4-ties": (6, 4, torch.float32, True),  # E not a power of two: the masked lanes
    "bf16-E16-k8-ties": (16, 8, torch.bfloat16, True),
}


@pytest.mark.parametrize("num_experts,top_k,dtype,ties", ROUTE_CASES.values(), ids=ROUTE_CASES.keys())
@needs_triton
def test_triton_route_matches_twin(device, num_experts, top_k, dtype, ties):
    gen = torch.Generator().manual_seed(num_experts + top_k)
    logits = torch.randint(0, 3, (40, num_experts), generator=gen).float() if ties else \
        torch.randn(40, num_experts, generator=gen) * 3
    logits = logits.to(device, dtype)
    ids, weights = moe.moe_route(logits, top_k)
    ref_ids, ref_weights = moe_naive.moe_route(logits, top_k)
    assert torch.equal(ids, ref_ids) and weights.dtype == dtype
    rule = [sorted(range(num_experts), key=lambda e: (-row[e], e))[:top_k] for row in logits.float().tolist()]
    assert ids.tolist() == rule
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


# --- the Triton block against the twin -----------------------------------------------------------------------

BLOCK_CASES = {
    # T, top_k, dtype, the shared expert's intermediate size (the routed experts' I = 32)
    "fp32-T1-k2": (1, 2, torch.float32, I_SHARED),
    "fp32-T17-k3": (17, 3, torch.float32, I_SHARED),  # the shared expert's 17 rows: two blocks of 16
    "bf16-T3-k3": (3, 3, torch.bfloat16, I_SHARED),
    "bf16-T17-k2-shared-as-wide": (17, 2, torch.bfloat16, I),
}


@pytest.mark.parametrize("num_tokens,top_k,dtype,inter_s", BLOCK_CASES.values(), ids=BLOCK_CASES.keys())
@needs_triton
def test_triton_block_matches_twin(device, rel, num_tokens, top_k, dtype, inter_s):
    w = _weights(dtype=dtype, device=device, inter_s=inter_s)
    x = _tokens(num_tokens, w, top_k, margin=0.25)
    assert x.shape[0] == num_tokens
    out = moe.moe_block(x, **w, top_k=top_k)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel(out, moe_naive.moe_block(x, **w, top_k=top_k)) < (1e-5 if dtype == torch.float32 else 2e-2)


@needs_triton
def test_triton_experts_match_twin_with_crowded_experts(device, rel):
    """Given ids: expert 1 takes every token's rank 0 (19 rows, two blocks), a token may pick one expert
    twice, and two experts get no row at all."""
    w = _weights(dtype=torch.bfloat16, device=device)
    x = _tokens(19, w, 2, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.ones(19, dtype=torch.int64), torch.randint(1, E - 2, (19,), generator=gen)], 1)
    weights = torch.rand(19, 2, generator=gen).to(torch.bfloat16)
    ids, weights = ids.to(device), weights.to(device)
    out = moe.moe_experts(x, ids, weights, w["gate_up"], w["down"])
    assert rel(out, moe_naive.moe_experts(x, ids, weights, w["gate_up"], w["down"])) < 2e-2


# --- batch invariance ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@needs_triton
def test_a_row_is_the_same_whatever_rows_come_with_it(device, dtype):
    """Rows of a 17-token call equal, bit for bit, the same rows computed alone or in other company (their
    places in the expert blocks all differ): routing, grouping and the combine never look across rows."""
    w = _weights(dtype=dtype, device=device)
    x = _tokens(17, w, 3, seed=7)
    whole = moe.moe_block(x, **w, top_k=3)
    for lo, hi in ((0, 1), (9, 10), (16, 17), (2, 5), (4, 17)):
        assert torch.equal(moe.moe_block(x[lo:hi], **w, top_k=3), whole[lo:hi]), (lo, hi)
    shuffled = torch.tensor([16, 3, 0, 11], device=x.device)
    assert torch.equal(moe.moe_block(x[shuffled], **w, top_k=3), whole[shuffled])


# --- edges ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["naive", pytest.param("triton", marks=needs_triton)])
def test_no_tokens(device, impl):
    mod = moe_naive if impl == "naive" else moe
    w = _weights(device=device)
    x = torch.zeros(0, H, device=device)
    assert mod.moe_block(x, **w, top_k=3).shape == (0, H)
    ids, weights = mod.moe_route(torch.zeros(0, E, device=device), 3)
    assert ids.shape == weights.shape == (0, 3)
    assert mod.moe_experts(x, ids, weights, w["gate_up"], w["down"]).shape == (0, H)


@needs_triton
def test_bad_shapes_say_what_was_wrong(device):
    w = _weights(device=device)
    x = _tokens(2, w, 3)
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(torch.zeros(2, E, device=device), E + 1)
    with pytest.raises(ValueError, match=r"gate_up \[E, 2I, H\]"):
        moe.moe_block(x[:, :32], **w, top_k=3)
    with pytest.raises(ValueError, match="shared_gate_w"):
        moe.moe_block(x, **{**w, "shared_gate_w": w["shared_gate_w"].T}, top_k=3)
    with pytest.raises(ValueError, match="dtype"):
        moe.moe_block(x.double(), **w, top_k=3)


# --- the real shapes, on a GPU -------------------------------------------------------------------------------


@needs_triton
@pytest.mark.gpu
def test_qwen3_5_35b_a3b_shapes_on_the_gpu(rel):
    """Hidden 2048, 256 experts, top-8, I = Is = 512, bf16: against the twin, and bit for bit across decode
    (1 and 32 rows) and a 512-row chunk."""
    hidden, num_experts, inter, top_k = 2048, 256, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    w = dict(router_w=draw(num_experts, hidden), gate_up=draw(num_experts, 2 * inter, hidden),
             down=draw(num_experts, hidden, inter), shared_gate_up=draw(2 * inter, hidden),
             shared_down=draw(hidden, inter), shared_gate_w=draw(1, hidden))
    x = draw(512, hidden) * hidden ** 0.5
    whole = moe.moe_block(x, **w, top_k=top_k)
    ref = moe_naive.moe_block(x, **w, top_k=top_k)
    # rows whose two routings agree (cuBLAS's logits and ours may round a near tie apart)
    ids = moe.moe_route(moe.router_logits(x, w["router_w"]), top_k)[0]
    ref_ids = moe_naive.moe_route(x @ w["router_w"].T, top_k)[0]
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same.float().mean() > 0.97
    assert rel(whole[same], ref[same]) < 2e-2
    for lo, hi in ((0, 1), (7, 8), (0, 32), (100, 132), (480, 512), (0, 300)):
        assert torch.equal(moe.moe_block(x[lo:hi], **w, top_k=top_k), whole[lo:hi]), (lo, hi)
