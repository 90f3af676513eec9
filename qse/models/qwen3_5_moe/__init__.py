"""The qwen3_5_moe family on the adapter path: Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B). Config, layout and
forward are the dense family's with a sparse MLP in every layer (model.py), the MTP head's layer included: the
checkpoint's head is kept and served (`mtp_head()`, QSE_SPECULATE=mtp); the text format is Qwen3.5's."""

from __future__ import annotations

from pathlib import Path

from ..family import FamilyParts
from ..qwen3_5 import ChatFormat as _DenseChatFormat
from .config import MODEL_TYPES, ConfigError, MoeTextConfig, load_config, parse_config
from .layout import CheckpointError, load_weights, weight_shapes
from .model import Qwen35MoeModel
from .presets import PRESET_ALIASES, PRESETS, preset_config_dict, random_weights


_PARTS = FamilyParts(load_config=load_config, parse_config=parse_config, load_weights=load_weights,
                     random_weights=random_weights, expected_shapes=weight_shapes, model=Qwen35MoeModel,
                     preset_config_dict=preset_config_dict, presets=PRESETS, preset_aliases=PRESET_ALIASES)
# build_preset on the meta device: a preset's shapes without memory (presets.py)
load, build_preset, is_preset = _PARTS.load, _PARTS.build_preset, _PARTS.is_preset
preset_weights_nbytes = _PARTS.preset_weights_nbytes


class ChatFormat(_DenseChatFormat):
    """Qwen3.5's text format (the dense family's ChatFormat: the checkpoint's tokenizer, template and generation
    defaults where it has them), its tokenizer checked against this family's config.json."""

    @staticmethod
    def embedding_rows(model_dir: Path) -> int:
        return load_config(model_dir).vocab_size


__all__ = ["ChatFormat", "CheckpointError", "ConfigError", "MODEL_TYPES", "MoeTextConfig", "Qwen35MoeModel",
           "build_preset", "is_preset", "load", "load_config", "parse_config", "preset_weights_nbytes"]
