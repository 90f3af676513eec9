"""The runtime's locks: priority then arrival, cancellation, and core's rank order (no deadlock by inversion)."""

import asyncio

import pytest

from qse.core.locks import HeldLocks, LockRank, Priority, find_deadlock
from qse.runtime.locks import LockBoard, LockOrderError, RankedLock


async def _queue(lock: RankedLock, order: list[str], name: str, priority: Priority) -> asyncio.Task:
    """Start an actor that waits for `lock`, and return once it is queued."""
    before = lock.num_waiting

    async def actor():
        await lock.acquire(priority)
        order.append(name)
        lock.release()

    task = asyncio.create_task(actor(), name=name)
    await lock.wait_for_waiters(before + 1)
    return task


async def test_granted_by_priority_then_arrival():
    lock = RankedLock()
    assert lock.try_acquire(Priority.SERVED)
    order: list[str] = []
    tasks = [await _queue(lock, order, "idle", Priority.IDLE_READER),
             await _queue(lock, order, "turn2", Priority.SERVED),
             await _queue(lock, order, "narrator", Priority.NARRATOR),
             await _queue(lock, order, "ask", Priority.QUESTION),
             await _queue(lock, order, "turn3", Priority.SERVED)]
    assert lock.num_waiting == 5
    assert lock.has_waiter_above(Priority.IDLE_READER) and not lock.has_waiter_above(Priority.SERVED)
    assert not lock.try_acquire(Priority.SERVED)  # someone waits: never jump the queue
    lock.release()
    await asyncio.gather(*tasks)
    assert order == ["turn2", "turn3", "ask", "narrator", "idle"]
    assert not lock.locked and lock.num_waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue():
    lock = RankedLock()
    assert lock.try_acquire(Priority.SERVED)
    order: list[str] = []
    gone = await _queue(lock, order, "gone", Priority.SERVED)
    stays = await _queue(lock, order, "stays", Priority.QUESTION)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert lock.num_waiting == 1 and not lock.has_waiter_above(Priority.QUESTION)
    lock.release()
    await stays
    assert order == ["stays"] and not lock.locked


async def test_a_waiter_cancelled_after_its_grant_passes_the_lock_on():
    lock = RankedLock()
    assert lock.try_acquire(Priority.SERVED)
    order: list[str] = []
    first = await _queue(lock, order, "first", Priority.SERVED)
    second = await _queue(lock, order, "second", Priority.SERVED)
    lock.release()  # granted to "first", whose task has not run yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert order == ["second"] and not lock.locked


async def test_board_refuses_the_inverted_order_before_waiting():
    board = LockBoard()
    reader, loader = HeldLocks(), HeldLocks()
    async with board.engine_lock(Priority.IDLE_READER, reader):
        async with board.box_lock(loader):
            # the loader holds the box and asks for the engine (inverted): refused at once, it never waits,
            # so the reader (engine, then box) cannot end up waiting for it forever
            with pytest.raises(LockOrderError, match="engine lock while holding the box"):
                async with board.engine_lock(Priority.SERVED, loader):
                    pass
            assert board.engine.num_waiting == 0
            assert loader.held == (LockRank.BOX,)
            assert not board.try_box(reader)  # the idle reader does not wait for the box either
        assert board.try_box(reader)  # the loader let go: the reader takes it in rank order
        assert reader.held == (LockRank.ENGINE, LockRank.BOX)
        board.release_box(reader)
    assert reader.held == () and not board.engine.locked and not board.box.locked


async def test_hold_is_outermost():
    board = LockBoard()
    held = HeldLocks()
    async with board.hold(held):
        assert not board.is_quiet()
        async with board.engine_lock(Priority.SERVED, held):
            with pytest.raises(LockOrderError):
                async with board.hold(held):
                    pass
    assert board.is_quiet() and held.held == ()
    with pytest.raises(LockOrderError):
        LockBoard.check_order(["box"], "engine")
    LockBoard.check_order(["hold", "engine"], "box")


async def test_without_the_rank_check_the_inverted_order_deadlocks():
    """The same two actors on bare locks: each holds one and waits for the other (a wait-for cycle)."""
    engine, box = RankedLock("engine"), RankedLock("box")
    owner: dict[RankedLock, str] = {}
    waits_for: dict[str, str] = {}

    async def actor(name: str, first: RankedLock, second: RankedLock, both_hold: asyncio.Event):
        await first.acquire(Priority.SERVED)
        owner[first] = name
        both_hold.set() if len(owner) == 2 else None
        await both_hold.wait()
        waits_for[name] = owner[second]
        await second.acquire(Priority.SERVED)  # never granted

    both_hold = asyncio.Event()
    tasks = [asyncio.create_task(actor("reader", engine, box, both_hold)),
             asyncio.create_task(actor("loader", box, engine, both_hold))]
    await engine.wait_for_waiters(1)
    await box.wait_for_waiters(1)
    assert find_deadlock(waits_for) is not None and set(find_deadlock(waits_for)) == {"reader", "loader"}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
