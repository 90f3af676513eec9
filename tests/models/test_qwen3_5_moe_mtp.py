"""The MoE family's MTP head (issue 31, item 3): presets build it in the published shape (an MoE decoder layer of the
main layers' experts, top-k and widths), the layout loads it in both stored expert forms and names a bad tensor,
a drafter from a head of another model is refused by name, and the head's forward (the dense family's MTPHead,
its layer's MLP the sparse block of the head's own weights) is its formula (tests/models/mtp_twin.py) in float64."""

from __future__ import annotations

import json

import pytest
import torch
from mtp_twin import moe_mlp, naive_draft, naive_logits, naive_mtp
from safetensors.torch import save_file

from qse.engine.drafters import DrafterMismatch, DrafterNeeds, MTPDrafter, check_drafter
from qse.models.qwen3_5_moe import CheckpointError, Qwen35MoeModel, load, parse_config
from qse.models.qwen3_5_moe.layout import expected_mtp_shapes, expected_shapes
from qse.models.qwen3_5_moe.presets import preset_config_dict, random_tensors, random_weights, tiny_config_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny forwards: OpenMP's spinning only slows them
CONTEXT = 13
CPU = torch.device("cpu")


def _model(dtype: torch.dtype = torch.float32, seed: int = 3, **shape) -> Qwen35MoeModel:
    cfg = parse_config(tiny_config_dict(**shape))
    return Qwen35MoeModel(cfg, random_weights(cfg, seed, CPU, dtype), CPU, dtype)


@pytest.fixture(scope="module")
def model() -> Qwen35MoeModel:
    return _model()


@pytest.fixture(scope="module")
def pairs(model):
    """next ids [CONTEXT] and hidden states [CONTEXT, H] of the size the target's final norm gives."""
    gen = torch.Generator().manual_seed(11)
    return (torch.randint(0, model.cfg.vocab_size, (CONTEXT,), generator=gen),
            torch.randn(CONTEXT, model.cfg.hidden_size, generator=gen))


# ---- the presets ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,experts,top_k,width", [("qwen3.5-35b-a3b", 256, 8, 512),
                                                        ("qwen3.5-122b-a10b", 256, 8, 1024),
                                                        ("qwen3.5-397b-a17b", 512, 10, 1024)],
                         ids=["35b-a3b", "122b-a10b", "397b-a17b"])
def test_every_preset_has_the_published_moe_head(preset, experts, top_k, width):
    cfg = parse_config(preset_config_dict(preset))
    shapes, h, m = expected_mtp_shapes(cfg), cfg.hidden_size, "mtp.layers.0.mlp."
    assert cfg.mtp_num_hidden_layers == 1 and (cfg.num_experts, cfg.num_experts_per_tok) == (experts, top_k)
    assert shapes["mtp.fc.weight"] == (h, 2 * h)
    assert shapes[m + "gate.weight"] == (experts, h)
    assert shapes[m + "experts.gate_up_proj"] == (experts, 2 * width, h)
    assert shapes[m + "experts.down_proj"] == (experts, h, width)
    assert shapes[m + "shared_expert.down_proj.weight"] == (h, width)
    assert shapes[m + "shared_expert_gate.weight"] == (1, h)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (2 * cfg.num_attention_heads * cfg.head_dim, h)
    assert not any(n.endswith(("mlp.gate_proj.weight", "mlp.down_proj.weight")) for n in shapes)  # no dense MLP
    assert not any("linear_attn" in n or n.startswith("mtp.layers.1.") for n in shapes)
    assert not set(shapes) & set(expected_shapes(cfg))


def test_random_weights_draw_the_head_after_the_model_and_leave_the_model_alone():
    cfg = parse_config(tiny_config_dict())
    plain = random_tensors(parse_config(tiny_config_dict(mtp_num_hidden_layers=0)), seed=7)
    headed = random_tensors(cfg, seed=7)
    assert set(headed) - set(plain) == set(expected_mtp_shapes(cfg))
    assert all(torch.equal(plain[n], headed[n]) for n in plain)  # the model's bytes, head or not
    assert all(tuple(headed[n].shape) == s for n, s in expected_mtp_shapes(cfg).items())
    assert float(headed["mtp.pre_fc_norm_hidden.weight"].abs().max()) < 0.5  # a norm's scale: near the identity


