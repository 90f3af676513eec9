"""A book's status is a snapshot its owning thread publishes: another thread reads it while sessions are fed,
read, moved and closed, and never meets a container changing under it; a safe point keeps the host cap."""

from __future__ import annotations

import threading

import torch

from qse.sessions.grid import GridSessions
from qse.store import ShadowStore

GRID = 16


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=gen).tolist()


def test_status_under_concurrent_feeds_never_raises(tiny_engine):
    book = GridSessions(tiny_engine, grid=GRID, pool_bytes=tiny_engine.state_bytes_per_token() * 40 * GRID,
                        recent_checkpoints=2, graphs=False)
    done, errors, seen = threading.Event(), [], []

    def owner():  # the owning thread: feeds, reads, closes
        try:
            gen = torch.Generator().manual_seed(0)
            for k in range(12):
                sid = f"s{k % 4}"
                book.feed(sid, _ids(gen, 3 * GRID + k), prompt_end=3 * GRID + k)
                book.read_all(sid)
                if k % 5 == 4:
                    book.close(sid)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=owner)
    thread.start()
    while not done.is_set():  # the status side: read the snapshot as fast as it can
        snap = book.snapshot
        assert snap.resident_nbytes == sum(v.nbytes for v in snap.sessions)
        seen.append(len(snap.sessions))
    thread.join()
    assert errors == []
    final = book.snapshot
    assert {v.session_id for v in final.sessions} == set(book.sessions)
    assert all(v.position == book.sessions[v.session_id].committed for v in final.sessions)
    assert seen  # the status side read at least once while the owner ran


def test_a_safe_point_keeps_the_host_cap_of_the_readers_book(tiny_engine, tmp_path):
    """Reads push other sessions out by copies to the host only (the mover writes files); the safe point the
    conductor's idle window calls hands the oldest host states to the mover until the host cap holds."""
    pool = tiny_engine.state_bytes_per_token() * 40 * GRID
    gen = torch.Generator().manual_seed(1)
    prompts = [_ids(gen, 3 * GRID + 1 + k) for k in range(5)]
    probe = GridSessions(tiny_engine, grid=GRID, pool_bytes=pool, graphs=False)
    probe.feed("p", prompts[0])
    probe.read_all("p")
    one = probe.get("p").nbytes
    store = ShadowStore(cap_nbytes=int(one * 1.5), disk_dir=tmp_path, host_cap_nbytes=int(one * 1.5),
                        background_writes=True)
    book = GridSessions(tiny_engine, grid=GRID, pool_bytes=pool, residency=store, graphs=False)
    try:
        for k, ids in enumerate(prompts):
            book.feed(f"s{k}", ids)
            book.read_all(f"s{k}")
            book.safe_point()  # what the conductor's idle window calls
            assert store.host_nbytes() <= store.host_cap_nbytes
            assert book.snapshot.num_resident == sum(1 for s in book.sessions.values() if s.is_resident)
        store.flush(book)
        assert store.counts.host_moves > 0 and store.counts.host_spills > 0
    finally:
        store.flush(book)
