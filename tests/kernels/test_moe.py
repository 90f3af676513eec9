"""Qwen3.5-MoE's sparse block: the naive twin against transformers, the Triton kernels against the twin, the
tie rule, and the property the kernels exist for: a row's bits never depend on the rows that come with it."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import counts as kernel_counts
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
    ([-float("inf"), 2.0, float("nan"), -float("inf"), -3e38, -float("inf"), 1e-30, -float("inf")], [1, 6, 4]),
    ([-float("inf"), float("nan"), -float("inf"), 7.0, -float("inf"), -float("inf"), -1.0, -float("inf")], [3, 6, 0]),
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


PATH_CASES = {f"{name}-{path}": (*case, path) for name, case in BLOCK_CASES.items()
              for path in ("direct", "pairs", "grouped") if path == "grouped" or case[0] <= 16}


@pytest.mark.parametrize("num_tokens,top_k,dtype,inter_s,path", PATH_CASES.values(), ids=PATH_CASES.keys())
@needs_triton
def test_triton_block_matches_twin(device, rel, num_tokens, top_k, dtype, inter_s, path):
    w = _weights(dtype=dtype, device=device, inter_s=inter_s)
    x = _tokens(num_tokens, w, top_k, margin=0.25)
    assert x.shape[0] == num_tokens
    out = moe.moe_block(x, **w, top_k=top_k, path=path)
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


PATHS_CASES = {"fp32-T1": (torch.float32, 1), "fp32-T16": (torch.float32, 16), "bf16-T5": (torch.bfloat16, 5)}


@pytest.mark.parametrize("dtype,num_tokens", PATHS_CASES.values(), ids=PATHS_CASES.keys())
@needs_triton
def test_the_three_paths_give_the_same_bits(device, dtype, num_tokens):
    """The direct path (a pair its own tile, the down and combine in one pass) and the pairs path (a pair its
    own tile in the down too, the combine apart) against the grouped one at the same T, bit for bit (the
    interpreter's row-exact products; the gpu test checks the real tiles), with a shared expert wider than the
    routed ones (T = 16: its rows fill one tile)."""
    w = _weights(dtype=dtype, device=device, inter_s=I_SHARED)
    x = _tokens(num_tokens, w, 3, seed=11)
    direct = moe.moe_block(x, **w, top_k=3, path="direct")
    assert torch.equal(direct, moe.moe_block(x, **w, top_k=3, path="grouped"))
    assert torch.equal(direct, moe.moe_block(x, **w, top_k=3, path="pairs"))
    if num_tokens == 5:  # and the direct path's rows against the same rows alone
        for t in range(num_tokens):
            assert torch.equal(moe.moe_block(x[t:t + 1], **w, top_k=3), direct[t:t + 1]), t


@pytest.mark.parametrize("dtype,num_tokens", [(torch.float32, 1), (torch.bfloat16, 5)], ids=["fp32-T1", "bf16-T5"])
@needs_triton
def test_the_pairs_path_routed_first_gives_the_same_bits(device, monkeypatch, dtype, num_tokens):
    """PAIRS_ROUTE_FIRST: the route kernel ahead of a gate_up that reads each pair's expert, against the
    routing inside the gate_up and the grouped path, bit for bit (the same _top_k; the rows the same tiles),
    with a shared expert wider than the routed ones, the block alone and with the next layer's add and norm."""
    w = _weights(dtype=dtype, device=device, inter_s=I_SHARED)
    x = _tokens(num_tokens, w, 3, seed=23)
    residual = _tokens(num_tokens, w, 3, seed=24)
    norm_w = torch.rand(w["router_w"].shape[1], dtype=dtype, device=device) + 0.5
    inside = moe.moe_block(x, **w, top_k=3, path="pairs")
    fused = moe.moe_block_add_rms_norm(x, **w, top_k=3, residual=residual, norm_w=norm_w, eps=1e-6, path="pairs")
    monkeypatch.setattr(moe, "PAIRS_ROUTE_FIRST", True)
    assert torch.equal(moe.moe_block(x, **w, top_k=3, path="pairs"), inside)
    assert torch.equal(moe.moe_block(x, **w, top_k=3, path="grouped"), inside)
    got = moe.moe_block_add_rms_norm(x, **w, top_k=3, residual=residual, norm_w=norm_w, eps=1e-6, path="pairs")
    assert all(torch.equal(a, b) for a, b in zip(got, fused))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_triton
def test_the_split_router_adds_its_slices_in_order(device, monkeypatch, rel, dtype):
    """ROUTER_SPLIT_K: the router's K in fixed slices, added in slice order by each tile's last program. Its
    logits against the twin; a row's bits the same alone and among 20 rows (two row tiles); the tile counters
    zero again after every launch; and the three paths of the block on it bit for bit."""
    monkeypatch.setattr(moe, "ROUTER_SPLIT_K", 4)
    monkeypatch.setattr(moe, "ROUTER_BLOCK_K", 16)  # H = 64: four slices of one K step each
    w = _weights(dtype=dtype, device=device, inter_s=I_SHARED)
    x = _tokens(20, w, 3, seed=31)
    gate = torch.cat([w["router_w"], w["shared_gate_w"]])
    logits = moe._router(x, w["router_w"], w["shared_gate_w"])
    assert rel(logits.float(), x.float() @ gate.float().T) < (1e-5 if dtype == torch.float32 else 1e-2)
    for t in (0, 17):
        assert torch.equal(moe._router(x[t:t + 1], w["router_w"], w["shared_gate_w"]), logits[t:t + 1]), t
    assert kernel_counts.all_zero()
    part = x[:5]
    grouped = moe.moe_block(part, **w, top_k=3, path="grouped")
    for path in moe.SMALL_PATHS:
        assert torch.equal(moe.moe_block(part, **w, top_k=3, path=path), grouped), path
    assert torch.equal(moe.moe_block(x, **w, top_k=3)[:5], grouped)


@needs_triton
def test_experts_with_several_blocks_and_group_steps(device, rel):
    """70 tokens, top-3 of 8 experts: some 26 rows an expert (two blocks each), the shared expert's 70 rows in
    five blocks, the counting sort in two token steps; against the twin, and its rows against T = 1 calls."""
    w = _weights(dtype=torch.float32, device=device)
    x = _tokens(70, w, 3, seed=13, margin=0.25)
    whole = moe.moe_block(x, **w, top_k=3)
    assert rel(whole, moe_naive.moe_block(x, **w, top_k=3)) < 1e-5
    for t in (0, 64, 69):
        assert torch.equal(moe.moe_block(x[t:t + 1], **w, top_k=3), whole[t:t + 1]), t


@pytest.mark.parametrize("path", ["direct", "pairs", "grouped"])
@needs_triton
def test_tied_router_logits_take_the_lower_expert(device, rel, path):
    """Router rows 2 and 5 equal and the others zero: a token with x . v > 0 takes experts 2, 5 (equal logits,
    lower index first), then 0; one with x . v < 0 takes 0, 1, 3 (the lowest of the zero logits). Experts the
    rule leaves out may hold anything: the block's bits do not change."""
    w = _weights(dtype=torch.float32, device=device)
    router = torch.zeros_like(w["router_w"])
    router[2] = router[5] = w["router_w"][0]
    w["router_w"] = router
    x = _tokens(4, w, 3, seed=17)
    logits = x @ router.T
    assert (logits[:, 2] > 0).any() and (logits[:, 2] < 0).any()
    out = moe.moe_block(x, **w, top_k=3, path=path)
    assert rel(out, moe_naive.moe_block(x, **w, top_k=3)) < 1e-5
    unused = [e for e in range(E) if e not in (0, 1, 2, 3, 5)]
    other = {**w, "gate_up": w["gate_up"].clone(), "down": w["down"].clone()}
    other["gate_up"][unused] = 7.0
    other["down"][unused] = -7.0
    assert torch.equal(moe.moe_block(x, **other, top_k=3, path=path), out)


@pytest.mark.parametrize("path", ["direct", "pairs", "grouped"])
@needs_triton
def test_the_shared_expert_rides_behind_its_sigmoid_gate(device, rel, path):
    """With every routed expert's down zero the block is sigmoid(x . gate_w) * shared(x), the shared expert
    wider than the routed ones."""
    w = _weights(dtype=torch.float32, device=device, inter_s=I_SHARED)
    w["down"] = torch.zeros_like(w["down"])
    x = _tokens(4, w, 2, seed=19)
    want = torch.sigmoid(x @ w["shared_gate_w"].T) * moe_naive.expert_mlp(x, w["shared_gate_up"], w["shared_down"])
    assert rel(moe.moe_block(x, **w, top_k=2, path=path), want) < 1e-5


@needs_triton
def test_the_wide_schedule_gives_the_same_bits(device, monkeypatch):
    """A grouped program taking several column tiles, and the counting sort's wide token steps (the long
    chunks' schedule, forced here at 70 tokens), against the narrow schedule: bit for bit, with a shared expert
    wider than the routed ones (so a program's last tiles run past the routed experts' columns)."""
    w = _weights(dtype=torch.bfloat16, device=device, inter_s=I_SHARED)
    x = _tokens(70, w, 3, seed=29)
    narrow = moe.moe_block(x, **w, top_k=3, path="grouped")
    monkeypatch.setattr(moe, "WIDE_MIN_TOKENS", 1)
    monkeypatch.setattr(moe, "WIDE_TILES", 3)  # H = 64: two tiles of 32, the third past H
    monkeypatch.setattr(moe, "GROUP_WIDE_MIN_TOKENS", 1)
    monkeypatch.setattr(moe, "GROUP_WIDE_BLOCK_T", 32)  # three token steps
    assert torch.equal(moe.moe_block(x, **w, top_k=3, path="grouped"), narrow)


@needs_triton
def test_pdl_is_off_under_the_interpreter(device, monkeypatch):
    """PDL asks for grid dependency control, which the interpreter has not: its launches stay plain, the
    same bits."""
    from qse_kernels import pdl

    w = _weights(dtype=torch.bfloat16, device=device)
    x = _tokens(2, w, 3, seed=31)
    monkeypatch.setattr(pdl, "ON", False)
    want = moe.moe_block(x, **w, top_k=3)
    monkeypatch.setattr(pdl, "ON", True)
    if device == "cpu":
        assert pdl.options() == {"PDL": 0}
    assert torch.equal(moe.moe_block(x, **w, top_k=3), want)


def test_the_paths_by_token_count():
    """path_for: pairs for 1..8 tokens, grouped past that (the pinned choice of speed); direct only when asked."""
    if moe is None:
        pytest.skip("needs Triton")
    picks = {t: moe.path_for(t) for t in (1, 2, 4, 8, 9, 16, 17, 4096)}
    assert picks == {1: "pairs", 2: "pairs", 4: "pairs", 8: "pairs", 9: "grouped", 16: "grouped", 17: "grouped",
                     4096: "grouped"}


@needs_triton
def test_the_group_kernel_is_a_stable_sort_by_expert(device):
    """order and counts against torch's stable argsort of the keys, with 70 tokens (two token steps) and a
    token naming one expert twice (as moe_experts allows); 20 experts: two programs, the second partial."""
    num_tokens, top_k, num_experts = 70, 3, 20
    gen = torch.Generator().manual_seed(23)
    keys = torch.randint(0, num_experts, (num_tokens * top_k,), generator=gen, dtype=torch.int32)
    keys[3:6] = 7  # token 1 names expert 7 three times
    cap = keys.numel()
    order, counts = moe._group(keys.to(device), num_tokens, top_k, num_experts, cap)
    want = torch.sort(keys.long(), stable=True).indices
    assert counts.tolist() == torch.bincount(keys.long(), minlength=num_experts).tolist()
    got = torch.cat([order[e * cap: e * cap + c] for e, c in enumerate(counts.tolist())])
    assert got.tolist() == want.tolist()


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
    for path in ("direct", "pairs", "nope"):
        with pytest.raises(ValueError, match="path must be"):
            moe.moe_block(_tokens(17, w, 3), **w, top_k=3, path=path)


# --- the block fused with the residual add and norm after it ----------------------------------------------


def _add_norm_case(num_tokens: int, w: dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = w["router_w"].shape[1]
    dev, dt = w["router_w"].device, w["router_w"].dtype
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dev, dt)
    norm_w = (torch.randn(hidden, generator=gen) * 0.1).to(dev, dt)
    return residual, norm_w


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_block_with_add_and_norm_is_the_block_then_add_rms_norm(device, num_tokens):
    """moe_block_add_rms_norm(x, ..., residual, w) is fused.add_rms_norm(residual, moe_block(x, ...), w) bit for
    bit, on every path the token count allows (pairs and grouped fuse the combine into the norm's launch)."""
    from qse_kernels import fused

    w = _weights(dtype=torch.bfloat16, device=device)
    x = _tokens(num_tokens, w, 3, seed=41)
    residual, norm_w = _add_norm_case(num_tokens, w, 5)
    for path in moe.PATHS if num_tokens <= moe.BLOCK_M else ("grouped",):
        want = fused.add_rms_norm(residual, moe.moe_block(x, **w, top_k=3, path=path), norm_w, 1e-6)
        got = moe.moe_block_add_rms_norm(x, **w, top_k=3, residual=residual, norm_w=norm_w, eps=1e-6, path=path)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), path
    with pytest.raises(ValueError, match="residual must match x"):
        moe.moe_block_add_rms_norm(x, **w, top_k=3, residual=residual[:, :8], norm_w=norm_w, eps=1e-6)


