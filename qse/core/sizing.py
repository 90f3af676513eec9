"""The served model's memory, sized once at start: its paged KV pool and its session cache from what the device
leaves them (QSE_SERVED_KV_GB / QSE_SERVED_CACHE_GB 0: auto), as vLLM sizes its KV cache from its
gpu-memory-utilization.

The contract, every term in bytes:

    ceiling      = total * utilization            QSE_GPU_MEMORY_UTILIZATION, the share of the device qse may use;
                                                  at most QSE_DEVICE_MEMORY_GB where that is set
    in_use       = total - free                   free measured when qse starts, before the served weights load
                                                  (other processes, this process's CUDA context): the weights are
                                                  not in it, they are counted once, below
    weights      = the served model's weights as loaded
    reader       = the reader's claim: its weights (0 where it reads the served ones), its KV pool and its
                   session cache (QSE_SHADOW_GB each); 0 without a reader
    state_slots  = max_running * cost(0)          the decode slots' fixed-size state
    activations  = activation_reserve(...)        the largest forward the served model runs (below)
    budget       = ceiling - in_use - weights - reader - state_slots - activations
    left         = budget - the sizes a switch sets (> 0: taken as given)

    both auto    kv_pool = KV_POOL_SHARE * left, session_cache = left - kv_pool
    one auto     it takes all of left
    refused      where an auto size comes out under its floor (MIN_KV_POOL_NBYTES, MIN_SESSION_CACHE_NBYTES)

The KV pool is sized in bytes: its pages hold one KV slot an attention layer, and one more for the MTP head's rows
where the served turns draft with it (QSE_SPECULATE=mtp, qse/engine/rounds.py pool_slots_for), so the same bytes
hold 1 / (attention layers + 1) fewer rows there; the builder of the pool (GridSessions) divides by that page.

Sizes a switch sets are never changed (over the budget they are logged, not refused: the operator asked for
them). Where there are no device figures (a CPU), auto is the fixed FIXED_KV_POOL_GB and FIXED_SESSION_CACHE_GB.
Pure: no torch, no clock; the caller measures the device and hands the figures in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .residency import GIB, gib

# auto where no device can be measured (a CPU): the sizes qse had before they were sized from the device
FIXED_KV_POOL_GB = 8.0
FIXED_SESSION_CACHE_GB = 6.0
# what the budget left gives the KV pool when both are auto (the session cache gets the rest): the pool holds the
# running turns' rows (and the pages of the sessions resident in it), the cache the sessions kept between turns,
# so the larger share goes to what every running turn reads and writes
KV_POOL_SHARE = 0.6
# under these an auto size is refused at start: a pool that holds no long turn, a cache that keeps no session
MIN_KV_POOL_NBYTES = 1 * GIB
MIN_SESSION_CACHE_NBYTES = GIB // 2
# activation_reserve: the tensors of one layer alive at once in a forward of `rows` rows, in units of
# rows * (hidden + intermediate) (the residual, its norm, the MLP's gate-up pair and product, a mixer's
# projections), and a safety factor over that for the kernels' workspaces and the allocator's rounding
LIVE_ACTIVATIONS = 4
ACTIVATION_SAFETY = 2
LOGIT_NBYTES = 4  # logits are fp32 whatever the compute dtype


class SizingError(ValueError):
    """The served model's memory cannot be sized as asked: one line naming the numbers and the switches."""


def check_utilization(utilization: float) -> float:
    """QSE_GPU_MEMORY_UTILIZATION must be a share in (0, 1]."""
    if not (0.0 < utilization <= 1.0):  # NaN is refused too
        raise SizingError(f"QSE_GPU_MEMORY_UTILIZATION={utilization!r}: expected the share of the device's memory "
                          "qse may use, in (0, 1] (0.9: 90 %)")
    return utilization


def check_size(name: str, gb: float) -> float:
    """A size switch: 0 (auto) or a size in GiB."""
    if not gb >= 0.0:
        raise SizingError(f"{name}={gb!r}: expected 0 (auto: sized from the device's memory) or a size in GiB")
    return gb


