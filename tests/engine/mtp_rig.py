"""The MTP tests' tiny models (tests/engine/test_mtp_drafter.py, test_mtp_rounds.py, the served MTP tests): the
tensors of a served model whose MTP head's drafts agree with it often, dense (Qwen3.5) or MoE (Qwen3.5-MoE)."""

from __future__ import annotations

import torch


# a layer's output projections by name ending: attention, GDN, the MLP (dense, a shared expert, fused experts)
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
_MLP_OUTPUTS = ("down_proj.weight", "experts.down_proj")


def agreeing_tensors(tensors: dict[str, torch.Tensor], cfg, head_mlp: float = 0.0) -> dict[str, torch.Tensor]:
    """A copy of a tiny Qwen3.5's tensors made into a served model that is nearly a bigram model (a larger
    embedding, the layers' output projections scaled down: the next id depends mostly on the last), and an MTP
    head that is that bigram model on the id it is given: fc passes the embedding's half through, the layer's
    attention adds nothing, its MLP's outputs are scaled by `head_mlp` (0: nothing), and its norm is the model's
    final norm. So the head's drafts agree with the served model often, and not always."""
    t = dict(tensors)
    t["embed_tokens.weight"] = t["embed_tokens.weight"] * 10
    for name in t:
        if name.startswith("layers.") and name.endswith(_OUTPUTS):
            t[name] = t[name] * 0.05
    h = cfg.hidden_size
    t["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    t["mtp.norm.weight"] = t["norm.weight"].clone()
    t["mtp.layers.0.self_attn.o_proj.weight"] = torch.zeros_like(t["mtp.layers.0.self_attn.o_proj.weight"])
    for name in t:
        if name.startswith("mtp.layers.0.mlp.") and name.endswith(_MLP_OUTPUTS):
            t[name] = t[name] * head_mlp if head_mlp else torch.zeros_like(t[name])
    return t


def agreeing_engine(chat, dtype: torch.dtype = torch.float64, device: str = "cpu", **shape):
    """An Engine over a tiny Qwen3.5 with an MTP head (presets.tiny_mtp_config_dict(**shape)) whose weights are
    agreeing_tensors', with `chat` (a ChatFormat: the served paths' stop and turn-end ids, the tokenizer's
    vocabulary): what the served MTP tests serve."""
    from qse.engine.engine import Engine
    from qse.models import ResolvedModel
    from qse.models.qwen3_5 import Qwen35Model, parse_config
    from qse.models.qwen3_5.presets import random_tensors, tiny_mtp_config_dict

    cfg = parse_config(tiny_mtp_config_dict(**shape))
    tensors = {n: t.to(device, dtype) for n, t in agreeing_tensors(random_tensors(cfg, seed=5), cfg).items()}
    model = Qwen35Model(cfg, _weights(tensors), device, dtype)
    return Engine(ResolvedModel(model, chat, "tiny-mtp", "random", model.family, f"tiny-mtp-{device}"))


def agreeing_moe_engine(chat, dtype: torch.dtype = torch.float64, device: str = "cpu", head_mlp: float = 0.2,
                        **shape):
    """agreeing_engine's MoE twin: a tiny Qwen3.5-MoE with its MTP head (qwen3_5_moe presets.tiny_config_dict(
    **shape)) on agreeing_tensors, the head's sparse block kept small but not zero (`head_mlp`): its router,
    experts and shared expert count in every draft."""
    from qse.engine.engine import Engine
    from qse.models import ResolvedModel
    from qse.models.qwen3_5_moe import Qwen35MoeModel, parse_config
    from qse.models.qwen3_5_moe.presets import random_tensors, tiny_config_dict

    cfg = parse_config(tiny_config_dict(**shape))
    tensors = {n: t.to(device, dtype) for n, t in agreeing_tensors(random_tensors(cfg, 5), cfg, head_mlp).items()}
    model = Qwen35MoeModel(cfg, _weights(tensors), device, dtype)
    return Engine(ResolvedModel(model, chat, "tiny-moe-mtp", "random", model.family, f"tiny-moe-mtp-{device}"))


def _weights(tensors: dict[str, torch.Tensor]):
    from qse.models.linear import DenseLinear
    from qse.models.qwen3_5.layout import LoadedWeights, is_linear

    return LoadedWeights({n: t for n, t in tensors.items() if not is_linear(n)},
                         {n: DenseLinear(t) for n, t in tensors.items() if is_linear(n)})
