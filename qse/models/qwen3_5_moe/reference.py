"""transformers' Qwen3_5MoeForCausalLM on the very tensors a qse model holds (a test/bench dependency): its
parameters are the qse model's tensors (load_state_dict assign=True), so the pair holds one copy of the weights.
transformers' model has no MTP head: the qse model's `mtp.*` tensors are left out of it."""

from __future__ import annotations

import torch

from .model import Qwen35MoeModel


def reference_config(model: Qwen35MoeModel, **overrides):
    """The transformers config of `model`'s shape (overrides: more of its fields, e.g. experts_implementation)."""
    from transformers import Qwen3_5MoeTextConfig

    cfg = model.cfg
    return Qwen3_5MoeTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, layer_types=list(cfg.layer_types), linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section), "mrope_interleaved": True},
        **overrides,
    )


def reference_model(model: Qwen35MoeModel, **overrides):
    from transformers import Qwen3_5MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(reference_config(model, **overrides))
    state = {f"model.{name}": t for name, t in model.w.items() if name != "lm_head.weight" and not _is_mtp(name)}
    for name, lin in model.lin.items():
        if not _is_mtp(name):
            state[f"model.{name}"] = lin.weight
    state["lm_head.weight"] = model.lm_head.weight
    hf.load_state_dict(state, strict=True, assign=True)
    if model.cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    hf.model.rotary_emb.original_inv_freq = model.inv_freq.clone()
    return hf.eval()


def _is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


__all__ = ["reference_config", "reference_model"]