# --- the real shapes, on a GPU -------------------------------------------------------------------------------


def _qwen3_5_35b_a3b_block(num_tokens: int):
    """Hidden 2048, 256 experts, top-8, I = Is = 512, bf16, random weights on the GPU; and x [num_tokens, H]."""
    hidden, num_experts, inter = 2048, 256, 512
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    w = dict(router_w=draw(num_experts, hidden), gate_up=draw(num_experts, 2 * inter, hidden),
             down=draw(num_experts, hidden, inter), shared_gate_up=draw(2 * inter, hidden),
             shared_down=draw(hidden, inter), shared_gate_w=draw(1, hidden))
    return w, draw(num_tokens, hidden) * hidden ** 0.5


@needs_triton
@pytest.mark.gpu
def test_qwen3_5_35b_a3b_shapes_on_the_gpu(rel, monkeypatch):
    """The real shapes: against the twin, and a row's bits the same at every T, on either path: decode (1, 2,
    8, 16 rows), rounds and verify windows (32, 33: grouped) and a 512-row chunk, also with the long chunks'
    schedule (a program several column tiles, wide sort steps); the three paths bit for bit at the same T;
    and the small paths under a CUDA graph."""
    top_k = 8
    monkeypatch.setattr(moe, "ROUTER_SPLIT_K", 1)  # one K loop a router program first; the split further down
    w, x = _qwen3_5_35b_a3b_block(512)
    whole = moe.moe_block(x, **w, top_k=top_k)
    ref = moe_naive.moe_block(x, **w, top_k=top_k)
    # rows whose two routings agree (cuBLAS's logits and ours may round a near tie apart)
    ids = moe.moe_route(moe.router_logits(x, w["router_w"]), top_k)[0]
    ref_ids = moe_naive.moe_route(x @ w["router_w"].T, top_k)[0]
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same.float().mean() > 0.97
    assert rel(whole[same], ref[same]) < 2e-2
    for num_tokens in (1, 2, 8, 16, 32, 33):
        for lo in (0, 100, 512 - num_tokens):
            got = moe.moe_block(x[lo:lo + num_tokens], **w, top_k=top_k)
            assert torch.equal(got, whole[lo:lo + num_tokens]), (num_tokens, lo)
        if num_tokens <= moe.BLOCK_M:
            part = x[7:7 + num_tokens]
            grouped = moe.moe_block(part, **w, top_k=top_k, path="grouped")
            for path in moe.SMALL_PATHS:
                assert torch.equal(moe.moe_block(part, **w, top_k=top_k, path=path), grouped), (num_tokens, path)
    assert torch.equal(moe.moe_block(x[:300], **w, top_k=top_k), whole[:300])
    with monkeypatch.context() as patch:
        for knob in ("WIDE_MIN_TOKENS", "GROUP_WIDE_MIN_TOKENS"):
            patch.setattr(moe, knob, 1)
        assert torch.equal(moe.moe_block(x, **w, top_k=top_k), whole)
    # the pairs path routed first (PAIRS_ROUTE_FIRST): the same bits at decode sizes
    with monkeypatch.context() as patch:
        patch.setattr(moe, "PAIRS_ROUTE_FIRST", True)
        for num_tokens in (1, 2, 8):
            assert torch.equal(moe.moe_block(x[7:7 + num_tokens], **w, top_k=top_k, path="pairs"),
                               whole[7:7 + num_tokens]), num_tokens
    # the router split in K (ROUTER_SPLIT_K): other bits than one K loop, but a row's the same at every T and on
    # every path, and its tile counters zero after each launch
    with monkeypatch.context() as patch:
        patch.setattr(moe, "ROUTER_SPLIT_K", 8)
        split = moe.moe_block(x, **w, top_k=top_k)
        assert rel(split[same], ref[same]) < 2e-2
        for num_tokens in (1, 2, 8, 16, 33):
            for path in (moe.SMALL_PATHS if num_tokens <= moe.BLOCK_M else ()) + ("grouped",):
                assert torch.equal(moe.moe_block(x[7:7 + num_tokens], **w, top_k=top_k, path=path),
                                   split[7:7 + num_tokens]), (num_tokens, path)
        assert kernel_counts.all_zero()
    # the decode step's block inside a graph: nothing waits on the host, the same bits (the split router's too:
    # its counters zero again between replays)
    for path, rows, split_k in (("pairs", 1, 1), ("direct", 2, 1), ("pairs", 1, 8)):
        monkeypatch.setattr(moe, "ROUTER_SPLIT_K", split_k)
        want = whole if split_k == 1 else split
        static_x = x[5:5 + rows].clone()
        moe.moe_block(static_x, **w, top_k=top_k, path=path)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe.moe_block(static_x, **w, top_k=top_k, path=path)
        for t in (5, 9, 5):
            static_x.copy_(x[t:t + rows])
            graph.replay()
            assert torch.equal(static_out, want[t:t + rows]), (t, path, split_k)


