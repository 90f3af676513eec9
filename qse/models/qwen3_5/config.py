"""Strict reader of a Qwen3.5 `config.json` (text model under `text_config` or at the top level).

Every field the engine needs lands in `TextConfig`; the rest of the engine asks `TextConfig`, never
the raw JSON. A field this reader does not know is refused by name: a new checkpoint format must be
looked at, not silently half-read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..family import read_json


class ConfigError(ValueError):
    """config.json cannot be read as a Qwen3.5 text model."""


# Fields of the text config that change the arithmetic: read into TextConfig.
_TEXT_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "partial_rotary_factor", "rope_scaling",
    "attention_bias", "attn_output_gate", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "layer_types",
    "full_attention_interval", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
    "eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype", "mamba_ssm_dtype",
}
# Fields that do not change inference (training knobs, bookkeeping written by save_pretrained).
_TEXT_IGNORED = {
    "model_type", "initializer_range", "use_cache", "attention_dropout", "transformers_version",
    "architectures", "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "_name_or_path",
    "base_config_key", "layer_norm_epsilon", "router_aux_loss_coef", "decoder_start_token_id",
    "sep_token_id", "task_specific_params", "finetuning_task", "use_sliding_window",
}
# Fields of the top-level multimodal wrapper (Qwen3_5ForConditionalGeneration).
_WRAPPER_FIELDS = {
    "text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "tie_word_embeddings", "model_type", "architectures", "transformers_version",
    "dtype", "torch_dtype", "use_cache", "initializer_range", "output_hidden_states", "output_attentions",
    "return_dict", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "is_encoder_decoder",
    "id2label", "label2id", "chunk_size_feed_forward", "problem_type", "tokenizer_class",
}
_MODEL_TYPES = {"qwen3_5", "qwen3_5_text"}
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attn_output_gate: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # derived sizes, named once
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        return out


def _check_known(where: str, data: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}"
            + (f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else "")
            + "; qse reads Qwen3.5 configs only and refuses fields it does not understand"
        )


def require_field(where: str, data: dict[str, Any], name: str, kind: type, positive: bool = False) -> Any:
    """data[name], of type `kind` (an int is taken for a float, a bool is no int) and above 0 where `positive`."""
    if name not in data:
        raise ConfigError(f"{where}: missing required field {name!r}")
    value = data[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or (positive and value <= 0):
        raise ConfigError(f"{where}: field {name!r} must be {'a positive ' if positive else ''}{kind.__name__}, "
                          f"got {value!r}")
    return value


def parse_config(raw: dict[str, Any], where: str = "config.json") -> TextConfig:
    """Turn a config.json dict into a TextConfig, refusing what it does not know."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    top_type = raw.get("model_type")
    if top_type is not None and top_type not in _MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {top_type!r} is not a Qwen3.5 model (expected one of {sorted(_MODEL_TYPES)})")
    wrapper_tie = None
    if "text_config" in raw:
        _check_known(where, raw, _WRAPPER_FIELDS)
        wrapper_tie = raw.get("tie_word_embeddings")
        text = raw["text_config"]
        where = f"{where}: text_config"
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: expected an object")
    else:
        text = raw
    _check_known(where, text, _TEXT_FIELDS | _TEXT_IGNORED)

    num_layers = require_field(where, text, "num_hidden_layers", int)
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    for t in layer_types:
        if t not in ("full_attention", "linear_attention"):
            raise ConfigError(f"{where}: unknown layer type {t!r} (expected full_attention or linear_attention)")

    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    _check_known(f"{where}: rope_parameters", rope, _ROPE_KEYS)
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_type {rope['rope_type']!r} is not supported (expected 'default')")
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    if text.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true is not supported")
    if text.get("attn_output_gate", True) is not True:
        raise ConfigError(f"{where}: attn_output_gate must be true for Qwen3.5")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {text['hidden_act']!r} is not supported (expected 'silu')")

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tie = text.get("tie_word_embeddings", wrapper_tie if wrapper_tie is not None else False)
    hidden = require_field(where, text, "hidden_size", int)
    heads = require_field(where, text, "num_attention_heads", int)
    cfg = TextConfig(
        vocab_size=require_field(where, text, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=require_field(where, text, "intermediate_size", int),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=require_field(where, text, "num_key_value_heads", int),
        head_dim=int(text.get("head_dim") or hidden // heads),
        layer_types=tuple(layer_types),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(tie),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 16)),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
        eos_token_ids=eos_ids,
        dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(f"{where}: linear_num_value_heads is not a multiple of linear_num_key_heads")
    if cfg.rotary_dim % 2:
        raise ConfigError(f"{where}: rotary dim {cfg.rotary_dim} must be even")
    return cfg


def read_config_json(model_dir: Path) -> tuple[Any, str]:
    """A checkpoint dir's config.json as JSON, and where it is (what a reader's errors name)."""
    path = Path(model_dir) / "config.json"
    missing = f"{path}: not found; --model must name a checkpoint directory with a config.json"
    return read_json(path, ConfigError, missing), str(path)


def load_config(model_dir: Path) -> TextConfig:
    return parse_config(*read_config_json(model_dir))
