"""The idle window: the reader reads when nothing of the served model runs or waits.

Every `poll_s` the runtime asks `IdleWindow.may_open`. When no request runs or waits and no hold
or box lock is on, it takes the engine lock behind every waiter (the lowest rank, see locks.py) and
opens an `IdleBurst`: the reader may read for at most `burst_s`, asking before every chunk whether
a request waits, so an arriving request waits at most one chunk. A chunk whose estimate would end
past the burst is not started, except a chunk estimated above a whole burst, which is read alone as the
burst's first chunk (a probe): its measurement replaces the estimate, so one slow measurement (a chunk
read under load) never shuts the window at that context for good, since nothing else would measure that
context again. A request still waits at most one chunk. The next poll comes `poll_s` after the burst (or the empty look) ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from qse.core.drive import SpendDecision
from qse.core.share import s_to_us


class IdleBurst(SpendDecision):
    """One burst of the idle window, opened at `opened_s`; the wall clock bounds it."""

    def __init__(self, opened_s: float, burst_s: float):
        super().__init__()
        self.opened_s = opened_s
        self.burst_us = s_to_us(burst_s)

    def left_us(self, now: float) -> int:
        return max(0, self.burst_us - max(0, s_to_us(now - self.opened_s)))

    def may_read_next(self, now: float, request_waiting: bool, next_chunk_est_ms: float) -> bool:
        """Start another chunk? Not once a request waits, nor if it would end past the burst (unless it is
        the burst's first and estimated above a whole burst: the probe)."""
        if request_waiting:
            return False
        return self.admit(next_chunk_est_ms, self.left_us(now), self.burst_us)


class IdleWindow:
    def __init__(self, poll_s: float = 0.2, burst_s: float = 2.0):
        if not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"idle poll must be a positive number of seconds, got {poll_s!r}")
        if not (burst_s > 0 and math.isfinite(burst_s)):
            raise ValueError(f"idle burst must be a positive number of seconds, got {burst_s!r}")
        self.poll_s = float(poll_s)
        self.burst_s = float(burst_s)

    @classmethod
    def of(cls, policy) -> "IdleWindow":
        """The window as `policy` (qse.policy.Policy, or anything with its fields) sets it."""
        return cls(policy.idle_poll_s, policy.idle_burst_s)

    @staticmethod
    def may_open(*, request_running: bool, request_waiting: bool, hold_on: bool, box_locked: bool) -> bool:
        """The idle window opens only when no request runs or waits and no hold or box lock is on."""
        return not (request_running or request_waiting or hold_on or box_locked)

    def open(self, now: float) -> IdleBurst:
        return IdleBurst(now, self.burst_s)

    def next_poll_s(self, now: float) -> float:
        """When to look again after a look (or a burst) that ended at `now`."""
        return now + self.poll_s

    def first_poll_at_or_after(self, last_poll_s: float, t: float) -> float:
        """The first look at or after `t` of a loop that last looked at `last_poll_s` and found work busy."""
        if t <= last_poll_s:
            return last_poll_s
        # round first so 0.6 / 0.2 = 2.9999999999999996 counts as 3 looks, and never answer before t
        n = math.ceil(round((t - last_poll_s) / self.poll_s, 9))
        return max(t, last_poll_s + n * self.poll_s)


@dataclass(frozen=True)
class SessionBacklog:
    """What the idle window needs to know of one session to choose it."""

    unread_since_s: float  # when its oldest unread whole chunk became known
    num_chunks: int  # whole chunks unread
    committed_rows: int = 0  # rows the reader holds (where its next chunk's cost is estimated)


READ_OVERDUE_S = 10.0  # an unread chunk this old is read before any fresher backlog, however short
READ_ORDERS = ("shortest", "oldest")  # QSE_SHADOW_READ_ORDER


def idle_read_order(backlog: SessionBacklog, now: float, order: str = "shortest") -> tuple:
    """Sort key of the sessions the reader may read next (the idle window's and the busy share's).

    "oldest" (the order until 2026-12-04): the oldest unread chunk first. "shortest": the fewest unread chunks
    first, ties oldest first (then by id, in the caller's key). A turn start finds its session fresh or not, so
    reading the shortest backlog first makes the most sessions fresh at every moment (oldest first, a short idle
    window after a burst of first prompts read one long session while shorter ones went stale,
    benchmarks/NOTES.md). A session whose oldest unread chunk has waited READ_OVERDUE_S goes before every one
    that has not (overdue ones oldest first), so short backlogs that keep coming never starve a long one. Both
    use only what is known now; ordering sessions by when they will be asked is not a policy qse may use.
    """
    if order == "oldest" or now - backlog.unread_since_s >= READ_OVERDUE_S:
        return (0, backlog.unread_since_s, 0)
    return (1, backlog.num_chunks, backlog.unread_since_s)


def pick_idle_session(backlogs: Mapping[str, SessionBacklog], now: float, order: str = "shortest") -> str | None:
    """The session to read next by `idle_read_order` at `now` (ties by id); None when nothing is unread."""
    best: tuple | None = None
    for session_id, backlog in backlogs.items():
        if backlog.num_chunks <= 0:
            continue
        key = (*idle_read_order(backlog, now, order), session_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]
