"""How Qwen3.5-MoE checkpoints name their tensors: the dense family's layout (qse/models/qwen3_5/layout.py:
prefixes, the vision tower, the head) with a sparse MLP in every layer instead of the dense one.

A layer's MLP by canonical name (`layers.{i}.mlp.` + ...), shapes as transformers' Qwen3_5MoeSparseMoeBlock holds
them (E experts of I, a shared expert of Is, hidden H):

    gate.weight                      [E, H]      the router
    experts.gate_up_proj             [E, 2I, H]  each expert's gate rows, then its up rows
    experts.down_proj                [E, H, I]
    shared_expert.gate_proj.weight   [Is, H]
    shared_expert.up_proj.weight     [Is, H]
    shared_expert.down_proj.weight   [H, Is]
    shared_expert_gate.weight        [1, H]

Experts come fused, as Qwen publishes them (`experts.gate_up_proj`, `experts.down_proj`, no `.weight`), or one
expert a tensor, as transformers' save_pretrained writes them (`experts.{e}.{gate,up,down}_proj.weight`, [I, H],
[I, H], [H, I]); the loader stacks the second form into the first.

The MTP head (`mtp.*`, where the config has `mtp_num_hidden_layers`) is the dense family's head
(expected_mtp_shapes there: fc, its norms, a full-attention layer) whose layer's MLP is this same sparse block of
the main layers' sizes, under `mtp.layers.0.mlp.`; its experts come in either form too. It is loaded, checked and
kept beside the model like the rest. FP8 block-scaled checkpoints are refused (not supported for this family yet).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..qwen3_5.layout import (FP8_SCALE_SUFFIX, CheckpointError, CheckpointTensor, LoadedWeights, check_shapes,
                              place_tensor, read_checkpoint)
from ..qwen3_5.layout import expected_mtp_shapes as dense_expected_mtp_shapes
from ..qwen3_5.layout import expected_shapes as dense_expected_shapes
from .config import MoeTextConfig

DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# one expert a tensor: [mtp.]layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
PER_EXPERT = re.compile(r"^((?:mtp\.)?layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def moe_shapes(cfg: MoeTextConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's sparse MLP under the prefix `p` (the module docstring's table)."""
    h, e, i, i_s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m = p + "mlp."
    return {m + "gate.weight": (e, h), m + "experts.gate_up_proj": (e, 2 * i, h), m + "experts.down_proj": (e, h, i),
            m + "shared_expert.gate_proj.weight": (i_s, h), m + "shared_expert.up_proj.weight": (i_s, h),
            m + "shared_expert.down_proj.weight": (h, i_s), m + "shared_expert_gate.weight": (1, h)}


def _sparse(dense: dict[str, tuple[int, ...]], prefixes: list[str], cfg: MoeTextConfig) -> dict[str, tuple[int, ...]]:
    """The dense family's table with each layer's dense MLP (under `prefixes`) made the sparse block."""
    shapes = {name: shape for name, shape in dense.items() if not name.endswith(DENSE_MLP)}
    for p in prefixes:
        shapes.update(moe_shapes(cfg, p))
    return shapes


