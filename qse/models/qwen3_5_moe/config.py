"""Strict reader of a Qwen3.5-MoE `config.json` (text model under `text_config`, as Qwen publishes it, or at the
top level, as transformers' Qwen3_5MoeForCausalLM saves it).

The attention and GDN fields are the dense family's, read by its own reader (qse/models/qwen3_5/config.py): this
one takes the MoE fields out, checks them, hands the rest over, and returns both in one `MoeTextConfig`. A field
neither reader knows is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..qwen3_5.config import ConfigError, TextConfig, read_config_json, require_field
from ..qwen3_5.config import parse_config as parse_dense_config

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
# fields some MoE configs carry that must hold the one value this family computes (Qwen3-Next's spellings)
_MOE_FIXED: dict[str, Any] = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
# read and dropped: a training knob, and a dense MLP width some converters write (no layer has a dense MLP)
_MOE_IGNORED = ("output_router_logits", "intermediate_size")


@dataclass(frozen=True)
class MoeTextConfig(TextConfig):
    """TextConfig plus the sparse MLP every layer has: `num_experts` routed experts of `moe_intermediate_size`,
    `num_experts_per_tok` of them a token (softmax over all, renormalised over the chosen), and one shared expert
    of `shared_expert_intermediate_size` behind a sigmoid gate.

    intermediate_size (TextConfig's) is the MLP's active width a token, num_experts_per_tok x
    moe_intermediate_size + shared_expert_intermediate_size: what the activation sizing reads
    (qse/core/sizing.py). mtp_num_hidden_layers is the config's (1 in every published checkpoint): the MTP head
    is one more decoder layer with a sparse MLP of these same sizes (layout.py), kept and served (model.py)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0


def parse_config(raw: dict[str, Any], where: str = "config.json") -> MoeTextConfig:
    """Turn a Qwen3.5-MoE config.json dict into a MoeTextConfig, refusing what it does not know."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    top_type = raw.get("model_type")
    if top_type is not None and top_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {top_type!r} is not a Qwen3.5-MoE model (expected one of "
                          f"{list(MODEL_TYPES)})")
    nested = "text_config" in raw
    text = raw["text_config"] if nested else raw
    text_where = f"{where}: text_config" if nested else where
    if not isinstance(text, dict):
        raise ConfigError(f"{text_where}: expected an object")
    text_type = text.get("model_type") if nested else None
    if text_type is not None and text_type not in MODEL_TYPES:
        raise ConfigError(f"{text_where}: model_type {text_type!r} is not a Qwen3.5-MoE text model")

    moe = {name: require_field(text_where, text, name, int, positive=True) for name in _MOE_REQUIRED}
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ConfigError(f"{text_where}: num_experts_per_tok {moe['num_experts_per_tok']} exceeds num_experts "
                          f"{moe['num_experts']}")
    for name, value in _MOE_FIXED.items():
        if name in text and text[name] != value:
            raise ConfigError(f"{text_where}: {name}={text[name]!r} is not supported (qse computes {name}={value!r})")

    dense_text = {k: v for k, v in text.items() if k not in (*_MOE_REQUIRED, *_MOE_FIXED, *_MOE_IGNORED)}
    dense_text["model_type"] = "qwen3_5_text"
    dense_text["intermediate_size"] = (moe["num_experts_per_tok"] * moe["moe_intermediate_size"]
                                       + moe["shared_expert_intermediate_size"])
    if nested:
        dense_raw = {**raw, "text_config": dense_text}
        if top_type is not None:
            dense_raw["model_type"] = "qwen3_5"
    else:
        dense_raw = dense_text
    base = parse_dense_config(dense_raw, where)
    return MoeTextConfig(**{f.name: getattr(base, f.name) for f in fields(TextConfig)}, **moe)


def load_config(model_dir: Path) -> MoeTextConfig:
    return parse_config(*read_config_json(model_dir))


__all__ = ["ConfigError", "MODEL_TYPES", "MoeTextConfig", "load_config", "parse_config"]
