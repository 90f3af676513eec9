"""The strict config reader and the checkpoint layout: what they accept and the one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qse.models import ModelSpecError, resolve
from qse.models.linear import DenseLinear, FP8BlockLinear, quantize_fp8_block
from qse.models.qwen3_5 import load
from qse.models.qwen3_5.config import ConfigError, load_config, parse_config
from qse.models.qwen3_5.layout import CheckpointError
from qse.models.qwen3_5.presets import PRESETS, preset_config_dict


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_published_shapes_parse():
    cfg = parse_config(preset_config_dict("qwen3.5-0.8b"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (1024, 24, 3584)
    assert cfg.attention_layers == (3, 7, 11, 15, 19, 23)
    assert cfg.rotary_dim == 64 and cfg.gdn_conv_dim == 6144 and cfg.tie_word_embeddings
    big = parse_config(preset_config_dict("qwen3.5-27b"))
    assert (big.hidden_size, big.num_hidden_layers, big.linear_num_value_heads) == (5120, 64, 48)
    assert not big.tie_word_embeddings
    assert set(PRESETS) >= {"qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-27b"}


def test_text_config_under_a_multimodal_wrapper():
    text = preset_config_dict("qwen3.5-0.8b")
    text.pop("tie_word_embeddings")
    wrapper = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
               "vision_config": {"depth": 2}, "image_token_id": 248056, "tie_word_embeddings": True}
    cfg = parse_config(wrapper)
    assert cfg.hidden_size == 1024 and cfg.tie_word_embeddings


def test_unknown_field_is_refused_by_name():
    raw = preset_config_dict("qwen3.5-0.8b") | {"sliding_window_size": 4096}
    with pytest.raises(ConfigError, match="unknown field 'sliding_window_size'"):
        parse_config(raw)


def test_unknown_rope_key_and_wrong_types_are_refused():
    raw = preset_config_dict("qwen3.5-0.8b")
    raw["rope_parameters"] = dict(raw["rope_parameters"], yarn_factor=4)
    with pytest.raises(ConfigError, match="yarn_factor"):
        parse_config(raw)
    raw = preset_config_dict("qwen3.5-0.8b") | {"hidden_size": "1024"}
    with pytest.raises(ConfigError, match="'hidden_size' must be int"):
        parse_config(raw)
    raw = preset_config_dict("qwen3.5-0.8b")
    del raw["vocab_size"]
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        parse_config(raw)
    with pytest.raises(ConfigError, match="not a Qwen3.5 model"):
        parse_config({"model_type": "llama"})


def test_missing_config_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_transformers_written_checkpoint_loads(hf_tiny_dir):
    model = load(hf_tiny_dir, "cpu", torch.float32)
    assert model.cfg.num_hidden_layers == 8 and not model.cfg.tie_word_embeddings
    assert all(isinstance(l, DenseLinear) for l in model.lin.values())


def test_missing_tensor_is_named(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir, tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.3\.self_attn\.k_norm\.weight'"):
        load(d, "cpu", torch.float32)


def test_wrong_shape_is_named(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir, tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'layers\.0\.mlp\.up_proj\.weight' has shape \(3, 64\), expected \(128, 64\)"):
        load(d, "cpu", torch.float32)


def test_multimodal_layout_shards_vision_and_mtp(hf_tiny_dir, tmp_path):
    """VL naming (model.language_model.*), a vision tower and an MTP head, split over two shards."""
    d = tmp_path / "vl"
    d.mkdir()
    tensors = load_file(hf_tiny_dir / "model.safetensors")
    renamed = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 8)
    names = sorted(renamed)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    text = json.loads((hf_tiny_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text, "vision_config": {}}))
    vl = load(d, "cpu", torch.float32)
    plain = load(hf_tiny_dir, "cpu", torch.float32)
    assert vl.skipped_tensors == 1 and vl.mtp_tensors == 1
    ids = torch.arange(40)
    assert torch.equal(vl.forward(ids, vl.new_cache(), "all"), plain.forward(ids, plain.new_cache(), "all"))


def test_fp8_block_weights(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir, tmp_path / "fp8")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"
    q, scale = quantize_fp8_block(tensors[name])
    tensors[name] = q
    tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(d / "model.safetensors"))
    model = load(d, "cpu", torch.float32)
    lin = model.lin["layers.0.mlp.gate_proj.weight"]
    assert isinstance(lin, FP8BlockLinear)
    assert lin.shape == (128, 64) and lin.nbytes_per_use == 128 * 64 + 1 * 1 * 4
    dense = tensors[name].to(torch.float32) * scale[0, 0]
    assert torch.allclose(lin.dequantize(), dense)
    x = torch.randn(5, 64)
    assert torch.allclose(lin.matmul(x), x @ dense.T, atol=1e-5)
    # FP8 without its scale is refused by name
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has no 'layers.0.mlp.gate_proj.weight_scale_inv'"):
        load(d, "cpu", torch.float32)


def test_fp8_scale_shape_checked():
    with pytest.raises(ValueError, match=r"expected \(1, 2\)"):
        FP8BlockLinear(torch.zeros(4, 200, dtype=torch.float8_e4m3fn), torch.ones(1, 1))


def test_model_spec_errors(cache_dir, tmp_path):
    with pytest.raises(ModelSpecError, match="neither a checkpoint directory nor a preset"):
        resolve("no-such-model", torch.device("cpu"), torch.float32, cache_dir)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSpecError, match="model_type 'llama'"):
        resolve(str(tmp_path), torch.device("cpu"), torch.float32, cache_dir)


def test_groups_with_an_fp8_member_stay_unfused_and_read_the_same(hf_tiny_dir, tmp_path):
    """A projection group with an FP8 member is not concatenated: its members run one by one (the GDN
    input projections, the attention q/k/v and the MLP gate/up alike), and the forward equals that of a
    dense checkpoint holding the dequantised weights."""
    names = ["model.layers.0.linear_attn.in_proj_z.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.0.mlp.up_proj.weight"]
    fp8_dir, dense_dir = _copy(hf_tiny_dir, tmp_path / "fp8"), _copy(hf_tiny_dir, tmp_path / "dense")
    fp8, dense = load_file(fp8_dir / "model.safetensors"), load_file(dense_dir / "model.safetensors")
    for name in names:
        q, scale = quantize_fp8_block(fp8[name])
        fp8[name], fp8[name + "_scale_inv"] = q, scale
        dense[name] = FP8BlockLinear(q, scale, compute_dtype=torch.float32).dequantize()
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(dense, str(dense_dir / "model.safetensors"))
    quantized, plain = load(fp8_dir, "cpu", torch.float32), load(dense_dir, "cpu", torch.float32)
    for group in ("layers.0.linear_attn.in_proj", "layers.3.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"):
        assert group not in quantized.fused and group in plain.fused
    assert "layers.1.linear_attn.in_proj" in quantized.fused
    ids = torch.arange(40)
    got, want = quantized.forward(ids, quantized.new_cache(), "all"), plain.forward(ids, plain.new_cache(), "all")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
