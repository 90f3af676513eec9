"""The GPU-time ledger: what each role spent, per turn and in total.

Measured time goes in (device events around each piece of work), never an estimate; an entry may
carry the estimate that admitted it, so the estimator's error can be read back. Balances are whole
microseconds, so sums are exact and tests assert them. Nothing here raises on bad input: a record
that does not fit (negative or non-finite time, a turn that is not open) is refused with None, and
the caller decides.

Per-turn detail lives only while the turn is open; `close_turn` hands back its final balance and
forgets it, so a long-running server keeps a bounded ledger (the totals stay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping


class Role(str, Enum):
    """Who spent GPU time."""

    SERVED_PREFILL = "served_prefill"
    SERVED_DECODE = "served_decode"
    READER_IDLE = "reader_idle"  # the reader in the idle window
    READER_RATION = "reader_ration"  # the reader between two decode rounds (its share of the turn)
    READER_PREFILL = "reader_prefill"  # exploratory: the reader during the served prefill (off by default)
    NARRATOR = "narrator"
    READER_ASK = "reader_ask"  # a question to the reader (a fork over its state)


READER_ROLES = (Role.READER_IDLE, Role.READER_RATION, Role.READER_PREFILL)  # the reading windows


def ms_to_us(ms: float) -> int | None:
    """Milliseconds to whole microseconds; None for a negative or non-finite value."""
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms) or ms < 0:
        return None
    return round(ms * 1000)


@dataclass(frozen=True)
class Balance:
    """What each role spent (one turn, or everything), in whole microseconds.

    `est_us` sums the estimates of the entries that carried one and `measured_est_us` the measured time of
    those same entries, so `measured_est_us[r] - est_us[r]` is the estimator's total error for role r.
    """

    gpu_us: Mapping[Role, int]
    num_entries: Mapping[Role, int]
    est_us: Mapping[Role, int]
    measured_est_us: Mapping[Role, int]

    def gpu_ms(self, role: Role) -> float:
        return self.gpu_us.get(role, 0) / 1000

    @property
    def total_us(self) -> int:
        return sum(self.gpu_us.values())

    @property
    def reader_us(self) -> int:
        return sum(self.gpu_us.get(r, 0) for r in READER_ROLES)

    def estimate_error_us(self, role: Role) -> int:
        """Measured minus estimated, over the entries of `role` that carried an estimate."""
        return self.measured_est_us.get(role, 0) - self.est_us.get(role, 0)


@dataclass
class _Account:
    gpu_us: dict[Role, int] = field(default_factory=dict)
    num_entries: dict[Role, int] = field(default_factory=dict)
    est_us: dict[Role, int] = field(default_factory=dict)
    measured_est_us: dict[Role, int] = field(default_factory=dict)

    def add(self, role: Role, gpu_us: int, est_us: int | None) -> None:
        self.gpu_us[role] = self.gpu_us.get(role, 0) + gpu_us
        self.num_entries[role] = self.num_entries.get(role, 0) + 1
        if est_us is not None:
            self.est_us[role] = self.est_us.get(role, 0) + est_us
            self.measured_est_us[role] = self.measured_est_us.get(role, 0) + gpu_us

    def snapshot(self) -> Balance:
        return Balance(dict(self.gpu_us), dict(self.num_entries), dict(self.est_us), dict(self.measured_est_us))


class GpuLedger:
    """Explicit accounting of GPU time by role, per open turn and in total."""

    def __init__(self) -> None:
        self._total = _Account()
        self._turns: dict[str, _Account] = {}

    # -- turns -------------------------------------------------------------------------------
    def open_turn(self, turn_id: str) -> bool:
        """Start a turn's account; False if a turn of that id is already open."""
        if turn_id in self._turns:
            return False
        self._turns[turn_id] = _Account()
        return True

    def close_turn(self, turn_id: str) -> Balance | None:
        """The turn's final balance, forgetting its detail; None if no such turn is open."""
        account = self._turns.pop(turn_id, None)
        return None if account is None else account.snapshot()

    def is_open(self, turn_id: str) -> bool:
        return turn_id in self._turns

    @property
    def num_open_turns(self) -> int:
        return len(self._turns)

    # -- entries -----------------------------------------------------------------------------
    def record(self, role: Role, gpu_ms: float, *, turn_id: str | None = None,
               est_ms: float | None = None) -> int | None:
        """Charge measured `gpu_ms` to `role` (and to the open turn `turn_id`, if given).

        Returns the microseconds recorded, or None (nothing recorded) when the time is negative or
        not finite, the estimate is, `role` is not a Role, or `turn_id` names no open turn.
        """
        if not isinstance(role, Role):
            return None
        gpu_us = ms_to_us(gpu_ms)
        if gpu_us is None:
            return None
        est_us = None
        if est_ms is not None:
            est_us = ms_to_us(est_ms)
            if est_us is None:
                return None
        if turn_id is not None:
            account = self._turns.get(turn_id)
            if account is None:
                return None
            account.add(role, gpu_us, est_us)
        self._total.add(role, gpu_us, est_us)
        return gpu_us

    # -- balances ----------------------------------------------------------------------------
    def spent_us(self, role: Role, turn_id: str | None = None) -> int | None:
        """Microseconds `role` spent in the open turn `turn_id` (or in total); None for an unknown turn."""
        account = self._total if turn_id is None else self._turns.get(turn_id)
        if account is None:
            return None
        return account.gpu_us.get(role, 0)

    def spent_ms(self, role: Role, turn_id: str | None = None) -> float | None:
        us = self.spent_us(role, turn_id)
        return None if us is None else us / 1000

    def balance(self, turn_id: str | None = None) -> Balance | None:
        """A snapshot of the open turn `turn_id` (or of the totals); None for an unknown turn."""
        account = self._total if turn_id is None else self._turns.get(turn_id)
        return None if account is None else account.snapshot()
