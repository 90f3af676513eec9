"""What every family's package gives the registry, written once: `load`, `build_preset`, `preset_weights_nbytes`
and `is_preset` out of the family's own parts (config reader, layout, model class, presets). Family-neutral: it
names no family, each family builds one `FamilyParts` and exports its methods."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class FamilyParts:
    load_config: Callable[[Path], Any]  # a checkpoint dir -> the family's config
    parse_config: Callable[..., Any]  # (a config.json dict, where=...) -> the family's config
    load_weights: Callable[..., Any]  # (model_dir, cfg, device, dtype) -> LoadedWeights
    random_weights: Callable[..., Any]  # (cfg, seed, device, dtype) -> LoadedWeights
    expected_shapes: Callable[[Any], dict[str, tuple[int, ...]]]  # cfg -> every tensor a preset's weights hold
    model: Callable[..., Any]  # the model class: (cfg, weights, device, dtype)
    preset_config_dict: Callable[[str], dict[str, Any]]  # a preset's name -> its config.json dict
    presets: Mapping[str, Any]  # lower-case preset name -> its shape
    preset_aliases: Mapping[str, str]  # lower-case alias -> preset name

    def load(self, model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> Any:
        cfg = self.load_config(Path(model_dir))
        return self.model(cfg, self.load_weights(Path(model_dir), cfg, device, dtype), device, dtype)

    def preset_config(self, name: str) -> Any:
        return self.parse_config(self.preset_config_dict(name), where=f"preset {name}")

    def build_preset(self, name: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> Any:
        """A preset's shape on the family's random weights (its presets.py)."""
        cfg = self.preset_config(name)
        return self.model(cfg, self.random_weights(cfg, seed, device, dtype), device, dtype)

    def preset_weights_nbytes(self, name: str, dtype: torch.dtype) -> int:
        """What a preset's weights will hold at `dtype`, from its shapes alone (the residency planner's claim)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(shape) for shape in self.expected_shapes(self.preset_config(name)).values()) * size

    def is_preset(self, name: str) -> bool:
        return name.lower() in self.presets or name.lower() in self.preset_aliases


def read_json(path: Path, error: type[Exception], missing: str) -> Any:
    """The JSON a file holds; `error(missing)` where there is no such file, `error` naming it where its text is not
    JSON (the registry and each family's config reader, each with its own error and its own hint)."""
    if not path.is_file():
        raise error(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
