"""The MTP head's weights (issue 30, item 1): presets build them in the published shape, the loader keeps and
checks them, and the model's own tensors and forward do not change with a head beside them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qse.models.qwen3_5 import load
from qse.models.qwen3_5.config import parse_config
from qse.models.qwen3_5.layout import CheckpointError, expected_mtp_shapes
from qse.models.qwen3_5.presets import embedded_config_dict, preset_config_dict, random_tensors, write_checkpoint


def test_every_preset_has_the_published_mtp_head():
    cfg = parse_config(preset_config_dict("qwen3.5-9b"))
    shapes = expected_mtp_shapes(cfg)
    assert cfg.mtp_num_hidden_layers == 1
    assert shapes["mtp.fc.weight"] == (4096, 8192)  # [H, 2H]: the normalised embedding and hidden state
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        assert shapes[norm] == (4096,)
    layer = "mtp.layers.0."
    assert shapes[layer + "self_attn.q_proj.weight"] == (2 * 16 * 256, 4096)  # gated: queries and their gate
    assert shapes[layer + "self_attn.k_proj.weight"] == (4 * 256, 4096)
    assert shapes[layer + "mlp.down_proj.weight"] == (4096, 12288)
    assert not any("linear_attn" in n for n in shapes)  # a full-attention layer, never a GDN one
    assert not any(n.startswith("mtp.layers.1.") for n in shapes)
    for name in ("qwen3.5-0.8b", "qwen3.5-27b"):
        assert parse_config(preset_config_dict(name)).mtp_num_hidden_layers == 1
    # the embedded default stays without one (its checkpoint and fingerprints are those version 1 wrote)
    assert expected_mtp_shapes(parse_config(embedded_config_dict())) == {}


def _tiny_with_mtp() -> dict:
    return {**embedded_config_dict(), "mtp_num_hidden_layers": 1}


def test_random_weights_add_the_head_after_the_model_and_leave_the_model_alone():
    with_head = parse_config(_tiny_with_mtp())
    plain = random_tensors(parse_config(embedded_config_dict()), seed=7)
    headed = random_tensors(with_head, seed=7)
    assert set(headed) - set(plain) == set(expected_mtp_shapes(with_head))
    assert all(torch.equal(plain[n], headed[n]) for n in plain)  # the model's bytes, head or not
    assert all(tuple(headed[n].shape) == s for n, s in expected_mtp_shapes(with_head).items())


@pytest.fixture()
def headed_dir(tmp_path):
    config = _tiny_with_mtp()
    write_checkpoint(tmp_path / "headed", config, random_tensors(parse_config(config), seed=7))
    return tmp_path / "headed"


def test_the_loader_keeps_the_head_and_the_forward_is_the_models(headed_dir, tmp_path):
    model = load(headed_dir, "cpu", torch.float32)
    names = set(model.w) | set(model.lin)
    assert {n for n in names if n.startswith("mtp.")} == set(expected_mtp_shapes(model.cfg))
    assert model.mtp_tensors == len(expected_mtp_shapes(model.cfg))
    on_disk = load_file(headed_dir / "model.safetensors")
    assert "mtp.fc.weight" in on_disk and "model.mtp.fc.weight" not in on_disk  # the published names
    assert torch.equal(model.lin["mtp.fc.weight"].weight, on_disk["mtp.fc.weight"])
    # the same checkpoint without the head (its config says none): the same logits, bit for bit
    plain_dir = tmp_path / "plain"
    config = embedded_config_dict()
    write_checkpoint(plain_dir, config, random_tensors(parse_config(config), seed=7))
    plain = load(plain_dir, "cpu", torch.float32)
    ids = torch.arange(40)
    assert torch.equal(model.forward(ids, model.new_cache(), "all"), plain.forward(ids, plain.new_cache(), "all"))


def _rewrite(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


def test_a_missing_or_misshapen_head_tensor_is_named(headed_dir):
    _rewrite(headed_dir, lambda t: t.pop("mtp.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.layers\.0\.self_attn\.k_proj\.weight'"):
        load(headed_dir, "cpu", torch.float32)


def test_a_head_of_the_wrong_shape_is_named(headed_dir):
    _rewrite(headed_dir, lambda t: t.__setitem__("mtp.fc.weight", torch.zeros(64, 64)))
    with pytest.raises(CheckpointError, match=r"'mtp\.fc\.weight' has shape \(64, 64\), expected \(64, 128\)"):
        load(headed_dir, "cpu", torch.float32)


def test_a_head_tensor_the_layout_does_not_know_is_refused(headed_dir):
    _rewrite(headed_dir, lambda t: t.__setitem__("mtp.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        load(headed_dir, "cpu", torch.float32)


def test_a_config_without_a_head_leaves_its_tensors_on_disk(headed_dir):
    config = json.loads((headed_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 0
    (headed_dir / "config.json").write_text(json.dumps(config))
    model = load(headed_dir, "cpu", torch.float32)
    assert not any(n.startswith("mtp.") for n in [*model.w, *model.lin])
    assert model.mtp_tensors == len(expected_mtp_shapes(parse_config(_tiny_with_mtp())))  # recognised, counted
