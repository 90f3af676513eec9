"""A file that goes (a session brought back, a stale file) is renamed out of the way on the owner's thread and
removed by the mover: unlinking a large file takes about a second, and the owner's thread runs the rounds."""

from __future__ import annotations

import os
import threading

import torch

from qse.sessions.grid import GridSessions
from qse.sessions.served import ServedSessions
from qse.store import ShadowStore, disk

GRID = 32


def _served(engine, store=None) -> ServedSessions:
    book = GridSessions(engine, grid=GRID, pool_bytes=16 << 20, residency=store, graphs=False, who="the served model")
    return ServedSessions(book)


def test_a_restored_sessions_file_is_renamed_away_and_removed_by_the_mover(tiny_engine, tmp_path, monkeypatch):
    store = ShadowStore(1 << 40, tmp_path / "served", journal=False, background_writes=True)
    served = _served(tiny_engine, store)
    prompt = torch.randint(0, 248000, (3 * GRID + 5,), generator=torch.Generator().manual_seed(5)).tolist()
    turn, _ = served.begin("a", prompt)
    served.finish(turn)
    assert store.park(served.book, served.book.get("a"), wait=True)
    path = store.parked["a"].path
    assert path.exists()
    real_unlink = os.unlink
    owner = threading.get_ident()
    threads: list[int] = []
    monkeypatch.setattr(os, "unlink", lambda p: threads.append(threading.get_ident()) or real_unlink(p))
    turn, _ = served.begin("a", prompt + [11])  # brought back from its file
    served.finish(turn)
    assert turn.start.tier == "disk" and not path.exists()  # gone from its name at once
    store.flush(served.book)
    left = sorted(os.listdir(path.parent))
    assert threads and owner not in threads  # the blocks were freed off the owner's thread
    assert not [n for n in left if disk.is_temp_name(n) or n == path.name], left


def test_a_doomed_file_left_by_a_crash_is_removed_at_attach(tiny_engine, tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    doomed = root / f".{disk.file_name('x')}.123.abcd{disk.TMP_SUFFIX}"
    doomed.write_bytes(b"\0" * 4096)
    store = ShadowStore(1 << 40, root, background_writes=True)
    served = _served(tiny_engine, store)
    store.attach(served.book)
    store.flush(served.book)
    assert not doomed.exists()


def test_a_journal_queued_before_its_session_closes_never_outlives_it(tiny_engine, tmp_path):
    store = ShadowStore(1 << 40, tmp_path / "served", journal=True, background_writes=True)
    served = _served(tiny_engine, store)
    store.attach(served.book)
    gate = threading.Event()
    store._journaler.submit(gate.wait, 60)  # the journal's thread is busy: what follows queues behind it
    prompt = torch.randint(0, 248000, (2 * GRID + 3,), generator=torch.Generator().manual_seed(6)).tolist()
    turn, _ = served.begin("a", prompt)  # its feed queues the journal
    served.finish(turn)
    served.book.close("a")  # queues the journal's removal
    journals = [n for n in os.listdir(tmp_path / "served") if n.endswith(".ids" + disk.SUFFIX)]
    assert journals == []  # nothing written yet
    gate.set()
    store.flush(served.book)
    assert [n for n in os.listdir(tmp_path / "served") if not disk.is_temp_name(n)] == []


def test_a_journal_written_by_the_mover_lets_a_restart_know_the_session(tiny_engine, tmp_path):
    store = ShadowStore(1 << 40, tmp_path / "served", journal=True, background_writes=True)
    served = _served(tiny_engine, store)
    store.attach(served.book)
    prompt = torch.randint(0, 248000, (2 * GRID + 3,), generator=torch.Generator().manual_seed(7)).tolist()
    turn, _ = served.begin("a", prompt)
    served.finish(turn)
    store.flush(served.book)
    again = ShadowStore(1 << 40, tmp_path / "served", journal=True, background_writes=True)
    restarted = _served(tiny_engine, again)
    report = again.attach(restarted.book)
    assert restarted.book.get("a").ids == prompt and report["journaled"] == 1


def test_a_load_with_no_room_on_the_device_reads_into_host_memory(tiny_engine, tmp_path, monkeypatch):
    from qse.store import store as store_mod

    store = ShadowStore(1 << 40, tmp_path / "served", background_writes=False)
    served = _served(tiny_engine, store)
    prompt = torch.randint(0, 248000, (3 * GRID + 5,), generator=torch.Generator().manual_seed(8)).tolist()
    turn, _ = served.begin("a", prompt)
    served.finish(turn)
    assert store.park(served.book, served.book.get("a"), wait=True)
    header = disk.read_header(store.parked["a"].path)
    real = disk.read_tensors

    def no_room(h, *args, device=None, **kwargs):
        if device is not None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")
        return real(h, *args, **kwargs)

    monkeypatch.setattr(disk, "read_tensors", no_room)
    tensors, copied = store_mod._read_state_file(header, torch.device("cuda"))
    assert copied is None and tensors.keys() == real(header).keys()
    assert all(t.device.type == "cpu" and torch.equal(t, real(header)[k]) for k, t in tensors.items())


def test_a_journal_does_not_wait_behind_a_sessions_big_write(tiny_engine, tmp_path, held_writes):
    store = ShadowStore(1 << 40, tmp_path / "served", journal=True, background_writes=True)
    served = _served(tiny_engine, store)
    store.attach(served.book)
    gen = torch.Generator().manual_seed(9)
    turn, _ = served.begin("a", torch.randint(0, 248000, (3 * GRID,), generator=gen).tolist())
    served.finish(turn)
    assert store.park(served.book, served.book.get("a"), wait=False)
    assert held_writes["started"].wait(timeout=60)  # a's file is being written, and held there
    prompt_b = torch.randint(0, 248000, (2 * GRID + 1,), generator=gen).tolist()
    turn, _ = served.begin("b", prompt_b)
    served.finish(turn)
    store._journaler.submit(lambda: None).result(timeout=60)  # the journal thread's queue, b's included, is done
    # ... while a's write still waits on the mover
    assert "a" in store.writing
    journal = disk.read_tensors(disk.read_header(tmp_path / "served" / (disk.file_name("b")[: -len(disk.SUFFIX)]
                                                                        + ".ids" + disk.SUFFIX)))["ids"]
    assert journal.tolist() == prompt_b
    held_writes["release"].set()
    store.flush(served.book)
