"""Counters for kernels whose programs leave the last step of a piece of work to whichever of them ends last
(the split router adds its K slices' partials, gdn_decode's step writes a key head's conv state and norms a
value head): each program counts itself in with one acq_rel atomic, and the program that reads the count one
short of the group's size does the step and sets the counter back to zero. So the counters are zero between
launches, and a buffer serves every launch of one layer for good.

Keyed by a tensor of the layer's (its weight), not by the stream: every CUDA graph is captured on one stream,
so a stream key would let two models' graphs share counters while they run side by side; one layer's launches
never overlap (a model runs on one stream at a time, and each launch waits for the one before it)."""

from __future__ import annotations

import torch

_COUNTS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counters stay allocated: a CUDA graph may still hold their address


def zeroed(owner: torch.Tensor, num: int) -> torch.Tensor:
    """At least `num` int32 counters on owner's device for the layer that owns `owner`, zero between launches."""
    key = (owner.device, owner.data_ptr())
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < num:
        if counts is not None:
            _RETIRED.append(counts)
        counts = torch.zeros(max(num, 1024), dtype=torch.int32, device=owner.device)
        _COUNTS[key] = counts
    return counts


def all_zero() -> bool:
    """Whether every counter is back at zero (what each launch must leave; the tests check it)."""
    return not any(bool(counts.any()) for counts in _COUNTS.values())


__all__ = ["all_zero", "zeroed"]
