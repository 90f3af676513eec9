"""Named shapes of the published Qwen3.5-MoE models and random weights for them.

Weights do not change the cost of a forward, so benchmarks run random weights of the published shapes. The
random router is scaled so that a normed hidden state's logits are O(1) and independent across experts: every
token picks its own top-k, spread over all experts (no expert collapse, no ties). Every preset has the published
MTP head (one MoE decoder layer of the main layers' expert count, top-k and widths: layout.expected_mtp_shapes),
its random tensors drawn after the model's (the model's bytes are the same with or without it).
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from ..linear import DenseLinear
from ..qwen3_5.layout import LoadedWeights, is_linear
from ..qwen3_5.presets import _COMMON, is_norm_weight
from .config import MoeTextConfig
from .layout import weight_shapes

# published config.json text_config values (Qwen/Qwen3.5-*-A*B; Qwen3.6-35B-A3B has the 35B-A3B's shape)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "qwen3.5-122b-a10b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                              linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256,
                              num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    "qwen3.5-397b-a17b": dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
                              linear_num_key_heads=16, linear_num_value_heads=64, num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
}
PRESET_ALIASES = {"35b-a3b": "qwen3.5-35b-a3b", "122b-a10b": "qwen3.5-122b-a10b", "397b-a17b": "qwen3.5-397b-a17b",
                  "qwen3.6-35b-a3b": "qwen3.5-35b-a3b"}


def preset_config_dict(name: str) -> dict[str, Any]:
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return {**_COMMON, **PRESETS[key], "tie_word_embeddings": False, "model_type": "qwen3_5_moe_text"}


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3.5-MoE (tests, benchmarks' CPU rehearsals): one layer of each kind twice, eight experts two a
    token, a shared expert wider than them, a vocabulary of 328 (the heads' masked tails, as the kernel tests'
    small model), an untied head, an MTP head as published; `num_hidden_layers=2` keeps one layer of each kind,
    `mtp_num_hidden_layers=0` drops the head."""
    shape = dict(vocab_size=328, hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                 linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 tie_word_embeddings=False, mtp_num_hidden_layers=1)
    return {**shape, "model_type": "qwen3_5_moe_text", **overrides}


def random_tensors(cfg: MoeTextConfig, seed: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, progress: str | None = None) -> dict[str, torch.Tensor]:
    """Deterministic random weights of cfg's shapes (same seed, device kind and dtype -> same bytes), on the
    dense family's rules (qwen3_5/presets.py) with every matrix scaled by its input width (the last dim: an
    expert stack's too); the MTP head's after the model's. On the meta device: shapes only (what a planner or a
    test sizes without memory)."""
    device = torch.device(device)
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)

    def randn(shape, scale):
        if gen is None:
            return torch.empty(shape, device=device)
        return torch.randn(shape, device=device, generator=gen) * scale

    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(weight_shapes(cfg).items(), desc=progress, unit="tensor",
                            disable=None if progress else True):
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device)
            t = t if gen is None else t.uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
            t = torch.ones(shape, device=device)
        elif is_norm_weight(name):  # zero-centred RMSNorm: 0 is the identity scale
            t = randn(shape, 0.05)
        elif name.endswith("conv1d.weight"):
            t = randn(shape, shape[-1] ** -0.5)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            t = randn(shape, 0.02)
        else:  # projections, router, experts: activations O(1) through the layers, router logits O(1)
            t = randn(shape, shape[-1] ** -0.5)
        out[name] = t.to(dtype)
    return out


def random_weights(cfg: MoeTextConfig, seed: int, device: torch.device | str, dtype: torch.dtype) -> LoadedWeights:
    tensors, linears = {}, {}
    for name, t in random_tensors(cfg, seed, device, dtype, progress="qse: random weights").items():
        if is_linear(name):
            linears[name] = DenseLinear(t)
        else:
            tensors[name] = t
    return LoadedWeights(tensors=tensors, linears=linears)


__all__ = ["PRESETS", "PRESET_ALIASES", "preset_config_dict", "random_tensors", "random_weights"]