def activation_reserve(token_budget: int, grid: int, max_running: int, hidden: int, intermediate: int, vocab: int,
                       dtype_nbytes: int) -> int:
    """The memory the served model's largest forward holds beyond its weights and pools, bytes: a round reads up
    to QSE_ROUND_TOKEN_BUDGET prompt ids in whole grid chunks (at least one chunk), and a forward may return the
    fp32 logits of a chunk's rows (or of every decode row):

        rows        = max(token_budget, grid)
        activations = LIVE_ACTIVATIONS * ACTIVATION_SAFETY * rows * (hidden + intermediate) * dtype_nbytes
                      + max(grid, max_running) * vocab * LOGIT_NBYTES
    """
    rows = max(token_budget, grid)
    return (LIVE_ACTIVATIONS * ACTIVATION_SAFETY * rows * (hidden + intermediate) * dtype_nbytes
            + max(grid, max_running) * vocab * LOGIT_NBYTES)


@dataclass(frozen=True)
class DeviceTerms:
    """The figures the served model's pools are sized from (bytes; utilization a share)."""

    total_nbytes: int
    free_nbytes: int  # free at start, before the served weights loaded
    utilization: float
    weights_nbytes: int
    reader_nbytes: int
    state_slots_nbytes: int
    activation_nbytes: int
    cap_nbytes: int = 0  # QSE_DEVICE_MEMORY_GB: a ceiling on what qse may use; 0: none

    @property
    def ceiling_nbytes(self) -> int:
        ceiling = int(self.total_nbytes * self.utilization)
        return min(ceiling, self.cap_nbytes) if self.cap_nbytes else ceiling

    @property
    def in_use_nbytes(self) -> int:
        return max(0, self.total_nbytes - self.free_nbytes)

    @property
    def budget_nbytes(self) -> int:
        return (self.ceiling_nbytes - self.in_use_nbytes - self.weights_nbytes - self.reader_nbytes
                - self.state_slots_nbytes - self.activation_nbytes)


@dataclass(frozen=True)
class ServedMemory:
    """The sizes chosen and why: each "set" (its switch), "auto" (sized from the device) or "fixed" (auto, with no
    device to size from)."""

    kv_pool_nbytes: int
    session_cache_nbytes: int
    kv_pool_from: str
    session_cache_from: str
    terms: DeviceTerms | None = None  # None: no device figures (a CPU)

    @property
    def kv_pool_gb(self) -> float:
        return self.kv_pool_nbytes / GIB

    @property
    def session_cache_gb(self) -> float:
        return self.session_cache_nbytes / GIB

    @property
    def left_nbytes(self) -> int | None:
        """What the budget leaves after both sizes (negative: set sizes over it); None without device figures."""
        if self.terms is None:
            return None
        return self.terms.budget_nbytes - self.kv_pool_nbytes - self.session_cache_nbytes

    def report(self) -> dict[str, Any]:
        """Every term in GiB, and the sizes with where each came from (the start's log event, the status)."""
        out: dict[str, Any] = {"kv_pool_gib": _g(self.kv_pool_nbytes), "kv_pool_from": self.kv_pool_from,
                               "session_cache_gib": _g(self.session_cache_nbytes),
                               "session_cache_from": self.session_cache_from}
        t = self.terms
        if t is not None:
            out.update(total_gib=_g(t.total_nbytes), free_at_start_gib=_g(t.free_nbytes), utilization=t.utilization,
                       cap_gib=_g(t.cap_nbytes) if t.cap_nbytes else None, ceiling_gib=_g(t.ceiling_nbytes),
                       in_use_at_start_gib=_g(t.in_use_nbytes), weights_gib=_g(t.weights_nbytes),
                       reader_gib=_g(t.reader_nbytes), state_slots_gib=_g(t.state_slots_nbytes),
                       activations_gib=_g(t.activation_nbytes), budget_gib=_g(t.budget_nbytes),
                       unused_gib=_g(self.left_nbytes))
        return out