# ---- the head's forward ---------------------------------------------------------------------------------------
def test_the_moe_head_is_its_formula(model, pairs):
    """The head's output and logits against the twin (float64) on the head's own router, experts and shared
    expert; its layer's block is the model's kernels' on those weights."""
    ids, hidden = pairs
    head = model.mtp_head()
    cache = head.new_cache()
    g = head.forward(ids, hidden, cache)
    want = naive_mtp(model, ids, hidden, moe_mlp)
    assert cache.length == CONTEXT and g.shape == (CONTEXT, model.cfg.hidden_size)
    torch.testing.assert_close(g.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(g).double(), naive_logits(model, want), rtol=1e-4, atol=1e-4)
    assert model.moe_args["mtp.layers.0."][0] is model.w["mtp.layers.0.mlp.gate.weight"]  # the head's own router


@pytest.mark.parametrize("k", [1, 3])
def test_a_moe_draft_is_the_rule(model, pairs, k):
    ids, hidden = pairs
    head = model.mtp_head()
    cache = head.new_cache()
    head.forward(ids, hidden, cache)
    assert head.draft(cache, k).tolist() == naive_draft(model, ids, hidden, k, moe_mlp)
    assert cache.length == CONTEXT


def test_a_chunked_moe_head_equals_one_shot(model, pairs):
    ids, hidden = pairs
    head = model.mtp_head()
    whole, parts = head.new_cache(), head.new_cache()
    g = head.forward(ids, hidden, whole)
    outs = [head.forward(ids[lo:hi], hidden[lo:hi], parts) for lo, hi in ((0, 5), (5, 6), (6, CONTEXT))]
    torch.testing.assert_close(torch.cat(outs), g, rtol=1e-5, atol=1e-5)
    assert head.draft(parts, 3).tolist() == head.draft(whole, 3).tolist()


def test_the_cast_twin_keeps_the_head(model, pairs):
    """The float64 twin holds the head; it is the formula to the block's fp32 routing and combine (moe_naive)."""
    ids, hidden = pairs
    twin = model.cast(torch.float64)
    assert {n for n in [*twin.w, *twin.lin] if n.startswith("mtp.")} == set(expected_mtp_shapes(model.cfg))
    g = twin.mtp_head().forward(ids, hidden, twin.mtp_head().new_cache())
    torch.testing.assert_close(g, naive_mtp(model, ids, hidden, moe_mlp), rtol=1e-5, atol=1e-5)


def test_a_model_without_the_head_says_so():
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=0"):
        _model(mtp_num_hidden_layers=0).mtp_head()
    cfg = parse_config(tiny_config_dict())  # a head in the config, none in the weights
    headless = parse_config(tiny_config_dict(mtp_num_hidden_layers=0))
    model = Qwen35MoeModel(cfg, random_weights(headless, 0, CPU, torch.float32), CPU, torch.float32)
    with pytest.raises(ValueError, match=r"the model holds no 'mtp\.fc\.weight' \(and 18 more MTP tensors\)"):
        model.mtp_head()


# ---- the drafter's needs --------------------------------------------------------------------------------------
def test_a_drafter_from_another_models_head_is_refused_by_name(model):
    drafter = MTPDrafter(model.mtp_head(), k=2)
    assert drafter.requires() == DrafterNeeds(hidden_size=64, vocab_size=328, taps=("final_hidden",),
                                              tensors=("embed_tokens.weight", "lm_head.weight"))
    check_drafter(drafter, model)
    narrower = _model(hidden_size=48, num_hidden_layers=2)
    with pytest.raises(DrafterMismatch, match="drafter 'mtp' does not fit the served model: it reads hidden "
                                              "states 64 wide, the model's are 48"):
        check_drafter(drafter, narrower)
    with pytest.raises(DrafterMismatch, match="its vocabulary has 328 ids, the model's 640"):
        check_drafter(drafter, _model(vocab_size=640, num_hidden_layers=2))


# ---- checkpoints ----------------------------------------------------------------------------------------------
def _held(model: Qwen35MoeModel, name: str) -> torch.Tensor:
    return model.w[name] if name in model.w else model.lin[name].weight


