"""transformers' Qwen3_5ForCausalLM on the very tensors a qse model holds (a test/bench dependency)."""

from __future__ import annotations

import torch

from .model import Qwen35Model


def reference_model(model: Qwen35Model):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = model.cfg
    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, layer_types=list(cfg.layer_types),
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section), "mrope_interleaved": True},
    )
    with torch.device("meta"):
        hf = Qwen3_5ForCausalLM(hf_cfg)
    state = {}
    for name, t in model.w.items():
        if name != "lm_head.weight":
            state[f"model.{name}"] = t
    for name, lin in model.lin.items():
        weight = lin.weight if hasattr(lin, "weight") and lin.weight.dtype != torch.float8_e4m3fn else lin.dequantize()
        state[f"model.{name}"] = weight
    state["lm_head.weight"] = model.lm_head.weight
    hf.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    hf.model.rotary_emb.original_inv_freq = model.inv_freq.clone()
    return hf.eval()
