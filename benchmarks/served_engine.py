"""The served model a served benchmark runs: the embedded model in fp32 on the CPU (a tiny smoke run) or a
preset in bf16 on CUDA, built with the policy read once from the settings (a benchmark is an entry point)."""

from __future__ import annotations

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


__all__ = ["served_engine"]
