"""Read-ahead of parked files: the loader thread reads a session's file into host memory beside the work, the
read lands at the next poll on the owner's thread, and the session then comes back without a file read there,
bit for bit; a bad file found by the loader is a miss; a session fed or closed meanwhile gets a correct outcome."""

from __future__ import annotations

from pathlib import Path

import qse.store.store as store_mod
from qse.store import disk
from store_helpers import GRID, assert_fresh, assert_same, make_reader, random_ids, snapshot


def _parked(engine, tmp_path: Path, sid: str = "a", rows: int = 3 * GRID + 5, **store_kwargs):
    reader, store = make_reader(engine, tmp_path, **store_kwargs)
    reader.feed(sid, random_ids(1, rows), now=1.0)
    reader.read_all(sid)
    snap = snapshot(reader, reader.get(sid))
    assert store.park(reader, reader.get(sid))
    return reader, store, snap


def test_a_load_in_flight_leaves_reads_going_and_lands_bit_exact(engine, tmp_path, held_loads):
    reader, store, snap = _parked(engine, tmp_path)
    assert not store.ready("a") and store.tier_of("a") == "disk"
    load = store.prefetch(reader, "a")
    assert load is not None and held_loads["started"].wait(timeout=60)
    reader.feed("b", random_ids(2, 2 * GRID + 3), now=2.0)  # another session is read while the load waits
    assert len(reader.read_all("b")) == 2
    assert "a" in store.loading and not store.ready("a") and not reader.get("a").is_resident
    held_loads["release"].set()
    load.result(timeout=60)
    assert not store.ready("a")  # read, not landed: only the owner's thread lands it
    store.safe_point(reader)
    assert store.ready("a") and store.tier_of("a") == "disk"  # the file stays parked until the session is back
    assert store.prefetch(reader, "a") is None
    reader.ensure_resident(reader.get("a"))
    assert_same(reader, reader.get("a"), snap)
    stats = store.stats()
    assert (stats["restores"], stats["prefetches"], stats["fetched_sessions"], stats["files"]) == (1, 1, 0, 0)
    assert stats["last_restore_ms"]["tier"] == "disk" and stats["last_restore_ms"]["prefetch_ms"] > 0
    assert held_loads["calls"] == 1 and not (tmp_path / disk.file_name("a")).exists()


def test_a_restore_that_meets_its_load_in_flight_waits_for_it_and_reads_once(engine, tmp_path, monkeypatch):
    reader, store, snap = _parked(engine, tmp_path)
    calls = []
    real = store_mod._load_job
    monkeypatch.setattr(store_mod, "_load_job", lambda *a: calls.append(a[0]) or real(*a))
    store.prefetch(reader, "a")
    reader.ensure_resident(reader.get("a"))  # may come before the load finishes: it waits for that read
    assert_same(reader, reader.get("a"), snap)
    assert len(calls) == 1 and store.stats()["restores"] == 1 and not store.loading and not store.fetched


def test_a_bad_file_found_by_the_loader_is_a_miss_and_read_again(engine, ref, tmp_path):
    reader, store, _ = _parked(engine, tmp_path)
    path = tmp_path / disk.file_name("a")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the body
    path.write_bytes(bytes(data))
    load = store.prefetch(reader, "a")
    assert isinstance(load.exception(timeout=60), disk.FileMiss)
    assert store.misses == {}  # counted when it lands, on the owner's thread
    store.flush(reader)
    assert store.misses["checksum"] == 1 and store.ready("a") and store.tier_of("a") is None
    assert not path.exists() and reader.get("a").committed == 0
    reader.read_all("a")
    assert_fresh(reader, "a", ref)


def test_a_session_closed_during_its_load_leaves_nothing_behind(engine, tmp_path, held_loads):
    reader, store, _ = _parked(engine, tmp_path)
    store.prefetch(reader, "a")
    assert held_loads["started"].wait(timeout=60)
    reader.close("a")
    held_loads["release"].set()
    store.flush(reader)
    assert sorted(tmp_path.iterdir()) == [] and not store.loading and not store.fetched and not store.parked
    assert store.misses == {} and "a" not in reader.sessions


def test_a_session_fed_during_its_load_goes_back_where_its_ids_differ(engine, ref, tmp_path, held_loads):
    reader, store, _ = _parked(engine, tmp_path)
    store.prefetch(reader, "a")
    assert held_loads["started"].wait(timeout=60)
    ids = list(reader.get("a").ids)
    ids[GRID + 3] = (ids[GRID + 3] + 1) % 4000  # a re-rendered prompt: the state goes back below row GRID + 3
    reader.feed("a", ids + random_ids(3, GRID), now=3.0)
    held_loads["release"].set()
    store.flush(reader)
    assert store.ready("a")
    reader.read_all("a")
    assert_fresh(reader, "a", ref)
    assert store.stats()["restores"] == 1 and reader.get("a").stats.rollbacks == 1


def test_read_ahead_copies_stay_within_the_host_cap_and_one_let_go_is_read_from_its_file(engine, ref, tmp_path):
    reader, store, _ = _parked(engine, tmp_path)  # host cap 0: one read-ahead copy at a time
    reader.feed("b", random_ids(2, 2 * GRID + 3), now=2.0)
    reader.read_all("b")
    assert store.park(reader, reader.get("b"))
    store.prefetch(reader, "a").result(timeout=60)
    store.flush(reader)
    store.prefetch(reader, "b").result(timeout=60)
    store.flush(reader)
    assert list(store.fetched) == ["b"] and store.stats()["prefetch_drops"] == 1
    assert not store.ready("a") and store.tier_of("a") == "disk"
    for sid in "ab":
        reader.read_all(sid)
        assert_fresh(reader, sid, ref)
    stats = store.stats()
    assert stats["restores"] == 2 and stats["files"] == 0 and stats["misses"] == {}