@needs_triton
@pytest.mark.gpu
def test_block_with_add_and_norm_at_the_real_shapes_on_the_gpu():
    """The fused launch's sum over a row's columns must run in the add_rms_norm kernel's layout: the same bits
    as the block then add_rms_norm at decode, verify and chunk sizes, eager and in a graph."""
    from qse_kernels import fused

    top_k = 8
    w, x = _qwen3_5_35b_a3b_block(512)
    residual = torch.randn(512, x.shape[1], device="cuda").to(torch.bfloat16)
    norm_w = (torch.randn(x.shape[1], device="cuda") * 0.1).to(torch.bfloat16)
    for rows in (1, 2, 8, 32, 512):
        want = fused.add_rms_norm(residual[:rows], moe.moe_block(x[:rows], **w, top_k=top_k), norm_w, 1e-6)
        got = moe.moe_block_add_rms_norm(x[:rows], **w, top_k=top_k, residual=residual[:rows], norm_w=norm_w,
                                         eps=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
    static = x[3:4].clone(), residual[3:4].clone()
    moe.moe_block_add_rms_norm(static[0], **w, top_k=top_k, residual=static[1], norm_w=norm_w, eps=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_block_add_rms_norm(static[0], **w, top_k=top_k, residual=static[1], norm_w=norm_w, eps=1e-6)
    for t in (9, 200):
        static[0].copy_(x[t:t + 1])
        static[1].copy_(residual[t:t + 1])
        graph.replay()
        want = fused.add_rms_norm(residual[t:t + 1], moe.moe_block(x[t:t + 1], **w, top_k=top_k), norm_w, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), t


@needs_triton
@pytest.mark.gpu
def test_pdl_launches_give_the_same_bits_on_the_gpu(monkeypatch):
    """Every path's launches with programmatic dependent launch (pdl.ON), eager and in a CUDA graph, give the
    same bits as without."""
    from qse_kernels import pdl

    top_k = 8
    w, x = _qwen3_5_35b_a3b_block(40)
    monkeypatch.setattr(pdl, "ON", False)
    want = {path: moe.moe_block(x[:4], **w, top_k=top_k, path=path) for path in moe.PATHS}
    whole = moe.moe_block(x, **w, top_k=top_k)
    monkeypatch.setattr(pdl, "ON", True)
    assert pdl.options()["PDL"]
    for path in moe.PATHS:
        assert torch.equal(moe.moe_block(x[:4], **w, top_k=top_k, path=path), want[path]), path
    assert torch.equal(moe.moe_block(x, **w, top_k=top_k), whole)
    static_x = x[:1].clone()
    moe.moe_block(static_x, **w, top_k=top_k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe.moe_block(static_x, **w, top_k=top_k)
    for t in (3, 17):
        static_x.copy_(x[t:t + 1])
        graph.replay()
        assert torch.equal(static_out, whole[t:t + 1]), t


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_norm_and_router_in_one_launch_are_the_two(device, num_tokens, monkeypatch):
    """add_rms_norm_router with NORM_ROUTER (one launch: every router program normalises its rows and reads back
    the K slice of y it stored) against the add and norm, then the router (two launches): s, y and the logits
    bit for bit, its counters zero after; the block handed those logits is the block that routes itself."""
    from qse_kernels import fused

    w = _weights(dtype=torch.bfloat16, device=device)
    x = _tokens(num_tokens, w, 3, seed=41)
    residual = _tokens(num_tokens, w, 3, seed=42)
    norm_w = (torch.randn(H, generator=torch.Generator().manual_seed(43)) * 0.1).to(device, torch.bfloat16)
    monkeypatch.setattr(moe, "ROUTER_BLOCK_K", 16)  # H = 64 in four K steps: two slices of two (ROUTER_SPLIT_K 2)
    monkeypatch.setattr(moe, "ROUTER_SPLIT_K", 2)
    two = moe.add_rms_norm_router(residual, x, norm_w, 1e-6, w["router_w"], w["shared_gate_w"])
    monkeypatch.setattr(moe, "NORM_ROUTER", True)
    one = moe.add_rms_norm_router(residual, x, norm_w, 1e-6, w["router_w"], w["shared_gate_w"])
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert kernel_counts.all_zero()
    s, y = fused.add_rms_norm(residual, x, norm_w, 1e-6)
    assert torch.equal(one[0], s) and torch.equal(one[1], y)
    args = dict(top_k=3, residual=s, norm_w=norm_w, eps=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(moe.moe_block_add_rms_norm(y, **w, **args, logits=one[2]),
                                                 moe.moe_block_add_rms_norm(y, **w, **args)))
    with pytest.raises(ValueError, match=r"logits must be the router's of x"):
        moe.moe_block_add_rms_norm(y, **w, **args, logits=one[2][:, :-1])


@needs_triton
@pytest.mark.gpu
def test_norm_and_router_in_one_launch_at_the_real_shapes_on_the_gpu(monkeypatch):
    """The 35B-A3B's shapes at a decode round's sizes: the one launch is the two bit for bit, eagerly and
    replayed in a CUDA graph; past PAIRS_MAX_TOKENS rows the two run."""
    w, x = _qwen3_5_35b_a3b_block(64)
    residual = torch.randn(64, x.shape[1], device="cuda").to(torch.bfloat16)
    norm_w = (torch.randn(x.shape[1], device="cuda") * 0.1).to(torch.bfloat16)
    router = (w["router_w"], w["shared_gate_w"])
    for rows in (1, 2, 8, 9, 33):
        monkeypatch.setattr(moe, "NORM_ROUTER", False)
        two = moe.add_rms_norm_router(residual[:rows], x[:rows], norm_w, 1e-6, *router)
        monkeypatch.setattr(moe, "NORM_ROUTER", True)
        one = moe.add_rms_norm_router(residual[:rows], x[:rows], norm_w, 1e-6, *router)
        assert all(torch.equal(a, b) for a, b in zip(one, two)), rows
        assert kernel_counts.all_zero()
    static = x[3:4].clone(), residual[3:4].clone()
    moe.add_rms_norm_router(static[1], static[0], norm_w, 1e-6, *router)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.add_rms_norm_router(static[1], static[0], norm_w, 1e-6, *router)
    for t in (9, 40):
        static[0].copy_(x[t:t + 1])
        static[1].copy_(residual[t:t + 1])
        graph.replay()
        monkeypatch.setattr(moe, "NORM_ROUTER", False)
        want = moe.add_rms_norm_router(residual[t:t + 1], x[t:t + 1], norm_w, 1e-6, *router)
        monkeypatch.setattr(moe, "NORM_ROUTER", True)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), t
        assert kernel_counts.all_zero()


# --- the benchmark's flow ------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny flow check runs the interpreter on the CPU")
def test_the_block_benchmark_flow_and_its_sweep_on_the_cpu(tmp_path, capsys):
    """benchmarks/moe_block_bench.py --tiny at T = 1 (one run, the interpreter being slow): every path timed,
    its bit checks true, the JSON's header; the old block is timed where git has its commit, and says why not
    elsewhere. --sweep --knobs: only the named knobs, each value timed with its bits against the pinned
    value's, and the knob put back afterwards; an unknown knob is refused by name before anything is timed."""
    import json

    from benchmarks import moe_block_bench

    before = moe.NUM_WARPS
    assert moe_block_bench.main(["--tiny", "--out", str(tmp_path), "--tokens", "1", "--sweep",
                                 "--knobs", "NUM_WARPS"]) == 0
    assert moe.NUM_WARPS == before
    (path,) = tmp_path.glob("moe_block_bench-*-cpu.json")
    result = json.loads(path.read_text())
    assert list(result)[:4] == ["command", "date", "device", "versions"]
    (row,) = result["rows"]
    assert row["T"] == 1 and all(f"{name}_us" in row for name in ("new", "new_direct", "new_pairs", "new_grouped"))
    assert row["all_bit_equal"] and row["rows_bit_equal_alone"] and result["all_bit_equal"]
    assert row["fastest_new_path"] in moe.PATHS
    assert ("old_us" in row) != bool(result["old_missing"])
    sweep = result["sweep"]
    assert [(entry["knob"], entry["value"]) for entry in sweep] == [("num_warps", 2), ("num_warps", 4),
                                                                    ("num_warps", 8)]
    assert all(entry["bit_equal_t1"] and "us_t1" in entry and "error" not in entry for entry in sweep)
    with pytest.raises(SystemExit):
        moe_block_bench.main(["--tiny", "--out", str(tmp_path / "refused"), "--tokens", "1", "--sweep",
                              "--knobs", "NO_SUCH"])
    assert "unknown ['NO_SUCH']" in capsys.readouterr().err and not (tmp_path / "refused").exists()
