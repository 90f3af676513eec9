"""Admission: requests into turns, a bounded queue in front of the conductor, and the ways a turn ends early.

    admit()      a Ticket, or 429 (Retry-After) past max_running + max_waiting, or 503 while stopping or dead
    start(t)     waits its turn, first in first out, for one of max_running slots (returns at once if ended)
    end(t, why)  the client left ("abort") or the server stops ("shutdown"): a waiting ticket leaves the queue
                 now, a running turn stops at its next decode step (Service.drive checks `ticket.ended`)
    release(t)   the request is over: its slot goes to the next waiter

The waiters are counted here, at the server's boundary: the conductor sees only the turns that run.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from .errors import ApiError

ABORT = "abort"  # the client left
SHUTDOWN = "shutdown"  # a planned stop ended the turn after its grace


@dataclass(eq=False)
class Ticket:
    request_id: str
    ended: str | None = None  # ABORT or SHUTDOWN once the turn must end
    is_running: bool = False
    is_released: bool = False
    _wake: asyncio.Future | None = field(default=None, repr=False)


class Admission:
    def __init__(self, max_running: int, max_waiting: int, turn_s_prior: float = 5.0):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"QSE_MAX_RUNNING must be >= 1 and QSE_MAX_WAITING >= 0, got {max_running} and "
                             f"{max_waiting}")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.live: dict[int, Ticket] = {}
        self._queue: deque[Ticket] = deque()
        self.num_running = 0
        self.refusal: ApiError | None = None  # set while stopping or once the engine failed
        self.turn_s = turn_s_prior  # a recent turn's wall time (moving average): the Retry-After estimate
        self._idle = asyncio.Event()  # no live ticket
        self._idle.set()

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def admit(self, request_id: str) -> Ticket:
        if self.refusal is not None:
            raise self.refusal
        if len(self.live) >= self.max_running + self.max_waiting:
            raise self._busy()
        ticket = Ticket(request_id)
        self.live[id(ticket)] = ticket
        self._idle.clear()
        return ticket

    def _busy(self) -> ApiError:
        """The 429 of a full server. Its counts are the admitted requests the limit counts: those that run, and
        all the others (in the queue, or still having their prompt read before they join it: `num_waiting`
        counts only the queue, and would say fewer wait than the limit holds)."""
        running = self.num_running
        waiting = len(self.live) - running
        ahead = len(self.live) - self.max_running + 1  # the turns to end before this one would run
        retry_s = max(1, math.ceil(self.turn_s * ahead / self.max_running))
        most = self.max_running + self.max_waiting
        return ApiError(429, f"the server is busy: {running} running and {waiting} waiting, the {most} it admits at "
                        f"once (QSE_MAX_RUNNING={self.max_running} + QSE_MAX_WAITING={self.max_waiting}); retry "
                        f"after {retry_s} s", code="server_busy", headers={"retry-after": str(retry_s)})

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no request is admitted; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError itself from 3.11)
            return False
        return True

    async def start(self, ticket: Ticket) -> None:
        """Wait for a running slot (first come, first served); at once if the ticket runs already or has ended."""
        if ticket.is_running or ticket.ended or ticket.is_released:
            return
        if self.num_running < self.max_running and not self._queue:
            self._run(ticket)
            return
        ticket._wake = asyncio.get_running_loop().create_future()
        self._queue.append(ticket)
        try:
            await ticket._wake
        finally:
            if ticket in self._queue:  # cancelled while waiting
                self._queue.remove(ticket)

    def _run(self, ticket: Ticket) -> None:
        ticket.is_running = True
        self.num_running += 1

    def end(self, ticket: Ticket, why: str) -> None:
        if ticket.ended is None and not ticket.is_released:
            ticket.ended = why
        if ticket in self._queue:
            self._queue.remove(ticket)
            if ticket._wake is not None and not ticket._wake.done():
                ticket._wake.set_result(None)

    def end_all(self, why: str) -> None:
        for ticket in list(self.live.values()):
            self.end(ticket, why)

    def release(self, ticket: Ticket) -> None:
        if ticket.is_released:
            return
        ticket.is_released = True
        self.live.pop(id(ticket), None)
        if not self.live:
            self._idle.set()
        if ticket in self._queue:
            self._queue.remove(ticket)
        if ticket.is_running:
            ticket.is_running = False
            self.num_running -= 1
        while self._queue and self.num_running < self.max_running:
            nxt = self._queue.popleft()
            self._run(nxt)
            if nxt._wake is not None and not nxt._wake.done():
                nxt._wake.set_result(None)

    def note_turn(self, seconds: float) -> None:
        self.turn_s = 0.8 * self.turn_s + 0.2 * max(0.0, seconds)
