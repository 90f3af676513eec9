"""Ranked locks for the device.

The engine lock is granted by rank, then by arrival: a served request (rank 0) is always granted
before the idle reader (the lowest rank), which also never queues: it takes the lock only when
nobody holds or waits for it, and gives it back before its next chunk once somebody waits.
Order of acquisition across locks is fixed (box lock, then holds, then engine lock); taking them in
another order is refused, which rules out the deadlock two actors with opposite orders would cause.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from typing import AsyncIterator

RANK_SERVED = 0
RANK_NARRATOR = 2
RANK_READER_IDLE = 4  # behind every waiter


class RankedLock:
    def __init__(self, name: str = "engine"):
        self.name = name
        self._held_by: int | None = None
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()

    @property
    def locked(self) -> bool:
        return self._held_by is not None

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @property
    def holder_rank(self) -> int | None:
        return self._held_by

    def has_waiter_above(self, rank: int) -> bool:
        """Someone of a better (smaller) rank waits: the holder of `rank` should yield at its next step."""
        return any(r < rank and not f.done() for r, _, f in self._waiters)

    def try_acquire(self, rank: int) -> bool:
        if self._held_by is None and self.num_waiting == 0:
            self._held_by = rank
            return True
        return False

    async def acquire(self, rank: int) -> None:
        if self.try_acquire(rank):
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (rank, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        if self._held_by is None:
            raise RuntimeError(f"release of {self.name} lock that is not held")
        self._held_by = None
        while self._waiters:
            rank, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                self._held_by = rank
                fut.set_result(None)
                return

    @asynccontextmanager
    async def hold(self, rank: int) -> AsyncIterator[None]:
        await self.acquire(rank)
        try:
            yield
        finally:
            self.release()


class LockOrderError(RuntimeError):
    pass


class LockBoard:
    """The box lock (whole machine: loads, maintenance), holds (operator pauses) and the engine lock."""

    ORDER = ("box", "hold", "engine")

    def __init__(self):
        self.box = asyncio.Lock()
        self.engine = RankedLock("engine")
        self.holds = 0

    def is_quiet(self) -> bool:
        """No request runs or waits, no hold, no box lock: the idle window may open."""
        return not self.box.locked() and self.holds == 0 and not self.engine.locked and self.engine.num_waiting == 0

    @staticmethod
    def check_order(held: list[str], wanted: str) -> None:
        """Refuse taking `wanted` while holding a lock that comes after it in ORDER."""
        rank = LockBoard.ORDER.index(wanted)
        for name in held:
            if LockBoard.ORDER.index(name) > rank:
                raise LockOrderError(f"taking the {wanted} lock while holding the {name} lock inverts the order {LockBoard.ORDER}")