def _g(nbytes: int) -> float:
    return round(nbytes / GIB, 3)


def size_served_memory(terms: DeviceTerms | None, kv_gb: float = 0.0, cache_gb: float = 0.0) -> ServedMemory:
    """The served model's KV pool and session cache: kv_gb / cache_gb > 0 as given (QSE_SERVED_KV_GB /
    QSE_SERVED_CACHE_GB), 0 sized from `terms` by the module's contract (fixed sizes where `terms` is None).
    SizingError where an auto size falls under its floor, or a switch is out of range."""
    check_size("QSE_SERVED_KV_GB", kv_gb)
    check_size("QSE_SERVED_CACHE_GB", cache_gb)
    kv_set, cache_set = int(kv_gb * GIB), int(cache_gb * GIB)
    if terms is None:
        return ServedMemory(kv_set or int(FIXED_KV_POOL_GB * GIB), cache_set or int(FIXED_SESSION_CACHE_GB * GIB),
                            "set" if kv_set else "fixed", "set" if cache_set else "fixed")
    check_utilization(terms.utilization)
    if kv_set and cache_set:
        return ServedMemory(kv_set, cache_set, "set", "set", terms)
    left = terms.budget_nbytes - kv_set - cache_set
    if kv_set:
        kv, cache = kv_set, left
    elif cache_set:
        kv, cache = left, cache_set
    else:
        kv = int(left * KV_POOL_SHARE)
        cache = left - kv
    short = []
    if not kv_set and kv < MIN_KV_POOL_NBYTES:
        short.append(f"the KV pool {gib(kv)} is under its {gib(MIN_KV_POOL_NBYTES)} floor")
    if not cache_set and cache < MIN_SESSION_CACHE_NBYTES:
        short.append(f"the session cache {gib(cache)} is under its {gib(MIN_SESSION_CACHE_NBYTES)} floor")
    if short:
        raise SizingError(_refusal(terms, kv_set, cache_set, left, short))
    return ServedMemory(kv, cache, "set" if kv_set else "auto", "set" if cache_set else "auto", terms)


def _refusal(t: DeviceTerms, kv_set: int, cache_set: int, left: int, short: list[str]) -> str:
    cap = f" (QSE_DEVICE_MEMORY_GB caps it at {gib(t.cap_nbytes)})" if t.cap_nbytes else ""
    taken = "".join(f", {name} {gib(n)} (set)" for name, n in (("the KV pool", kv_set), ("the session cache",
                                                                                        cache_set)) if n)
    return (f"the served model's memory does not fit: QSE_GPU_MEMORY_UTILIZATION={t.utilization:g} of "
            f"{gib(t.total_nbytes)} is {gib(t.ceiling_nbytes)}{cap}; less {gib(t.in_use_nbytes)} in use at start, "
            f"the served weights {gib(t.weights_nbytes)}, the reader's claim {gib(t.reader_nbytes)}, the decode "
            f"state slots {gib(t.state_slots_nbytes)}, the activations {gib(t.activation_nbytes)}{taken} leaves "
            f"{gib(left)}: {'; '.join(short)}. Raise QSE_GPU_MEMORY_UTILIZATION, lower QSE_SHADOW_GB or "
            "QSE_MAX_RUNNING or QSE_ROUND_TOKEN_BUDGET, or set QSE_SERVED_KV_GB and QSE_SERVED_CACHE_GB")


__all__ = ["ACTIVATION_SAFETY", "DeviceTerms", "FIXED_KV_POOL_GB", "FIXED_SESSION_CACHE_GB", "KV_POOL_SHARE",
           "LIVE_ACTIVATIONS", "MIN_KV_POOL_NBYTES", "MIN_SESSION_CACHE_NBYTES", "ServedMemory", "SizingError",
           "activation_reserve", "check_size", "check_utilization", "size_served_memory"]
