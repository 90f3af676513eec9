"""How Qwen3.5 checkpoints name their tensors, in one place.

The engine addresses every tensor by a canonical name: the language model's own naming with the
checkpoint's wrapper prefix taken off (`layers.3.self_attn.q_proj.weight`). The layout lists the
prefixes to strip, the tensors the language model never reads (the vision tower), where the
prediction head and the MTP head live, and which projections may come as FP8 pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..linear import DenseLinear, FP8BlockLinear
from .config import TextConfig


class CheckpointError(ValueError):
    """The checkpoint does not hold what the config says it should."""


# Longest first: the first prefix that matches is stripped.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
MTP_PREFIXES = ("mtp.", "model.mtp.")
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
FP8_SCALE_SUFFIX = "_scale_inv"


def expected_shapes(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the forward reads, with its shape."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(layer_shapes(cfg, f"layers.{i}.", kind))
    return shapes


def expected_mtp_shapes(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """The MTP head's tensors by canonical name (`mtp.*`), with their shapes; empty when the config has none.
    The head (Qwen3.5's `mtp_num_hidden_layers`, one in every published checkpoint) joins the next token's
    normalised embedding and the last hidden state, normalised, through `fc` [H, 2H], runs full-attention
    decoder layers with KV of their own, and ends in `norm`; the embedding and the output head are the model's."""
    if cfg.mtp_num_hidden_layers <= 0:
        return {}
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                                          "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for i in range(cfg.mtp_num_hidden_layers):
        shapes.update(layer_shapes(cfg, f"mtp.layers.{i}.", "full_attention"))
    return shapes


def weight_shapes(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of cfg holds: the forward's, then the MTP head's (what a preset's weights claim)."""
    return {**expected_shapes(cfg), **expected_mtp_shapes(cfg)}


def layer_shapes(cfg: TextConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors under the prefix `p`: its norms, its MLP, and its attention or GDN mixer."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes[p + "mlp.gate_proj.weight"] = (f, h)
    shapes[p + "mlp.up_proj.weight"] = (f, h)
    shapes[p + "mlp.down_proj.weight"] = (h, f)
    if kind == "full_attention":
        a = p + "self_attn."
        shapes[a + "q_proj.weight"] = (2 * cfg.num_attention_heads * cfg.head_dim, h)
        shapes[a + "k_proj.weight"] = (cfg.num_key_value_heads * cfg.head_dim, h)
        shapes[a + "v_proj.weight"] = (cfg.num_key_value_heads * cfg.head_dim, h)
        shapes[a + "o_proj.weight"] = (h, cfg.num_attention_heads * cfg.head_dim)
        shapes[a + "q_norm.weight"] = (cfg.head_dim,)
        shapes[a + "k_norm.weight"] = (cfg.head_dim,)
    else:
        g = p + "linear_attn."
        hv = cfg.linear_num_value_heads
        shapes[g + "in_proj_qkv.weight"] = (cfg.gdn_conv_dim, h)
        shapes[g + "in_proj_z.weight"] = (cfg.gdn_value_dim, h)
        shapes[g + "in_proj_b.weight"] = (hv, h)
        shapes[g + "in_proj_a.weight"] = (hv, h)
        shapes[g + "conv1d.weight"] = (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)
        shapes[g + "dt_bias"] = (hv,)
        shapes[g + "A_log"] = (hv,)
        shapes[g + "norm.weight"] = (cfg.linear_value_head_dim,)
        shapes[g + "out_proj.weight"] = (h, cfg.gdn_value_dim)
    return shapes


def is_linear(name: str) -> bool:
    """Projections read through the Linear interface (and so may be stored as FP8 pairs)."""
    return (name.endswith("_proj.weight") or name == "mtp.fc.weight"
            or name.endswith(("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")))


def canonical_name(name: str) -> tuple[str, str]:
    """(kind, canonical) where kind is 'text', 'head', 'mtp', 'skip' or 'unknown' (an MTP tensor's canonical
    name starts with `mtp.`, whichever wrapper prefix the checkpoint gave it)."""
    if name in HEAD_NAMES:
        return "head", "lm_head.weight"
    if name.startswith(SKIPPED_PREFIXES):
        return "skip", name
    if name.startswith(MTP_PREFIXES):
        return "mtp", name[name.index("mtp."):]
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return "text", name[len(prefix):]
    return "unknown", name


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard {missing[0]!r}, which is not in {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no index and no *.safetensors shard")
    return files


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]  # canonical name -> plain tensor (norms, conv, gates)
    linears: dict[str, DenseLinear | FP8BlockLinear]  # canonical name -> Linear
    skipped: list[str] = field(default_factory=list)  # vision tower etc.
    # the MTP head's tensors the checkpoint holds: loaded (into tensors and linears, `mtp.*`) when the config
    # has an MTP head, else recognised and left on disk
    mtp: list[str] = field(default_factory=list)


class CheckpointTensor(NamedTuple):
    """One tensor of a shard, as read_checkpoint hands it to a family's `claim`."""

    shard: str  # the shard's file name (what an error names)
    name: str  # as the checkpoint spells it
    canonical: str  # canonical_name's
    read: Callable[[], torch.Tensor]  # its data, while the shard is open (inside `claim` only)


class CheckpointRead(NamedTuple):
    raw: dict[str, torch.Tensor]  # canonical name -> tensor as stored, for every name in `want` the shards hold
    skipped: list[str]  # vision tower etc.
    mtp: list[str]  # the MTP head's tensors the checkpoint holds (LoadedWeights.mtp)


def read_checkpoint(model_dir: Path, want: dict[str, tuple[int, ...]], model_name: str, keep_mtp: bool,
                    claim: Callable[[CheckpointTensor], bool]) -> CheckpointRead:
    """Read every shard with a progress bar, map names to canonical ones and keep those in `want`; the vision
    tower is skipped, the MTP head's tensors are listed (and read like the rest only when `keep_mtp`), and a
    name that is no text-model name (of `model_name`, as errors say it) or not in `want` is refused. `claim`
    sees each tensor first: True where the family took it itself (an FP8 scale, one expert's slice, a tied
    checkpoint's spare head), False to have it kept or refused."""
    raw: dict[str, torch.Tensor] = {}
    skipped, mtp = [], []
    shards = shard_files(Path(model_dir))
    num_tensors = 0
    for path in shards:  # the headers only: the bar's total
        with safe_open(str(path), framework="pt") as f:
            num_tensors += len(f.keys())
    # one step a tensor read, on a terminal's stderr only (a real checkpoint takes a while to read)
    with tqdm(total=num_tensors, desc=f"qse: loading {Path(model_dir).name}", unit="tensor", disable=None) as bar:
        for path in shards:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    bar.update()
                    kind, canon = canonical_name(name)
                    if kind == "skip":
                        skipped.append(name)
                        continue
                    if kind == "mtp":
                        mtp.append(name)
                        if not keep_mtp:
                            continue  # recognised, left on disk
                    if kind == "unknown":
                        raise CheckpointError(f"{path.name}: tensor {name!r} is not a {model_name} text-model name")
                    if claim(CheckpointTensor(path.name, name, canon, partial(f.get_tensor, name))):
                        continue
                    if canon not in want:
                        raise CheckpointError(f"{path.name}: unexpected tensor {name!r} (canonical {canon!r})")
                    raw[canon] = f.get_tensor(name)
    return CheckpointRead(raw, skipped, mtp)


def check_shapes(model_dir: Path, want: dict[str, tuple[int, ...]], raw: dict[str, torch.Tensor]) -> None:
    """Every tensor of `want` is in `raw`, of its shape."""
    for name, shape in want.items():
        if name not in raw:
            raise CheckpointError(f"{model_dir}: missing tensor {name!r} (shape {shape})")
        got = tuple(raw[name].shape)
        if got != shape:
            raise CheckpointError(f"{model_dir}: tensor {name!r} has shape {got}, expected {shape}")


def load_weights(model_dir: Path, cfg: TextConfig, device: torch.device | str, dtype: torch.dtype) -> LoadedWeights:
    """Read every shard, map names to canonical ones, check names and shapes, build Linear objects. The MTP
    head's tensors are checked and kept like the rest when the config has one (`expected_mtp_shapes`)."""
    want = {**expected_shapes(cfg), **expected_mtp_shapes(cfg)}
    scales: dict[str, torch.Tensor] = {}

    def claim(t: CheckpointTensor) -> bool:
        if t.canonical.endswith(FP8_SCALE_SUFFIX):
            scales[t.canonical[: -len(FP8_SCALE_SUFFIX)]] = t.read()
            return True
        # some tied checkpoints still carry a copy of the head
        return t.canonical == "lm_head.weight" and cfg.tie_word_embeddings

    raw, skipped, mtp = read_checkpoint(model_dir, want, "Qwen3.5", cfg.mtp_num_hidden_layers > 0, claim)
    check_shapes(model_dir, want, raw)
    weights = LoadedWeights(tensors={}, linears={}, skipped=skipped, mtp=mtp)
    for name, t in raw.items():
        if name in scales:
            if not is_linear(name):
                raise CheckpointError(f"{model_dir}: {name!r} has an FP8 scale but is not a projection")
            weights.linears[name] = FP8BlockLinear(t, scales[name], compute_dtype=dtype).to(device)
        elif t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{model_dir}: FP8 tensor {name!r} has no {name + FP8_SCALE_SUFFIX!r}")
        else:
            place_tensor(weights, name, t, device, dtype)
    return weights


def place_tensor(weights: LoadedWeights, name: str, t: torch.Tensor, device: torch.device | str,
                 dtype: torch.dtype) -> None:
    """A tensor read at full width into `weights`: a projection (is_linear) as a DenseLinear at `dtype`, A_log as
    stored (read in fp32 at use), the rest at `dtype`, contiguous (the MoE experts' kernels read them so)."""
    if is_linear(name):
        weights.linears[name] = DenseLinear(t.to(device=device, dtype=dtype))
    elif name.endswith("A_log"):
        weights.tensors[name] = t.to(device=device)
    else:
        weights.tensors[name] = t.to(device=device, dtype=dtype).contiguous()
