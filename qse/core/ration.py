"""The ration inside a turn: the reader's (and the narrator's) slices between two decode rounds.

Between two decode rounds the reader may spend `share` (2 %) of the time since the served model's
first token plus `after_s` (5 s, QSE_SHADOW_RATION_AFTER_S), minus what it already spent this turn,
in slices of at most `slice_ms` (150), whole chunks only. The delay keeps a short turn's decode
whole: its backlog is read by the idle window after it anyway, while a long decode still gets its
share once `after_s` has passed. The next chunk's cost is estimated from the last measured chunk at
that context; a chunk whose estimate exceeds what is left is not started. The slice's budget is fixed when it opens;
inside it, measured time counts, so a chunk that ran over its estimate shrinks what follows.

A slice opens only once the role has earned `min_slice_ms` (or the next chunk's estimate, if larger): each
slice costs the served decode a fixed host overhead around its chunks (the hop to the reader's thread, the
decode rounds' pipeline drained and refilled), so a ration spent a chunk a slice paid it once a chunk.

A chunk estimated above a whole slice waits for a whole slice and is read alone, as its first chunk (a
probe). Its measurement replaces the estimate, so one slow measurement (a chunk read under load) never
stops the ration at that context for good: nothing else would measure that context again. If the chunk
really is that dear, the ration still reads it now and then, and the ledger charges the overrun to the
turn, so the next slice waits until the share has paid it back.
The narrator's share (3 %) is the same rule with its own share and its own ledger role, undelayed.
"""

from __future__ import annotations

import math

from qse.core.drive import SpendDecision
from qse.core.ledger import ms_to_us
from qse.core.plan import Window
from qse.core.share import ShareBudget


class RationSlice(SpendDecision):
    """One slice: whole chunks while their estimates fit the budget fixed at opening. A slice whose budget
    is a whole slice (`whole_us`) also admits its first chunk when that chunk's estimate is larger than a
    whole slice (the probe, see the module's docstring)."""

    def __init__(self, opened_s: float, budget_us: int, whole_us: int | None = None):
        super().__init__()
        self.opened_s = opened_s
        self.budget_us = budget_us
        self.whole_us = whole_us  # None: no probe (a slice that is not a ration's)

    @property
    def left_us(self) -> int:
        return max(0, self.budget_us - self.spent_us)

    def may_read_next(self, now: float, request_waiting: bool, next_chunk_est_ms: float) -> bool:
        """Start another chunk? Only if its estimate fits what is left of the slice.

        `now` and `request_waiting` are accepted for the executor's one loop and do not matter here: a
        slice runs between two rounds of the request it belongs to.
        """
        probes = self.whole_us is not None and self.budget_us >= self.whole_us  # only a whole slice probes
        return self.admit(next_chunk_est_ms, self.left_us, self.whole_us if probes else None)


