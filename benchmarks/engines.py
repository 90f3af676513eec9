"""The engines the benchmarks run: the served model of a served benchmark (the embedded model in fp32 on the CPU
for a tiny smoke run, or a preset in bf16 on CUDA, with the policy read once from the settings: a benchmark is
an entry point), and this machine's device, dtype and cache dir for the benchmarks that take what is there."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.policy import Policy
from qse.settings import SETTINGS


def served_engine(preset: str, tiny: bool) -> tuple[Engine, Policy]:
    """(the engine, the policy): `preset` on CUDA in bf16, or with `tiny` the embedded model on the CPU."""
    device, dtype, spec = ((torch.device("cpu"), torch.float32, "") if tiny
                           else (torch.device("cuda"), torch.bfloat16, preset))
    policy = Policy.from_settings(SETTINGS)
    return Engine(resolve(spec, device, dtype, SETTINGS.cache_dir()), kernels=policy.kernels), policy


def on_this_machine() -> tuple[torch.device, torch.dtype, Path]:
    """CUDA in bf16 where there is a GPU, else the CPU in fp32; the weights' cache dir (QSE_CACHE_DIR, else one
    in /tmp that the benchmarks share)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype, Path(os.environ.get("QSE_CACHE_DIR", "/tmp/qse-bench-cache"))


__all__ = ["on_this_machine", "served_engine"]
