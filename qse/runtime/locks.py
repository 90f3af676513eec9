"""The device's locks in real time, in the ranks and priorities qse/core defines.

    rank (core.LockRank), outermost first      who
    HOLD    a hold (benchmark, maintenance)    LockBoard.hold()
    ENGINE  one user of the device at a time   LockBoard.engine_lock(priority): a turn, a question, the narrator
    BOX     model loads, residency changes     LockBoard.box_lock(); the idle reader only tries it

An actor takes locks in rank order only: `HeldLocks` (core) refuses an out-of-rank acquisition before it
waits (LockOrderError), which rules out the deadlock two actors with opposite orders would make.

The engine lock is granted by priority (core.Priority), then by arrival: FIFO among served requests,
and a served request that comes later still goes before a question, the narrator and the idle reader.
The idle reader never queues: it takes the lock only when nobody holds or waits for it, and the box
lock without waiting, and it asks `has_waiter_above` before every chunk.

Everything here runs on the event loop, except `has_waiter_above` and `num_waiting`, which an executor
thread may ask (they read a list of ints the loop keeps).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..core.locks import HeldLocks, LockRank, Priority

# the old names of the priorities (kept for callers of the first conductor)
RANK_SERVED = Priority.SERVED
RANK_QUESTION = Priority.QUESTION
RANK_NARRATOR = Priority.NARRATOR
RANK_READER_IDLE = Priority.IDLE_READER


class LockOrderError(RuntimeError):
    """A lock was asked for out of rank (core.LockRank): take hold, then engine, then box."""


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    fut: asyncio.Future = field(compare=False)
    is_queued: bool = field(default=True, compare=False)


class RankedLock:
    """A lock granted by priority, then by arrival."""

    def __init__(self, name: str = "engine"):
        self.name = name
        self._owner: Priority | None = None
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._num_waiting = [0] * len(Priority)  # by priority; read from executor threads
        self._watchers: list[tuple[int, asyncio.Future]] = []

    @property
    def locked(self) -> bool:
        return self._owner is not None

    @property
    def holder(self) -> Priority | None:
        return self._owner

    @property
    def holder_rank(self) -> int | None:
        return None if self._owner is None else int(self._owner)

    @property
    def num_waiting(self) -> int:
        return sum(self._num_waiting)

    def has_waiter_above(self, priority: Priority) -> bool:
        """Someone more urgent than `priority` waits: its holder should let go before its next step."""
        counts = self._num_waiting
        return any(counts[p] for p in range(int(priority)))

    def try_acquire(self, priority: Priority) -> bool:
        """Take the lock only if nobody holds or waits for it (the idle reader's way); never waits."""
        if self._owner is None and self.num_waiting == 0:
            self._owner = Priority(priority)
            return True
        return False

    async def acquire(self, priority: Priority) -> None:
        if self.try_acquire(priority):
            return
        waiter = _Waiter(int(priority), next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self._num_waiting[waiter.priority] += 1
        self._notify_watchers()
        try:
            await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            elif waiter.is_queued:
                self._dequeue(waiter)
                self._heap.remove(waiter)
                heapq.heapify(self._heap)
            raise

    def _dequeue(self, waiter: _Waiter) -> None:
        waiter.is_queued = False
        self._num_waiting[waiter.priority] -= 1

    def release(self) -> None:
        if self._owner is None:
            raise RuntimeError(f"release of the {self.name} lock, which is not held")
        self._owner = None
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.is_queued:
                continue
            self._dequeue(waiter)
            if waiter.fut.done():  # cancelled, its task not resumed yet
                continue
            self._owner = Priority(waiter.priority)
            waiter.fut.set_result(None)
            return

    @asynccontextmanager
    async def hold(self, priority: Priority) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def wait_for_waiters(self, num: int) -> None:
        """Return once at least `num` actors wait for the lock (tests and watchdogs order on it, not on time)."""
        if self.num_waiting >= num:
            return
        fut = asyncio.get_running_loop().create_future()
        self._watchers.append((num, fut))
        await fut

    def _notify_watchers(self) -> None:
        n = self.num_waiting
        keep = []
        for num, fut in self._watchers:
            if fut.done():
                continue
            if n >= num:
                fut.set_result(None)
            else:
                keep.append((num, fut))
        self._watchers = keep


class LockBoard:
    """The holds, the engine lock and the box lock of one machine, taken in core's rank order."""

    ORDER = ("hold", "engine", "box")  # core.LockRank, outermost first
    _RANK_OF = {"hold": LockRank.HOLD, "engine": LockRank.ENGINE, "box": LockRank.BOX}

    def __init__(self) -> None:
        self.engine = RankedLock("engine")
        self.box = RankedLock("box")
        self.holds = 0

    def is_quiet(self) -> bool:
        """No request runs or waits, no hold, no box lock: the idle window may open."""
        return not self.box.locked and self.holds == 0 and not self.engine.locked and self.engine.num_waiting == 0

    @staticmethod
    def _take(held: HeldLocks, rank: LockRank) -> None:
        if not held.acquire(rank):
            names = ", ".join(r.name.lower() for r in held.held)
            raise LockOrderError(f"taking the {rank.name.lower()} lock while holding the {names} lock breaks the "
                                 f"order {LockBoard.ORDER}; take them outermost first")

    @staticmethod
    def check_order(held: list[str], wanted: str) -> None:
        """Refuse taking `wanted` while holding a lock that ranks at or after it."""
        actor = HeldLocks()
        for name in held:
            actor.acquire(LockBoard._RANK_OF[name])
        LockBoard._take(actor, LockBoard._RANK_OF[wanted])

    @asynccontextmanager
    async def engine_lock(self, priority: Priority, held: HeldLocks | None = None) -> AsyncIterator[None]:
        held = HeldLocks() if held is None else held
        self._take(held, LockRank.ENGINE)  # refused before it waits
        try:
            await self.engine.acquire(priority)
        except BaseException:
            held.release(LockRank.ENGINE)
            raise
        try:
            yield
        finally:
            self.engine.release()
            held.release(LockRank.ENGINE)

    @asynccontextmanager
    async def box_lock(self, held: HeldLocks | None = None) -> AsyncIterator[None]:
        held = HeldLocks() if held is None else held
        self._take(held, LockRank.BOX)
        try:
            await self.box.acquire(Priority.SERVED)
        except BaseException:
            held.release(LockRank.BOX)
            raise
        try:
            yield
        finally:
            self.box.release()
            held.release(LockRank.BOX)

    def try_box(self, held: HeldLocks) -> bool:
        """The box lock without waiting (the idle reader); False when someone has it or waits for it."""
        self._take(held, LockRank.BOX)
        if self.box.try_acquire(Priority.SERVED):
            return True
        held.release(LockRank.BOX)
        return False

    def release_box(self, held: HeldLocks) -> None:
        self.box.release()
        held.release(LockRank.BOX)

    @asynccontextmanager
    async def hold(self, held: HeldLocks | None = None) -> AsyncIterator[None]:
        """A hold: the idle window stays shut while it lasts (taken before any other lock)."""
        held = HeldLocks() if held is None else held
        self._take(held, LockRank.HOLD)
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1
            held.release(LockRank.HOLD)