class TurnRation:
    """A role's share of a turn, spent in slices between decode rounds.

    The share counts from `first_token_s + after_s`: nothing is earned before that moment.
    """

    def __init__(self, share: float = 0.02, slice_ms: float = 150.0, window: Window = Window.RATION,
                 after_s: float = 0.0, min_slice_ms: float = 0.0):
        if not (math.isfinite(slice_ms) and slice_ms > 0):
            raise ValueError(f"slice must be a positive number of ms, got {slice_ms!r}")
        if not (isinstance(min_slice_ms, (int, float)) and math.isfinite(min_slice_ms) and 0 <= min_slice_ms <= slice_ms):
            raise ValueError(f"the shortest slice must be a number of ms from 0 to the longest ({slice_ms}), "
                             f"got {min_slice_ms!r}")
        if not (isinstance(after_s, (int, float)) and math.isfinite(after_s) and after_s >= 0):
            raise ValueError(f"the ration's delay after the first token must be a finite number of seconds >= 0, "
                             f"got {after_s!r}")
        self.budget = ShareBudget(share)
        self.share = self.budget.share
        self.slice_ms = float(slice_ms)
        self.slice_us = ms_to_us(slice_ms) or 0
        self.min_slice_us = ms_to_us(min_slice_ms) or 0
        self.window = window
        self.after_s = float(after_s)

    @classmethod
    def reader(cls, policy) -> "TurnRation":
        """The reader's ration as `policy` (qse.policy.Policy, or anything with its fields) sets it."""
        return cls(policy.ration, policy.slice_ms, Window.RATION, policy.ration_after_s, policy.min_slice_ms)

    @classmethod
    def narrator(cls, policy) -> "TurnRation":
        """The narrator's share: counted from the first token itself (no delay), in the reader's slices."""
        return cls(policy.narrator_share, policy.slice_ms, Window.NARRATOR, min_slice_ms=policy.min_slice_ms)

    def since_s(self, first_token_s: float) -> float:
        """The moment the share starts counting (`first_token_s` itself when there is no delay)."""
        return first_token_s + self.after_s

    def need_us(self, next_chunk_est_ms: float) -> int | None:
        """What a slice must hold to open for the next chunk: its estimate or the shortest slice, whichever is
        larger, and at most a whole slice (the probe); None for an estimate that is not a number of ms."""
        est_us = ms_to_us(next_chunk_est_ms)
        return None if est_us is None else min(max(est_us, self.min_slice_us), self.slice_us)

    def allowance_us(self, now: float, first_token_s: float, spent_us: int) -> int:
        """What the role may still spend this turn at `now`."""
        return self.budget.allowance_us(now, self.since_s(first_token_s), spent_us)

    def open_slice(self, now: float, first_token_s: float, spent_us: int,
                   next_chunk_est_ms: float) -> RationSlice | None:
        """A slice between two decode rounds, or None when the next chunk's estimate (at most a whole slice,
        see need_us) does not fit what the role earned."""
        need_us = self.need_us(next_chunk_est_ms)
        if need_us is None:
            return None
        budget_us = min(self.slice_us, self.allowance_us(now, first_token_s, spent_us))
        if need_us > budget_us:
            return None
        return RationSlice(now, budget_us, self.slice_us)

    def earliest_s(self, first_token_s: float, spent_us: int, next_chunk_est_ms: float) -> float | None:
        """The first moment a slice for a chunk of this estimate may open (a chunk estimated above a whole
        slice: when a whole slice is earned); None if it never can (the share is zero)."""
        need_us = self.need_us(next_chunk_est_ms)
        if need_us is None:
            return None
        return self.budget.earliest_s(self.since_s(first_token_s), spent_us, need_us)


class BusyShare:
    """The reader's share of all of the served model's device time, whatever turns run.

    A turn's ration (TurnRation) opens only past its delay, and under many agents every turn is shorter than
    that, while the idle window opens only when nothing runs or waits: a reader beside eight agents then reads
    almost nothing between their turns and is behind at their next ones. This share earns `share` of every
    microsecond of served device time (each turn's prefill and decode, from the ledger, with no delay) and is
    spent between two rounds, a shortest slice at a time, on the session the reader's order puts first
    (`pick_idle_session`: usually one whose agent is thinking, and whose next turn wants it read). What the
    turns' rations spend between rounds counts against it too, so the two never add up: between rounds the
    reader spends at most the larger of the two.

    The clock of the share is the served device time, not the wall: an idle server earns nothing, so a burst
    of work after a quiet hour does not find a large allowance waiting."""

    def __init__(self, share: float, slice_ms: float, min_slice_ms: float):
        self.rule = TurnRation(share, slice_ms, Window.RATION, 0.0, min_slice_ms)  # its checks and slice sizes
        self.share = self.rule.share

    @classmethod
    def reader(cls, policy) -> "BusyShare":
        return cls(policy.busy_share, policy.slice_ms, policy.min_slice_ms)

    def allowance_us(self, served_us: int, spent_us: int) -> int:
        """What may be spent now: the share of `served_us` less `spent_us` (every slice between rounds)."""
        return self.rule.budget.allowance_us(served_us / 1e6, 0.0, spent_us)

    def may_open(self, served_us: int, spent_us: int) -> bool:
        """Whether a slice of the shortest size is earned (the caller then gathers the backlogs)."""
        return self.allowance_us(served_us, spent_us) >= max(1, self.rule.min_slice_us)  # (a share of 0 earns 0)

    def open_slice(self, now: float, served_us: int, spent_us: int, next_chunk_est_ms: float) -> RationSlice | None:
        """A slice for a chunk of this estimate, or None when the share has not earned it (a chunk estimated
        above a whole slice waits for a whole slice and is read alone: the turn ration's probe)."""
        need_us = self.rule.need_us(next_chunk_est_ms)
        if need_us is None or self.share == 0:
            return None
        if need_us > self.allowance_us(served_us, spent_us):
            return None
        # one shortest slice (or one chunk, if dearer), never a whole one: every running turn waits for it, and
        # the share earned in a long prefill spent at once is a stall of every decoder (113 ms, seen on the H200)
        return RationSlice(now, need_us, self.rule.slice_us)
