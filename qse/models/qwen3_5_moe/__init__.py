"""The qwen3_5_moe family on the adapter path: Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B). Config, layout and
forward are the dense family's with a sparse MLP in every layer (model.py); the text format is Qwen3.5's."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..qwen3_5 import ChatFormat as _DenseChatFormat
from .config import MODEL_TYPES, ConfigError, MoeTextConfig, load_config, parse_config
from .layout import CheckpointError, expected_shapes, load_weights
from .model import Qwen35MoeModel
from .presets import PRESET_ALIASES, PRESETS, preset_config_dict, random_weights


def load(model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> Qwen35MoeModel:
    cfg = load_config(Path(model_dir))
    return Qwen35MoeModel(cfg, load_weights(Path(model_dir), cfg, device, dtype), device, dtype)


def build_preset(name: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> Qwen35MoeModel:
    """A preset's shape on random weights (presets.py); on the meta device, its shapes without memory."""
    cfg = parse_config(preset_config_dict(name), where=f"preset {name}")
    return Qwen35MoeModel(cfg, random_weights(cfg, seed, device, dtype), device, dtype)


def preset_weights_nbytes(name: str, dtype: torch.dtype) -> int:
    """What a preset's weights will hold at `dtype`, from its shapes alone (the residency planner's claim)."""
    cfg = parse_config(preset_config_dict(name), where=f"preset {name}")
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in expected_shapes(cfg).values()) * size


def is_preset(name: str) -> bool:
    return name.lower() in PRESETS or name.lower() in PRESET_ALIASES


class ChatFormat(_DenseChatFormat):
    """Qwen3.5's text format (the dense family's ChatFormat: the checkpoint's tokenizer, template and generation
    defaults where it has them), its tokenizer checked against this family's config.json."""

    @staticmethod
    def embedding_rows(model_dir: Path) -> int:
        return load_config(model_dir).vocab_size


__all__ = ["ChatFormat", "CheckpointError", "ConfigError", "MODEL_TYPES", "MoeTextConfig", "Qwen35MoeModel",
           "build_preset", "is_preset", "load", "load_config", "parse_config", "preset_weights_nbytes"]