def _write(model_dir, config: dict, tensors: dict[str, torch.Tensor], one_expert: bool = False) -> None:
    """config.json and model.safetensors as published: the model under model.language_model., the head at the
    top (mtp.*); one_expert: every layer's experts (the head's too) one tensor an expert, as save_pretrained
    writes them."""
    named = {}
    for k, v in tensors.items():
        if one_expert and k.endswith("mlp.experts.gate_up_proj"):
            gate, up = v.chunk(2, dim=1)
            base = k.removesuffix("gate_up_proj")
            for e in range(v.shape[0]):
                named[f"{base}{e}.gate_proj.weight"], named[f"{base}{e}.up_proj.weight"] = gate[e], up[e]
        elif one_expert and k.endswith("mlp.experts.down_proj"):
            base = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                named[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            named[k] = v
    named = {(k if k.startswith(("mtp.", "lm_head.")) else f"model.language_model.{k}"): v.contiguous()
             for k, v in named.items()}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    save_file(named, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny MoE's tensors (two layers) written in both expert forms: (config, tensors, {form: dir})."""
    config = tiny_config_dict(num_hidden_layers=2)
    tensors = random_tensors(parse_config(config), seed=9)
    root = tmp_path_factory.mktemp("moe-mtp")
    dirs = {"fused": root / "fused", "one-expert": root / "one-expert"}
    _write(dirs["fused"], config, tensors)
    _write(dirs["one-expert"], config, tensors, one_expert=True)
    return config, tensors, dirs


@pytest.mark.parametrize("form", ["fused", "one-expert"])
def test_a_written_head_reads_back_bit_for_bit(written, form, pairs):
    config, tensors, dirs = written
    model = load(dirs[form], CPU, torch.float32)
    held = {n for n in [*model.w, *model.lin] if n.startswith("mtp.")}
    assert held == set(expected_mtp_shapes(model.cfg))
    assert all(torch.equal(_held(model, n), tensors[n]) for n in held)
    assert model.mtp_tensors == (len(held) if form == "fused" else len(held) - 2 + 3 * model.cfg.num_experts)
    built = Qwen35MoeModel(model.cfg, random_weights(model.cfg, 9, CPU, torch.float32), CPU, torch.float32)
    ids, hidden = pairs
    read, made = (m.mtp_head().forward(ids, hidden, m.mtp_head().new_cache()) for m in (model, built))
    # the same bytes; the outputs to rounding (torch's CPU GEMMs round by their operands' alignment, and a
    # safetensors file's tensors sit at other offsets: the main layers' logits differ so too)
    torch.testing.assert_close(read, made, rtol=1e-5, atol=1e-5)


def test_a_config_without_a_head_leaves_it_on_disk(written, tmp_path):
    config, tensors, dirs = written
    _write(tmp_path / "m", {**config, "mtp_num_hidden_layers": 0}, tensors)
    model = load(tmp_path / "m", CPU, torch.float32)
    assert not any(n.startswith("mtp.") for n in [*model.w, *model.lin])
    assert model.mtp_tensors == len(expected_mtp_shapes(parse_config(config)))  # recognised, counted


def _edited(tensors: dict[str, torch.Tensor], name: str, value: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    if value is None:
        out.pop(name)
    else:
        out[name] = value
    return out


@pytest.mark.parametrize("name,value,one_expert,message", [
    ("mtp.layers.0.mlp.experts.gate_up_proj", torch.zeros(7, 64, 64), False,
     r"tensor 'mtp\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \(7, 64, 64\), expected \(8, 64, 64\)"),
    ("mtp.layers.0.mlp.gate.weight", torch.zeros(8, 48), False,
     r"tensor 'mtp\.layers\.0\.mlp\.gate\.weight' has shape \(8, 48\), expected \(8, 64\)"),
    ("mtp.layers.0.mlp.shared_expert_gate.weight", None, False,
     r"missing tensor 'mtp\.layers\.0\.mlp\.shared_expert_gate\.weight'"),
    ("mtp.layers.0.mlp.gate_proj.weight", torch.zeros(48, 64), False,
     r"unexpected tensor 'mtp\.layers\.0\.mlp\.gate_proj\.weight'"),
    ("mtp.layers.0.mlp.experts.down_proj", torch.zeros(9, 64, 32), True,
     r"tensor 'mtp\.layers\.0\.mlp\.experts\.8\.down_proj\.weight' names expert 8; the config has 8"),
], ids=["experts-wrong-count", "router-wrong-width", "missing-shared-gate", "a-dense-mlp", "expert-past-the-last"])
def test_a_head_of_the_wrong_shape_is_refused_by_name(written, tmp_path, name, value, one_expert, message):
    config, tensors, _ = written
    _write(tmp_path / "m", config, _edited(tensors, name, value), one_expert=one_expert)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "m", CPU, torch.float32)
