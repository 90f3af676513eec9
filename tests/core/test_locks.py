"""Lock ranks: an out-of-rank acquisition is refused; the inverted order deadlocks without the check."""

import threading

from qse.core.locks import (EngineLockQueue, HeldLocks, LockRank, LockTable, Priority, find_deadlock,
                            may_acquire)


def test_ranks_in_order_only():
    assert may_acquire((), LockRank.BOX)
    assert may_acquire((LockRank.HOLD, LockRank.ENGINE), LockRank.BOX)
    assert not may_acquire((LockRank.BOX,), LockRank.ENGINE)
    assert not may_acquire((LockRank.ENGINE,), LockRank.ENGINE)  # not re-entrant

    held = HeldLocks()
    assert held.acquire(LockRank.ENGINE)
    assert held.acquire(LockRank.BOX)
    assert not held.acquire(LockRank.HOLD)  # a hold is taken before anything else
    assert held.held == (LockRank.ENGINE, LockRank.BOX)
    assert not held.release(LockRank.ENGINE)  # innermost first
    assert held.release(LockRank.BOX) and held.release(LockRank.ENGINE)
    assert held.held == ()


def _inverted_interleaving(table: LockTable):
    """The reader takes engine then box; a loader (inverted) takes box then engine; they interleave."""
    steps = [
        ("reader", LockRank.ENGINE),
        ("loader", LockRank.BOX),
        ("reader", LockRank.BOX),
        ("loader", LockRank.ENGINE),
    ]
    return [table.try_acquire(actor, lock) for actor, lock in steps]


def test_the_inverted_order_deadlocks_without_the_check():
    table = LockTable(check_ranks=False)
    assert _inverted_interleaving(table) == [True, True, False, False]
    cycle = find_deadlock(table.waits_for())
    assert cycle is not None and set(cycle) == {"reader", "loader"}


def test_the_check_refuses_the_inverted_acquisition_and_nothing_deadlocks():
    table = LockTable(check_ranks=True)
    assert _inverted_interleaving(table) == [True, True, False, None]  # the loader's engine: refused
    assert table.waits_for() == {"reader": "loader"}
    assert find_deadlock(table.waits_for()) is None
    # the loader backs off, releasing the box; the reader gets it
    assert table.release("loader", LockRank.BOX)
    assert table.try_acquire("reader", LockRank.BOX) is True
    assert table.held_by("reader") == (LockRank.ENGINE, LockRank.BOX)


def test_find_deadlock():
    assert find_deadlock({}) is None
    assert find_deadlock({"a": "b", "b": "c"}) is None
    assert find_deadlock({"a": "b", "b": "c", "c": "b"}) == ["b", "c"]


def test_real_threads_deadlock_in_the_inverted_order():
    """Two threads, two locks, opposite orders: each holds one and times out waiting for the other.
    The barrier orders them (both hold their first lock before either tries its second); no sleeps."""
    engine, box = threading.Lock(), threading.Lock()
    both_hold = threading.Barrier(2, timeout=5)
    got_second: dict[str, bool] = {}

    def actor(name, first, second):
        with first:
            both_hold.wait()
            got_second[name] = second.acquire(timeout=0.2)
            if got_second[name]:
                second.release()
            both_hold.wait()  # neither lets go of its first lock before both have tried

    threads = [threading.Thread(target=actor, args=("reader", engine, box)),
               threading.Thread(target=actor, args=("loader", box, engine))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert got_second == {"reader": False, "loader": False}  # the deadlock the rank check prevents


def test_real_threads_in_rank_order_both_finish():
    engine, box = threading.Lock(), threading.Lock()
    order = {"reader": HeldLocks(), "loader": HeldLocks()}
    done: list[str] = []

    def actor(name):
        held = order[name]
        for rank, lock in ((LockRank.ENGINE, engine), (LockRank.BOX, box)):
            assert held.acquire(rank)
            assert lock.acquire(timeout=5)
        done.append(name)
        box.release(); held.release(LockRank.BOX)
        engine.release(); held.release(LockRank.ENGINE)

    threads = [threading.Thread(target=actor, args=(n,)) for n in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(done) == ["loader", "reader"]


def test_idle_reader_takes_the_engine_lock_behind_every_waiter():
    q = EngineLockQueue()
    assert q.request("turn1", Priority.SERVED)
    assert not q.request("idle", Priority.IDLE_READER)
    assert not q.request("turn2", Priority.SERVED)  # came later, still goes first
    assert not q.request("ask", Priority.QUESTION)
    assert q.has_waiter()
    assert q.release("turn1") == "turn2"
    assert q.release("turn2") == "ask"
    assert not q.has_waiter()  # only the idle reader is left
    assert q.release("ask") == "idle"
    assert q.release("someone-else") == "idle"  # a non-owner's release changes nothing
    assert q.release("idle") is None
    # the idle reader is not granted at once while another waits, and may withdraw
    assert q.request("turn3", Priority.SERVED)
    assert not q.request("idle", Priority.IDLE_READER)
    assert q.withdraw("idle") and not q.withdraw("idle")
    assert q.release("turn3") is None
