"""Moves beside the work: a session's file is written by the mover thread; a turn on another session goes on
meanwhile, a turn on the moving session reads its host copy bit for bit, and a turn's own evictions only
copy to the host (the host cap is kept at the next safe point, by the mover)."""

from __future__ import annotations

import torch

from qse.sessions.grid import GridSessions
from qse.sessions.served import ServedSessions
from qse.store import ShadowStore

GRID = 32
VOCAB = 248000


def _served(engine, store=None) -> ServedSessions:
    book = GridSessions(engine, grid=GRID, pool_bytes=16 << 20, residency=store, graphs=False, recent_checkpoints=2,
                        who="the served model")
    return ServedSessions(book)


def _ids(gen, n):
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def _turn(served, sid, prompt):
    turn, logits = served.begin(sid, prompt)
    first = logits[-1].clone()
    served.finish(turn)
    return first, turn.start


def _store(tmp_path, cap=1 << 40, host_cap=0):
    return ShadowStore(cap, tmp_path / "served", host_cap_nbytes=host_cap, journal=True, background_writes=True)


def test_a_park_in_flight_leaves_other_turns_running_and_the_file_lands(tiny_engine, tmp_path, held_writes):
    store = _store(tmp_path)
    served = _served(tiny_engine, store)
    gen = torch.Generator().manual_seed(21)
    a, b = _ids(gen, 3 * GRID + 5), _ids(gen, 2 * GRID + 3)
    _turn(served, "a", a)
    assert store.park(served.book, served.book.get("a"), wait=False)
    assert held_writes["started"].wait(timeout=60)  # the mover holds the write
    _, start = _turn(served, "b", b)  # another session's turn runs while the write waits
    assert start.tail_tokens > 0 and "a" in store.writing and store.tier_of("a") == "host"
    held_writes["release"].set()
    store.flush(served.book)
    assert store.tier_of("a") == "disk" and store.parked["a"].path.exists() and not store.writing
    first, start = _turn(served, "a", a + [7])
    cold = _served(tiny_engine)
    cold_first, _ = _turn(cold, "cold", a + [7])
    assert start.tier == "disk" and torch.equal(first, cold_first)


def test_a_turn_on_a_session_still_being_written_reads_its_host_copy_exactly(tiny_engine, tmp_path, held_writes):
    store = _store(tmp_path)
    served = _served(tiny_engine, store)
    gen = torch.Generator().manual_seed(22)
    a = _ids(gen, 3 * GRID + 5)
    _turn(served, "a", a)
    assert store.park(served.book, served.book.get("a"), wait=False)
    assert held_writes["started"].wait(timeout=60)
    nxt = a + _ids(gen, GRID + 2)
    first, start = _turn(served, "a", nxt)  # does not wait for the write
    assert start.tier == "host" and start.cached_tokens == 3 * GRID
    cold = _served(tiny_engine)
    cold_first, _ = _turn(cold, "cold", nxt)
    assert torch.equal(first, cold_first)
    assert served.book.state_equal(served.book.get("a"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}
    path = store.writing["a"].path
    held_writes["release"].set()
    store.flush(served.book)
    assert "a" not in store.parked and not path.exists()  # the late file is stale: removed


def test_a_turns_evictions_only_copy_to_the_host_and_the_caps_hold_after_it(tiny_engine, tmp_path, held_writes):
    probe = _served(tiny_engine)
    gen = torch.Generator().manual_seed(23)
    prompts = {sid: _ids(gen, 3 * GRID + 1 + i) for i, sid in enumerate("abcd")}
    _turn(probe, "p", prompts["a"])
    one = probe.book.get("p").nbytes
    store = _store(tmp_path, cap=int(one * 1.5), host_cap=int(one * 1.5))
    served = _served(tiny_engine, store)
    for sid in "abcd":
        turn, _ = served.begin(sid, prompts[sid])
        # inside the turn: the sessions pushed out were copied to the host, nothing was handed to a disk
        assert held_writes["calls"] == 0 and not store.writing
        served.finish(turn)  # a safe point: the host cap is kept, the oldest host state goes to the mover
        resident = [s for s in served.book.sessions.values() if s.is_resident]
        assert len(resident) == 1 or served.book.resident_nbytes() <= store.cap_nbytes
        assert store.host_nbytes() <= store.host_cap_nbytes
        held_writes["release"].set()
        store.flush(served.book)
        held_writes["release"].clear()
        held_writes["calls"] = 0
    assert store.tier_of("a") == "disk" and store.stats()["host_spills"] >= 1
    first, start = _turn(served, "a", prompts["a"] + [3])
    cold = _served(tiny_engine)
    cold_first, _ = _turn(cold, "cold", prompts["a"] + [3])
    assert start.tier == "disk" and torch.equal(first, cold_first)


def test_a_turn_runs_while_a_parked_session_loads_and_the_loaded_one_equals_a_cold_prefill(tiny_engine, tmp_path,
                                                                                           held_loads):
    store = _store(tmp_path)
    served = _served(tiny_engine, store)
    gen = torch.Generator().manual_seed(24)
    a, b = _ids(gen, 3 * GRID + 5), _ids(gen, 2 * GRID + 3)
    _turn(served, "a", a)
    assert store.park(served.book, served.book.get("a"))
    store.flush(served.book)
    assert not served.is_ready("a")
    loads = served.prefetch(["a", "b"])  # b is not parked: nothing to load
    assert len(loads) == 1 and held_loads["started"].wait(timeout=60)
    _, start = _turn(served, "b", b)  # another session's turn runs while the load waits
    assert start.tail_tokens > 0 and not served.is_ready("a") and not served.book.get("a").is_resident
    held_loads["release"].set()
    loads[0].result(timeout=60)
    assert served.prefetch(["a"]) == [] and served.is_ready("a")  # landed at that safe point
    nxt = a + _ids(gen, GRID + 2)
    first, start = _turn(served, "a", nxt)
    assert (start.tier, start.cached_tokens) == ("disk", 3 * GRID) and start.restore_ms > 0
    cold = _served(tiny_engine)
    cold_first, _ = _turn(cold, "cold", nxt)
    assert torch.equal(first, cold_first)
    assert served.book.state_equal(served.book.get("a"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}
    assert served.counts["hits_disk"] == 1 and store.stats()["restores"] == 1 and held_loads["calls"] == 1
