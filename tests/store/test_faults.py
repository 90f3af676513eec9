"""Faults: a writer killed mid-file, torn and corrupt files, a read-only directory, a full disk.

Each is a miss (counted by reason, the file removed) and a read again from row 0; the reader keeps
serving, and no other session is touched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qse.store import disk
from store_helpers import GRID, assert_fresh, assert_same, make_reader, random_ids, rewrite_meta, snapshot

REPO = Path(__file__).resolve().parents[2]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def two_parked(engine, d: Path):
    """Sessions a and b read and parked; b's snapshot and file hash to check it is untouched."""
    reader, store = make_reader(engine, d)
    for i, k in enumerate("ab"):
        reader.feed(k, random_ids(10 + i, 3 * GRID + 4), prompt_end=2 * GRID + 1, now=float(i))
        reader.read_all(k)
    snap_b = snapshot(reader, reader.get("b"))
    assert store.park(reader, reader.get("a")) and store.park(reader, reader.get("b"))
    return reader, store, snap_b, sha(d / disk.file_name("b"))


def read_again_and_check(reader, store, ref, d: Path, snap_b, sha_b, reason: str) -> None:
    a = reader.get("a")
    chunks = a.stats.chunks_read
    assert sha(d / disk.file_name("b")) == sha_b  # b's file was never touched
    reader.feed("a", a.ids, now=10.0)
    reader.read_all("a")
    assert store.stats()["misses"] == {reason: 1}
    assert a.stats.chunks_read == chunks + 3  # read again from row 0
    assert not (d / disk.file_name("a")).exists()
    assert_fresh(reader, "a", ref)
    reader.feed("b", reader.get("b").ids, now=11.0)
    reader.read_all("b")
    assert_same(reader, reader.get("b"), snap_b)
    assert store.stats()["restores"] == 1


def truncate_half(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def truncate_header(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:5])


def zero_length(p: Path) -> None:
    p.write_bytes(b"")


