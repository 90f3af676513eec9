"""The qwen3_5_moe family: config, layout and loading against transformers' Qwen3_5MoeForCausalLM (its parameter
names and shapes, and its logits in fp32 on CPU), the published checkpoint form, the presets, the registry, and
the errors a bad checkpoint gives. The batched decode's row invariance: test_qwen3_5_moe_rounds.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qse.models import family_of_dir, preset_weights_nbytes, resolve
from qse.models.qwen3_5_moe import (CheckpointError, ConfigError, MoeTextConfig, Qwen35MoeModel, is_preset,
                                    parse_config, presets)
from qse.models.qwen3_5_moe.layout import expected_mtp_shapes, expected_shapes
from qse.models.qwen3_5_moe.reference import reference_config, reference_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny forwards: OpenMP's spinning only slows them
REL_TOL = 1e-4
CPU = torch.device("cpu")

# shape A: what transformers writes (top-level text config, one tensor an expert), untied
SHAPE_A = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=48, tie_word_embeddings=False)
# shape B, the one the first never shows: three layers (attention last), GQA 4 : 1, GDN heads 2 : 2 of 24, six
# experts of 24 three a token, a shared expert wider than them, tied embeddings; written as Qwen publishes
SHAPE_B = dict(vocab_size=640, hidden_size=48, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
               linear_key_head_dim=24, linear_value_head_dim=24, num_experts=6, num_experts_per_tok=3,
               moe_intermediate_size=24, shared_expert_intermediate_size=40, tie_word_embeddings=True)
ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < REL_TOL, f"relative max difference {rel:.3g} >= {REL_TOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """Shape A as transformers builds and saves it, weights redrawn so that every one matters (matrices scaled
    by their input width: logits O(1), routing spread); (the dir, the transformers model)."""
    cfg = transformers.Qwen3_5MoeTextConfig(**SHAPE_A, rope_parameters=ROPE)
    torch.manual_seed(31)
    hf = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf-moe") / "tiny-moe"
    hf.save_pretrained(out)
    return out, hf


@pytest.fixture(scope="module")
def ours_a(hf_pair, cache_dir):
    return resolve(str(hf_pair[0]), CPU, torch.float32, cache_dir)


def _published_config(shape: dict) -> dict:
    """config.json as Qwen publishes a Qwen3.5-MoE: the multimodal wrapper, the text model under text_config."""
    layers = shape["num_hidden_layers"]
    interval = shape["full_attention_interval"]
    text = {k: v for k, v in shape.items() if k not in ("tie_word_embeddings", "full_attention_interval")}
    kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    text.update(model_type="qwen3_5_moe_text", full_attention_interval=interval, attn_output_gate=True,
                layer_types=kinds,
                mamba_ssm_dtype="float32", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                router_aux_loss_coef=0.001, output_router_logits=False, eos_token_id=248044, dtype="bfloat16",
                rope_parameters={**ROPE, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "vision_config": {"depth": 1}, "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            "tie_word_embeddings": shape["tie_word_embeddings"], "transformers_version": "4.57.0.dev0"}


def _write_published(model_dir, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The checkpoint as published: model.language_model.* (fused experts), a vision tensor, and the MTP head at
    the top (mtp.*, fused experts too)."""
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    named = {(k if k.startswith(("mtp.", "lm_head.")) else f"model.language_model.{k}"): v.contiguous()
             for k, v in tensors.items()}
    named["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(named, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def published_b(tmp_path_factory):
    """Shape B on presets.random_tensors, written as published; (the dir, the tensors)."""
    config = _published_config(SHAPE_B)
    tensors = presets.random_tensors(parse_config(config), seed=7)
    model_dir = tmp_path_factory.mktemp("published-moe") / "tiny-moe-b"
    _write_published(model_dir, config, tensors)
    return model_dir, tensors


# ---- config and layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [SHAPE_A, SHAPE_B], ids=["shape-a", "shape-b"])
def test_expected_shapes_are_transformers_parameters(shape):
    """Every canonical name and shape is a parameter of transformers' model of the config (prefix model.), and
    nothing of it is missing: fused experts [E, 2I, H] and [E, H, I], router, shared expert and its gate."""
    cfg = parse_config({**shape, "model_type": "qwen3_5_moe_text"})
    with torch.device("meta"):
        hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**shape, rope_parameters=ROPE))
    theirs = {name.removeprefix("model."): tuple(p.shape) for name, p in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert expected_shapes(cfg) == theirs
    assert theirs["layers.0.mlp.experts.gate_up_proj"] == (shape["num_experts"], 2 * shape["moe_intermediate_size"],
                                                            shape["hidden_size"])


def test_the_published_config_nesting_is_read():
    cfg = parse_config(_published_config(SHAPE_B))
    assert isinstance(cfg, MoeTextConfig)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (6, 3, 24, 40)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert cfg.tie_word_embeddings and cfg.rotary_dim == 4 and cfg.mrope_section == (11, 11, 10)
    assert cfg.intermediate_size == 3 * 24 + 40  # the MLP's active width a token (the sizing's)
    assert cfg.mtp_num_hidden_layers == 1  # the checkpoint's MTP head is kept (test_qwen3_5_moe_mtp.py)


def test_the_35b_preset_has_the_published_shape():
    cfg = parse_config(presets.preset_config_dict("qwen3.5-35b-a3b"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (2048, 40, 248320)
    assert not cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (16, 2, 256, 64)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert cfg.attention_layers == tuple(range(3, 40, 4))
    assert is_preset("35B-A3B") and is_preset("qwen3.6-35b-a3b") and not is_preset("qwen3.5-9b")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update(num_expert=4), "unknown field 'num_expert'"),
    (lambda t: t.pop("num_experts"), "missing required field 'num_experts'"),
    (lambda t: t.update(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds num_experts 6"),
    (lambda t: t.update(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (lambda t: t.update(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported"),
    (lambda t: t.update(moe_intermediate_size=0), "'moe_intermediate_size' must be a positive int"),
    (lambda t: t.update(model_type="qwen3_5_text"), "model_type 'qwen3_5_text' is not a Qwen3.5-MoE text model"),
], ids=["unknown-field", "no-experts", "top-k-past-experts", "unnormalised-top-k", "dense-layers", "zero-width",
        "dense-text-type"])
def test_a_config_qse_cannot_serve_is_refused_by_name(edit, message):
    config = _published_config(SHAPE_B)
    edit(config["text_config"])
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(config)


# ---- forward against transformers ----------------------------------------------------------------------------
def test_the_registry_loads_what_transformers_wrote_and_agrees(hf_pair, ours_a):
    """resolve(dir) of model_type qwen3_5_moe_text: this family, experts stacked from one tensor an expert; a
    300-token prefill's logits as transformers', fp32."""
    model_dir, hf = hf_pair
    assert family_of_dir(model_dir) == "qwen3_5_moe" and ours_a.family == "qwen3_5_moe"
    model = ours_a.model
    assert isinstance(model, Qwen35MoeModel)
    ids = _ids(300, SHAPE_A["vocab_size"])
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    _assert_close(model.forward(ids, model.new_cache(), "all"), ref)


def test_chunked_prefill_and_decode_equal_one_shot_and_transformers(hf_pair, ours_a):
    """Chunks of 7 and 64 with the state carried, then one-token decode steps: the logits of a one-shot prefill
    (within rounding) and transformers'."""
    _, hf = hf_pair
    model = ours_a.model
    ids = _ids(200, SHAPE_A["vocab_size"], seed=1)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    one_shot = model.forward(ids, model.new_cache(), "all")
    for chunk in (7, 64):
        cache = model.new_cache()
        parts = [model.forward(ids[s : min(s + chunk, 180)], cache, "all") for s in range(0, 180, chunk)]
        parts += [model.forward(ids[i : i + 1], cache, "all") for i in range(180, 200)]
        chunked = torch.cat(parts)
        _assert_close(chunked, one_shot)
        _assert_close(chunked, ref)


def test_a_shape_the_tests_never_saw_as_published(published_b, cache_dir):
    """Shape B, written as Qwen publishes it (nested config, model.language_model. names, fused experts, a vision
    tower skipped, the MTP head kept): loaded by the registry, against transformers on the same tensors."""
    model_dir, tensors = published_b
    resolved = resolve(str(model_dir), CPU, torch.float32, cache_dir)
    model = resolved.model
    assert resolved.family == "qwen3_5_moe" and model.skipped_tensors == 1
    assert model.mtp_tensors == len(expected_mtp_shapes(model.cfg)) > 0
    assert torch.equal(model.w["layers.1.mlp.experts.down_proj"], tensors["layers.1.mlp.experts.down_proj"])
    hf = reference_model(model)
    shared = hf.model.layers[1].mlp.experts.gate_up_proj  # the pair holds one copy of the weights
    assert shared.data_ptr() == model.w["layers.1.mlp.experts.gate_up_proj"].data_ptr()
    ids = _ids(150, SHAPE_B["vocab_size"], seed=2)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    _assert_close(model.forward(ids, model.new_cache(), "all"), ref)


def test_fused_and_one_expert_checkpoints_load_the_same_weights(hf_pair, ours_a, tmp_path, cache_dir):
    model_dir, _ = hf_pair
    state = load_file(str(model_dir / "model.safetensors"))
    fused = {}
    for name, t in state.items():
        if ".mlp.experts." not in name:
            fused[name] = t
    for layer in range(SHAPE_A["num_hidden_layers"]):
        e = f"model.layers.{layer}.mlp.experts."
        experts = range(SHAPE_A["num_experts"])
        fused[e + "gate_up_proj"] = torch.stack([torch.cat([state[f"{e}{j}.gate_proj.weight"],
                                                            state[f"{e}{j}.up_proj.weight"]]) for j in experts])
        fused[e + "down_proj"] = torch.stack([state[f"{e}{j}.down_proj.weight"] for j in experts])
    out = tmp_path / "fused"
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    save_file(fused, str(out / "model.safetensors"))
    again = resolve(str(out), CPU, torch.float32, cache_dir).model
    assert again.w.keys() == ours_a.model.w.keys()
    assert all(torch.equal(again.w[k], ours_a.model.w[k]) for k in again.w)


def test_the_cast_twin_is_the_same_model_in_float64(ours_a):
    model = ours_a.model
    twin = model.cast(torch.float64)
    assert isinstance(twin, Qwen35MoeModel) and twin.dtype == torch.float64
    ids = _ids(40, SHAPE_A["vocab_size"], seed=3)
    _assert_close(twin.forward(ids, twin.new_cache(), "all").float(), model.forward(ids, model.new_cache(), "all"))


def test_a_checkpoint_with_its_own_tokenizer_is_checked_against_this_config(hf_pair, published_b, finetune_dir,
                                                                             tmp_path, cache_dir):
    """The chat format reads this family's config.json (vocab_size) beside the checkpoint's tokenizer.json: a
    512-id tokenizer fits shape B's 640 rows, and is refused by name over shape A's 300."""
    from qse.models.qwen3_5.chat import TokenizerError

    for source, name in ((published_b[0], "b"), (hf_pair[0], "a")):
        model_dir = tmp_path / name
        shutil.copytree(source, model_dir)
        shutil.copy(finetune_dir / "tokenizer.json", model_dir / "tokenizer.json")
        if name == "b":
            assert resolve(str(model_dir), CPU, torch.float32, cache_dir).chat.sources["tokenizer"].endswith(
                "tokenizer.json")
        else:
            with pytest.raises(TokenizerError, match="past the model's 300 embedding rows"):
                resolve(str(model_dir), CPU, torch.float32, cache_dir)


# ---- presets and the registry ---------------------------------------------------------------------------------
def test_the_registry_resolves_the_35b_preset_at_its_full_shape(cache_dir):
    """On the meta device: the preset's whole model without its memory; its weights are what the planner was
    told before building it (preset_weights_nbytes), 35.5B parameters: 34.7B and the MTP head's 0.84B."""
    resolved = resolve("35b-a3b", torch.device("meta"), torch.bfloat16, cache_dir)
    assert resolved.family == "qwen3_5_moe" and resolved.source == "preset"
    model = resolved.model
    assert model.w["layers.0.mlp.experts.gate_up_proj"].shape == (256, 1024, 2048)
    nbytes = preset_weights_nbytes("qwen3.5-35b-a3b", torch.bfloat16)
    assert model.weights_nbytes() == nbytes == 2 * (34_660_610_688 + 844_640_768)
    assert model.w["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (256, 1024, 2048)
    assert preset_weights_nbytes("35B-A3B", torch.float32) == 2 * nbytes
    assert preset_weights_nbytes("397b-a17b", torch.bfloat16) > 790e9
    dense = resolve("qwen3.5-9b", torch.device("meta"), torch.bfloat16, cache_dir).model  # the dense family's
    assert "mtp.fc.weight" in dense.lin and preset_weights_nbytes("qwen3.5-9b", torch.bfloat16) == dense.weights_nbytes()


def test_random_preset_weights_keep_activations_unit_and_routing_spread():
    """The presets' random weights at a mid shape: every MLP input and output of O(1) RMS through the layers, and
    the router spreads 256 tokens over every expert, none taking more than three times its share."""
    shape = dict(SHAPE_A, vocab_size=1000, hidden_size=256, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64, model_type="qwen3_5_moe_text")
    cfg = parse_config(shape)
    model = Qwen35MoeModel(cfg, presets.random_weights(cfg, 0, CPU, torch.float32), CPU, torch.float32)
    from qse_kernels.moe_naive import moe_route

    seen = []

    def watched(h, router_w, *rest):
        out = block(h, router_w, *rest)
        ids, _ = moe_route(h @ router_w.t(), cfg.num_experts_per_tok)
        seen.append((h.pow(2).mean().sqrt().item(), out.pow(2).mean().sqrt().item(), ids))
        return out

    block, model.moe_block = model.moe_block, watched
    logits = model.forward(_ids(256, 1000), model.new_cache(), "all")
    assert torch.isfinite(logits).all() and len(seen) == cfg.num_hidden_layers
    for rms_in, rms_out, ids in seen:
        assert 0.3 < rms_in < 3 and 0.1 < rms_out < 10, (rms_in, rms_out)
        counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
        assert (counts > 0).all() and counts.max() < 3 * ids.numel() / cfg.num_experts, counts.tolist()


# ---- bad checkpoints ------------------------------------------------------------------------------------------
def _drop(name):
    return lambda state: state.pop(name)


def _reshape(name, shape):
    return lambda state: state.__setitem__(name, torch.zeros(shape))


def _assert_refused(source, tmp_path, cache_dir, edit, message):
    """`source`'s checkpoint with `edit` applied, written to tmp_path: resolve refuses it, saying `message`."""
    state = load_file(str(source / "model.safetensors"))
    edit(state)
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        resolve(str(tmp_path), CPU, torch.float32, cache_dir)


@pytest.mark.parametrize("edit,message", [
    (_drop("model.language_model.layers.1.mlp.experts.down_proj"),
     "missing tensor 'layers.1.mlp.experts.down_proj' (shape (6, 48, 24))"),
    (_reshape("model.language_model.layers.0.mlp.experts.gate_up_proj", (5, 48, 48)),
     "tensor 'layers.0.mlp.experts.gate_up_proj' has shape (5, 48, 48), expected (6, 48, 48)"),
    (_drop("model.language_model.layers.2.mlp.shared_expert_gate.weight"),
     "missing tensor 'layers.2.mlp.shared_expert_gate.weight'"),
    (_reshape("model.language_model.layers.0.mlp.gate.weight", (6, 40)),
     "tensor 'layers.0.mlp.gate.weight' has shape (6, 40), expected (6, 48)"),
    (_reshape("model.language_model.layers.0.mlp.dense.weight", (6, 40)), "unexpected tensor"),
    (_reshape("model.language_model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv", (1, 1)),
     "is an FP8 block scale"),
], ids=["missing-experts", "experts-wrong-shape", "missing-shared-gate", "router-wrong-shape", "unknown-tensor",
        "fp8"])
def test_a_bad_fused_checkpoint_names_the_tensor(published_b, tmp_path, cache_dir, edit, message):
    _assert_refused(published_b[0], tmp_path, cache_dir, edit, message)


@pytest.mark.parametrize("edit,message", [
    (_drop("model.layers.2.mlp.experts.5.up_proj.weight"), "missing tensor 'layers.2.mlp.experts.5.up_proj.weight'"),
    (_reshape("model.layers.0.mlp.experts.3.down_proj.weight", (64, 31)),
     "tensor 'model.layers.0.mlp.experts.3.down_proj.weight' has shape (64, 31), expected (64, 32)"),
    (_reshape("model.layers.0.mlp.experts.8.gate_proj.weight", (32, 64)), "names expert 8; the config has 8"),
    (_reshape("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64)), "holds both fused experts and one-expert"),
], ids=["missing-expert", "expert-wrong-shape", "expert-past-the-last", "both-forms"])
def test_a_bad_one_expert_checkpoint_names_the_tensor(hf_pair, tmp_path, cache_dir, edit, message):
    _assert_refused(hf_pair[0], tmp_path, cache_dir, edit, message)


def test_reference_config_is_the_models_shape(ours_a):
    ref_cfg = reference_config(ours_a.model)
    assert (ref_cfg.num_experts, ref_cfg.num_experts_per_tok, ref_cfg.moe_intermediate_size) == (8, 2, 32)
    assert ref_cfg.layer_types == list(ours_a.model.cfg.layer_types)