def expected_shapes(cfg: MoeTextConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the forward reads, with its shape (the MTP head's: expected_mtp_shapes)."""
    return _sparse(dense_expected_shapes(cfg), [f"layers.{i}." for i in range(cfg.num_hidden_layers)], cfg)


def expected_mtp_shapes(cfg: MoeTextConfig) -> dict[str, tuple[int, ...]]:
    """The MTP head's tensors (`mtp.*`), with their shapes; empty when the config has none (the module
    docstring)."""
    prefixes = [f"mtp.layers.{i}." for i in range(cfg.mtp_num_hidden_layers)]
    return _sparse(dense_expected_mtp_shapes(cfg), prefixes, cfg)


def weight_shapes(cfg: MoeTextConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of cfg holds: the forward's, then the MTP head's (what a preset's weights claim)."""
    return {**expected_shapes(cfg), **expected_mtp_shapes(cfg)}


class _ExpertStack:
    """A layer's experts read one a tensor, copied into the fused [E, 2I, H] and [E, H, I] as they come (no second
    copy of the layer); `missing()` names the first expert tensor that never came."""

    def __init__(self, prefix: str, cfg: MoeTextConfig):
        self.prefix, self.cfg = prefix, cfg  # prefix: [mtp.]layers.{i}.mlp.experts.
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.seen: set[tuple[int, str]] = set()

    def add(self, where: str, name: str, expert: int, part: str, t: torch.Tensor) -> None:
        cfg = self.cfg
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        want = (h, i) if part == "down" else (i, h)
        if expert >= e:
            raise CheckpointError(f"{where}: tensor {name!r} names expert {expert}; the config has {e} "
                                  "(num_experts)")
        if tuple(t.shape) != want:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
        if self.gate_up is None:
            self.gate_up = torch.empty(e, 2 * i, h, dtype=t.dtype)
            self.down = torch.empty(e, h, i, dtype=t.dtype)
        if part == "gate":
            self.gate_up[expert, :i].copy_(t)
        elif part == "up":
            self.gate_up[expert, i:].copy_(t)
        else:
            self.down[expert].copy_(t)
        self.seen.add((expert, part))

    def missing(self) -> str | None:
        for expert in range(self.cfg.num_experts):
            for part in ("gate", "up", "down"):
                if (expert, part) not in self.seen:
                    return f"{self.prefix}{expert}.{part}_proj.weight"
        return None


def load_weights(model_dir: Path, cfg: MoeTextConfig, device: torch.device | str,
                 dtype: torch.dtype) -> LoadedWeights:
    """Read every shard, map names to canonical ones, stack per-expert tensors, check names and shapes, build
    Linear objects for the projections (is_linear) and keep the rest (router, experts, gates, norms) as tensors;
    the MTP head's tensors too where the config has one, else they are recognised and left on disk."""
    want = weight_shapes(cfg)
    stacks: dict[str, _ExpertStack] = {}
    model_dir = Path(model_dir)

    def claim(t: CheckpointTensor) -> bool:
        if t.canonical.endswith(FP8_SCALE_SUFFIX):
            raise CheckpointError(f"{t.shard}: {t.name!r} is an FP8 block scale; qse does not read FP8 "
                                  "Qwen3.5-MoE checkpoints yet: use the BF16 one")
        per_expert = PER_EXPERT.match(t.canonical)
        if per_expert is None:
            return False
        prefix, expert, part = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
        stack = stacks.setdefault(prefix, _ExpertStack(prefix, cfg))
        stack.add(t.shard, t.name, expert, part, t.read())
        return True

    raw, skipped, mtp = read_checkpoint(model_dir, want, "Qwen3.5-MoE", cfg.mtp_num_hidden_layers > 0, claim)
    for prefix, stack in stacks.items():
        fused = (prefix + "gate_up_proj", prefix + "down_proj")
        if any(name in raw for name in fused):
            raise CheckpointError(f"{model_dir}: {prefix[:-1]!r} holds both fused experts and one-expert tensors; "
                                  "a checkpoint stores a layer's experts one way")
        absent = stack.missing()
        if absent is not None:
            raise CheckpointError(f"{model_dir}: missing tensor {absent!r} (the layer's other experts are there)")
        raw[fused[0]], raw[fused[1]] = stack.gate_up, stack.down
    check_shapes(model_dir, want, raw)
    weights = LoadedWeights(tensors={}, linears={}, skipped=skipped, mtp=mtp)
    for name, t in raw.items():
        if t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{model_dir}: tensor {name!r} is FP8; qse reads BF16 Qwen3.5-MoE checkpoints only")
        place_tensor(weights, name, t, device, dtype)
    return weights

__all__ = ["CheckpointError", "expected_mtp_shapes", "expected_shapes", "load_weights", "moe_shapes", "weight_shapes"]