def flip_data_byte(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0x10
    p.write_bytes(bytes(raw))


def flip_committed(p: Path) -> None:
    # a plausible header edit (committed 96 -> 64) that only the checksum can see
    raw = p.read_bytes()
    assert raw.count(b'"committed":"96"') == 1
    p.write_bytes(raw.replace(b'"committed":"96"', b'"committed":"64"'))


def garbage(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def newer_version(p: Path) -> None:
    rewrite_meta(p, version=str(disk.VERSION + 1))


FAULTS = [
    (truncate_half, "truncated"), (truncate_header, "truncated"), (zero_length, "empty"), (flip_data_byte, "checksum"),
    (flip_committed, "checksum"), (garbage, "corrupt"), (newer_version, "version"),
]


@pytest.mark.parametrize("fault,reason", FAULTS, ids=[f.__name__ for f, _ in FAULTS])
def test_a_bad_file_is_a_miss_and_read_again(engine, ref, tmp_path, fault, reason):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    fault(tmp_path / disk.file_name("a"))
    read_again_and_check(reader, store, ref, tmp_path, snap_b, sha_b, reason)


def test_an_unreadable_path_is_a_miss_and_left_where_it_cannot_be_removed(engine, ref, tmp_path):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    path = tmp_path / disk.file_name("a")
    path.unlink()
    path.mkdir()  # unlink() cannot remove it: the store logs that and goes on
    reader.feed("a", reader.get("a").ids, now=10.0)
    reader.read_all("a")
    assert store.stats()["misses"] == {"unreadable": 1} and path.is_dir()
    assert_fresh(reader, "a", ref)
    assert sha(tmp_path / disk.file_name("b")) == sha_b
    reader.feed("b", reader.get("b").ids, now=11.0)
    reader.read_all("b")
    assert_same(reader, reader.get("b"), snap_b)


@pytest.mark.parametrize("fault,reason", FAULTS, ids=[f.__name__ for f, _ in FAULTS])
def test_a_bad_file_is_a_miss_at_start(engine, ref, tmp_path, fault, reason):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    fault(tmp_path / disk.file_name("a"))
    again, again_store = make_reader(engine, tmp_path)
    report = again_store.attach(again)
    if reason in ("checksum",):  # the body is verified when the state comes back, not at start
        assert report["sessions"] == 2
        read_again_and_check(again, again_store, ref, tmp_path, snap_b, sha_b, reason)
        return
    assert report == {**report, "sessions": 1, "misses": {reason: 1}}
    assert "a" not in again.sessions and not (tmp_path / disk.file_name("a")).exists()
    again.feed("a", reader.get("a").ids, now=10.0)
    again.read_all("a")
    assert_fresh(again, "a", ref)
    again.feed("b", reader.get("b").ids, now=11.0)
    again.read_all("b")
    assert_same(again, again.get("b"), snap_b)


def test_a_full_disk_drops_the_state_and_leaves_nothing_behind(engine, ref, tmp_path, monkeypatch):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    reader.feed("c", random_ids(7, 2 * GRID), now=5.0)
    reader.read_all("c")
    real = disk._write_all
    calls = []

    def full_after_some(fd, data):
        calls.append(data.nbytes)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(disk, "_write_all", full_after_some)
    assert not store.park(reader, reader.get("c"))  # a direct park fails and leaves c resident
    assert reader.get("c").is_resident
    store.cap_nbytes = 0
    reader.feed("d", random_ids(8, GRID), now=6.0)  # the cap pushes c out: the write fails, c is dropped
    assert ("drop", "c") in store.events and not reader.get("c").is_resident
    monkeypatch.setattr(disk, "_write_all", real)
    store.cap_nbytes = 1 << 30
    assert store.stats()["misses"] == {"disk_full": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(disk.file_name(k) for k in "ab")  # no temporary
    assert sha(tmp_path / disk.file_name("b")) == sha_b
    reader.feed("c", reader.get("c").ids, now=7.0)
    reader.read_all("c")
    assert_fresh(reader, "c", ref)
    reader.feed("b", reader.get("b").ids, now=8.0)
    reader.read_all("b")
    assert_same(reader, reader.get("b"), snap_b)


def test_a_read_only_directory_drops_states_and_keeps_serving(engine, ref, tmp_path, monkeypatch):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    os.chmod(tmp_path, 0o555)
    try:
        probe = tmp_path / ".probe"
        try:
            probe.write_bytes(b"")  # root writes anyway: make the directory refuse as a read-only mount would
            probe.unlink()
            real_open = os.open

            def refuse(path, flags, *args, **kwargs):
                if flags & os.O_CREAT and Path(path).parent == tmp_path:
                    raise OSError(errno.EROFS, "Read-only file system", str(path))
                return real_open(path, flags, *args, **kwargs)

            monkeypatch.setattr(disk.os, "open", refuse)
        except PermissionError:
            pass
        reader.feed("c", random_ids(7, 2 * GRID), now=5.0)
        reader.read_all("c")
        assert not store.park(reader, reader.get("c"))
        assert store.stats()["misses"] == {"read_only": 1}
        reader.feed("c", reader.get("c").ids + random_ids(9, GRID), now=6.0)
        reader.read_all("c")
        assert_fresh(reader, "c", ref)
        reader.feed("b", reader.get("b").ids, now=8.0)
        reader.read_all("b")  # reading parked files still works
        assert_same(reader, reader.get("b"), snap_b)
    finally:
        os.chmod(tmp_path, 0o755)


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from qse.engine.engine import Engine
    from qse.models import resolve
    from qse.shadow.reader import ShadowReader
    from qse.store import ShadowStore, disk

    torch.set_num_threads(1)  # as the parent reads its fresh prefill
    cache_dir, disk_dir = Path(sys.argv[1]), Path(sys.argv[2])
    engine = Engine(resolve("", torch.device("cpu"), torch.float32, cache_dir))
    store = ShadowStore(1 << 30, disk_dir)
    reader = ShadowReader(engine, grid=32, pool_bytes=8 << 20, residency=store)
    for sid, seed in (("keeper", 1), ("victim", 2)):
        g = torch.Generator().manual_seed(seed)
        reader.feed(sid, torch.randint(0, 4000, (8 * 32 + 5,), generator=g).tolist(), prompt_end=100)
        reader.read_all(sid)
    assert store.park(reader, reader.get("keeper"))
    real, written = disk._write_all, [0]

    def half_then_hang(fd, data):
        if written[0] > 4096 and data.nbytes > 1024:
            real(fd, data[: data.nbytes // 2])
            os.fsync(fd)
            print("HALF", flush=True)
            time.sleep(600)
        real(fd, data)
        written[0] += data.nbytes

    disk._write_all = half_then_hang
    store.park(reader, reader.get("victim"))
    print("NOT KILLED", flush=True)
""")


def test_a_writer_killed_mid_file_leaves_no_file_that_loads(engine, store_cache_dir, ref, tmp_path):
    d = tmp_path / "disk"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store_cache_dir), str(d)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if line.strip() == "HALF" or not line:
                break
        assert line.strip() == "HALF", child.stderr.read() if child.poll() is not None else "no HALF in time"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    names = sorted(p.name for p in d.iterdir())
    temps = [n for n in names if disk.is_temp_name(n)]
    assert len(temps) == 1 and names == sorted([disk.file_name("keeper"), *temps])
    # even renamed into place by hand, the torn file does not load
    torn = d / disk.file_name("victim")
    shutil.copy(d / temps[0], torn)
    with pytest.raises(disk.FileMiss):
        disk.read_tensors(disk.read_header(torn))

    reader, store = make_reader(engine, d)
    report = store.attach(reader)
    assert report["sessions"] == 1 and sum(report["misses"].values()) == 1  # the hand-renamed torn file
    assert sorted(p.name for p in d.iterdir()) == [disk.file_name("keeper")]  # the temporary is gone too
    assert "victim" not in reader.sessions
    keeper = reader.get("keeper")
    assert not keeper.is_resident and keeper.committed == 8 * GRID
    reader.feed("keeper", keeper.ids, now=1.0)
    reader.read_all("keeper")
    assert store.stats()["restores"] == 1 and keeper.stats.chunks_read == 8  # not read again
    assert_fresh(reader, "keeper", ref)


@pytest.mark.parametrize("field,value", [("checkpoint_lines", '["x"]'), ("written_s", "soon"), ("committed", "-32"),
                                         ("checkpoint_counts", '[["a", 1]]'), ("checkpoints", "{}"),
                                         ("checkpoint_kinds", '[["tomorrow"]]'), ("divergence_lines", '["x"]')])
def test_nonsense_in_a_checksummed_header_is_a_miss(engine, ref, tmp_path, field, value):
    reader, store, snap_b, sha_b = two_parked(engine, tmp_path)
    rewrite_meta(tmp_path / disk.file_name("a"), **{field: value})  # a valid checksum over the nonsense
    again, again_store = make_reader(engine, tmp_path)
    report = again_store.attach(again)
    if report["sessions"] == 2:  # attach reads only what it needs; the rest is checked at bring_back
        again.feed("a", reader.get("a").ids, now=10.0)
        again.read_all("a")
    assert again_store.stats()["misses"] == {"corrupt": 1} and not (tmp_path / disk.file_name("a")).exists()
    again.feed("a", reader.get("a").ids, now=11.0)
    again.read_all("a")
    assert_fresh(again, "a", ref)
    again.feed("b", reader.get("b").ids, now=12.0)
    again.read_all("b")
    assert_same(again, again.get("b"), snap_b)
