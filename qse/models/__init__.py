"""The model registry: one entry a family. Nothing else in qse names a family.

`resolve(spec)` turns what a user typed (empty for the embedded default, a preset name, or a
checkpoint dir) into a loaded model plus its chat format; everything above this package reaches a
model only through what it returns.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .family import read_json

# family name -> module on the adapter path
FAMILIES: dict[str, str] = {
    "qwen3_5": "qse.models.qwen3_5",
    "qwen3_5_moe": "qse.models.qwen3_5_moe",
}
DEFAULT_FAMILY = "qwen3_5"
EMBEDDED = "embedded"  # the embedded default's name as a spec (the empty spec names it too)


class ModelSpecError(ValueError):
    """The --model value names nothing qse can load."""


def family_module(name: str):
    if name not in FAMILIES:
        raise ModelSpecError(f"unknown model family {name!r}; registered: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def family_of_dir(model_dir: Path) -> str:
    path = Path(model_dir) / "config.json"
    raw = read_json(path, ModelSpecError,
                    f"{model_dir}: no config.json; --model takes a checkpoint dir, a preset name, or nothing")
    model_type = raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")
    for name, module in FAMILIES.items():
        if model_type in importlib.import_module(module).MODEL_TYPES:
            return name
    raise ModelSpecError(f"{path}: model_type {model_type!r} is not served by any registered family {sorted(FAMILIES)}")


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelSpecError(f"device {requested!r} asked for, but torch sees no CUDA device")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
    if requested not in table:
        raise ModelSpecError(f"dtype {requested!r} is not one of {sorted(table)}")
    return table[requested]


@dataclass
class ResolvedModel:
    model: Any  # the family's model object (forward, new_cache, cfg)
    chat: Any  # the family's ChatFormat
    name: str  # what /v1/models shows
    source: str  # 'embedded', 'preset' or the checkpoint dir
    family: str
    weights_id: str  # identifies the weights for the disk tier's fingerprint


def weights_id_of_dir(model_dir: Path) -> str:
    """sha256 over the shards' names, sizes and first/last MiB: cheap, and moves with any rewrite."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), 2)
                h.update(f.read())
    return h.hexdigest()


def same_spec(a: str | None, b: str | None) -> bool:
    """Whether two specs name the same weights as spelt (the embedded default has two spellings)."""
    a, b = ("" if x in (None, EMBEDDED) else str(x) for x in (a, b))
    return a == b


def checkpoint_dir(spec: str, cache_dir: Path) -> Path | None:
    """The checkpoint dir a spec names (the embedded default's, written first where it is missing), before
    anything loads; None where it names no dir (a preset, or nothing qse can load)."""
    if spec in ("", EMBEDDED):
        return family_module(DEFAULT_FAMILY).ensure_embedded(cache_dir)
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def preset_weights_nbytes(spec: str, dtype: torch.dtype) -> int | None:
    """What a preset's weights will hold at `dtype`, from its family's shapes alone; None where no family has
    the preset or its family cannot say (measured once loaded)."""
    for name in FAMILIES:
        module = family_module(name)
        if module.is_preset(spec) and hasattr(module, "preset_weights_nbytes"):
            return module.preset_weights_nbytes(spec, dtype)
    return None


def resolve(spec: str | Path | None, device: torch.device, dtype: torch.dtype, cache_dir: Path,
            seed: int = 0, chat_template: Path | None = None) -> ResolvedModel:
    """chat_template: a template file that replaces the checkpoint's (--chat-template)."""
    spec = "" if spec is None else str(spec)
    if spec in ("", EMBEDDED):
        module = family_module(DEFAULT_FAMILY)
        model_dir = module.ensure_embedded(cache_dir)
        chat = module.ChatFormat(model_dir, chat_template)
        return ResolvedModel(module.load(model_dir, device, dtype), chat, model_dir.name,
                             "embedded", DEFAULT_FAMILY, weights_id_of_dir(model_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        family = family_of_dir(path)
        module = family_module(family)
        chat = module.ChatFormat(path, chat_template)  # before the weights: a tokenizer that does not fit fails fast
        return ResolvedModel(module.load(path, device, dtype), chat, path.name, str(path),
                             family, weights_id_of_dir(path))
    for family, module_name in FAMILIES.items():
        module = importlib.import_module(module_name)
        if module.is_preset(spec):
            chat = module.ChatFormat(None, chat_template)
            return ResolvedModel(module.build_preset(spec, device, dtype, seed), chat, spec.lower(),
                                 "preset", family, f"preset:{spec.lower()}:seed{seed}:{dtype}")
    raise ModelSpecError(f"--model {spec!r} is neither a checkpoint directory nor a preset name")
