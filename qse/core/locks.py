"""Lock ranks as data, and a checker that refuses an acquisition out of rank.

Ranks, outermost first:

    HOLD    a hold (a benchmark or maintenance reservation of the engine): taken before anything else
    ENGINE  the engine lock: one user of the device at a time; waiters queue by priority
    BOX     the box lock (model loads and residency changes on this machine): taken inside the engine lock

An actor may take a lock only if every lock it holds has a lower rank. Two actors that take the same
two locks in opposite orders can each end up holding one and waiting for the other (a deadlock);
the checker refuses the second actor's out-of-rank acquisition before it waits, and `find_deadlock`
names a cycle in a wait-for graph, for tests and for the runtime's watchdog.

The idle reader takes the engine lock behind every waiter: `EngineLockQueue` grants by priority, the
idle reader's is the lowest, and a waiter that comes later still goes before a queued idle reader.
The idle reader takes the box lock without waiting (it skips the burst when the box is locked).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Hashable, Iterable, Mapping


class LockRank(IntEnum):
    HOLD = 1
    ENGINE = 2
    BOX = 3


class Priority(IntEnum):
    """Engine-lock waiters, most urgent first."""

    SERVED = 0  # a served request
    QUESTION = 1  # a question to the reader (ask)
    NARRATOR = 2
    IDLE_READER = 3  # behind every waiter


def may_acquire(held: Iterable[LockRank], wanted: LockRank) -> bool:
    """True when every lock held ranks below `wanted`."""
    return all(rank < wanted for rank in held)


class HeldLocks:
    """The locks one actor holds, refusing out-of-rank acquisitions."""

    def __init__(self) -> None:
        self._held: list[LockRank] = []

    @property
    def held(self) -> tuple[LockRank, ...]:
        return tuple(self._held)

    def can_acquire(self, wanted: LockRank) -> bool:
        return may_acquire(self._held, wanted)

    def acquire(self, wanted: LockRank) -> bool:
        """Note `wanted` as held; False (nothing noted) when that would break the rank order."""
        if not self.can_acquire(wanted):
            return False
        self._held.append(wanted)
        return True

    def release(self, rank: LockRank) -> bool:
        """Note `rank` as released; False if it is not held or not the innermost held lock."""
        if not self._held or self._held[-1] != rank:
            return False
        self._held.pop()
        return True


class LockTable:
    """A model of locks and their owners: who holds what, who waits for what (no threads, no time)."""

    def __init__(self, check_ranks: bool = True) -> None:
        self.check_ranks = check_ranks
        self._owner: dict[LockRank, Hashable] = {}
        self._held: dict[Hashable, list[LockRank]] = {}
        self._waiting: dict[Hashable, LockRank] = {}

    def held_by(self, actor: Hashable) -> tuple[LockRank, ...]:
        return tuple(self._held.get(actor, ()))

    def try_acquire(self, actor: Hashable, lock: LockRank) -> bool | None:
        """True: granted. False: `actor` now waits for the owner. None: refused, out of rank."""
        held = self._held.setdefault(actor, [])
        if self.check_ranks and not may_acquire(held, lock):
            return None
        owner = self._owner.get(lock)
        if owner is not None and owner != actor:
            self._waiting[actor] = lock
            return False
        self._owner[lock] = actor
        held.append(lock)
        self._waiting.pop(actor, None)
        return True

    def release(self, actor: Hashable, lock: LockRank) -> bool:
        if self._owner.get(lock) != actor:
            return False
        del self._owner[lock]
        self._held[actor].remove(lock)
        return True

    def waits_for(self) -> dict[Hashable, Hashable]:
        """actor -> the actor that owns the lock it waits for."""
        return {a: self._owner[lock] for a, lock in self._waiting.items() if lock in self._owner}


def find_deadlock(waits_for: Mapping[Hashable, Hashable]) -> list[Hashable] | None:
    """A cycle in a wait-for graph (each actor waits for at most one other), or None."""
    for start in waits_for:
        seen: list[Hashable] = []
        actor = start
        while actor in waits_for and actor not in seen:
            seen.append(actor)
            actor = waits_for[actor]
        if actor in seen:
            return seen[seen.index(actor):]
    return None


class EngineLockQueue:
    """Who gets the engine lock next: by priority, then by arrival. Pure bookkeeping, no waiting."""

    def __init__(self) -> None:
        self._owner: Hashable | None = None
        self._waiters: list[tuple[Priority, int, Hashable]] = []
        self._ticket = 0

    @property
    def owner(self) -> Hashable | None:
        return self._owner

    def has_waiter(self, below: Priority = Priority.IDLE_READER) -> bool:
        """Whether anyone more urgent than `below` waits (what the idle reader asks before every chunk)."""
        return any(p < below for p, _, _ in self._waiters)

    def request(self, actor: Hashable, priority: Priority) -> bool:
        """Granted at once (True) when the lock is free and no one more urgent waits; else queued (False)."""
        if self._owner is None and not any(p <= priority for p, _, _ in self._waiters):
            self._owner = actor
            return True
        self._waiters.append((priority, self._ticket, actor))
        self._ticket += 1
        return False

    def release(self, actor: Hashable) -> Hashable | None:
        """Release by its owner; returns the next owner (or None). A non-owner's release is ignored."""
        if self._owner != actor:
            return self._owner
        self._owner = None
        if self._waiters:
            self._waiters.sort()
            _, _, self._owner = self._waiters.pop(0)
        return self._owner

    def withdraw(self, actor: Hashable) -> bool:
        """Leave the queue (an idle reader that gave up); False if `actor` was not waiting."""
        before = len(self._waiters)
        self._waiters = [w for w in self._waiters if w[2] != actor]
        return len(self._waiters) != before
