"""The residency manager on the tiny model: exact parks and restores, LRU, the cap, TTL, the disk cap,
fingerprints, a planned stop and a start."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.shadow.reader import ShadowReader
from qse.store import ShadowStore, disk
from store_helpers import GRID, assert_fresh, assert_same, make_reader, random_ids, rewrite_meta, session_nbytes, snapshot


def files_in(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_park_and_restore_are_bit_exact_and_reading_goes_on(engine, ref, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    ids = random_ids(1, 200)
    reader.feed("s", ids, prompt_end=70, now=1.0)
    reader.read_all("s")
    session = reader.get("s")
    assert session.committed == 192 and session.checkpoint_positions() == [64]
    snap = snapshot(reader, session)
    assert store.park(reader, session)
    assert not session.is_resident and session.committed == 192 and session.checkpoints == []
    assert files_in(tmp_path) == [disk.file_name("s")]
    assert reader.resident_nbytes() == 0
    reader.feed("s", ids, now=2.0)
    assert reader.read_step("s") is None  # brought back; nothing new to read
    assert_same(reader, session, snap)
    assert files_in(tmp_path) == []  # resident or parked, never both
    reader.feed("s", ids + random_ids(2, 90), prompt_end=260, now=3.0)
    reader.read_all("s")
    assert session.committed == 288 and session.checkpoint_positions() == [64, 256]
    assert_fresh(reader, "s", ref)
    assert store.stats()["parks"] == 1 and store.stats()["restores"] == 1


def test_checkpoint_kinds_and_re_render_lines_survive_parking(engine, ref, tmp_path):
    reader, store = make_reader(engine, tmp_path, reader_kwargs=dict(recent_checkpoints=2, divergence_checkpoints=2))
    ids = random_ids(3, 300)
    reader.feed("s", ids, prompt_end=70)
    reader.read_all("s")
    edited = ids[:150] + [1, 2] + ids[152:]
    reader.feed("s", edited)  # the recent lines (256, 288) lie above the change: back to 64; 128 becomes a re-render line
    reader.read_all("s")
    session = reader.get("s")
    held = {c.position: sorted(c.kinds) for c in session.checkpoints}
    assert held == {64: ["prompt"], 128: ["divergence"], 256: ["recent"], 288: ["recent"]}
    assert session.divergence_lines == [128]
    snap = snapshot(reader, session)
    assert store.park(reader, session)
    reader.feed("s", edited)
    assert reader.read_step("s") is None  # brought back
    assert {c.position: sorted(c.kinds) for c in session.checkpoints} == held
    assert session.divergence_lines == [128]
    assert_same(reader, session, snap)
    # the next re-render at the same place goes back to its line
    assert reader.feed("s", edited[:150] + [3, 4] + edited[152:]).rolled_back_to == 128
    reader.read_all("s")
    assert_fresh(reader, "s", ref)


def test_a_file_from_before_checkpoint_kinds_holds_prompt_checkpoints(engine, ref, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    ids = random_ids(4, 200)
    reader.feed("s", ids, prompt_end=70)
    reader.read_all("s")
    snap = snapshot(reader, reader.get("s"))
    assert store.park(reader, reader.get("s"))
    path = tmp_path / disk.file_name("s")
    header = disk.read_header(path)
    meta = {k: v for k, v in header.meta.items() if k not in ("checkpoint_kinds", "divergence_lines")}
    disk.write_file(path, disk.read_tensors(header), meta)  # as the previous format wrote it
    reader.feed("s", ids)
    assert reader.read_step("s") is None  # brought back, not read again
    session = reader.get("s")
    assert [(c.position, c.kinds) for c in session.checkpoints] == [(64, {"prompt"})]
    assert_same(reader, session, snap)


def test_lru_order_under_a_scripted_sequence_of_feeds(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path, cap_nbytes=0)
    one = session_nbytes(engine, reader, 2 * GRID)
    store.cap_nbytes = 3 * one  # three sessions of two chunks fit exactly
    ids = {k: random_ids(i, 2 * GRID) for i, k in enumerate("abcd")}
    for t, k in enumerate("abc", start=1):
        reader.feed(k, ids[k], now=float(t))
        reader.read_all(k)
    assert list(store.events) == []
    reader.feed("d", ids["d"], now=4.0)  # a fresh state's bytes push out the least recently fed
    assert list(store.events) == [("park", "a")]
    reader.read_all("d")
    assert list(store.events) == [("park", "a")]
    ids["b"] += random_ids(9, GRID)
    reader.feed("b", ids["b"], now=5.0)
    reader.read_all("b")  # one more page: c (fed at 3) goes, not d (4)
    assert list(store.events)[1:] == [("park", "c")]
    reader.feed("a", ids["a"], now=6.0)
    reader.read_all("a")  # a comes back; d (4) is the least recently fed now
    assert list(store.events)[2:] == [("park", "d"), ("restore", "a")]
    assert {k for k, s in reader.sessions.items() if s.is_resident} == {"a", "b"}
    assert reader.resident_nbytes() <= store.cap_nbytes


def test_the_pool_is_a_limit_too_and_the_session_being_read_is_kept(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path, pool_bytes=4 * 32768)  # four pages of 32 rows
    assert reader.pool.num_pages == 4
    reader.feed("a", random_ids(1, 3 * GRID), now=1.0)
    reader.read_all("a")
    reader.feed("b", random_ids(2, 4 * GRID), now=2.0)
    reader.read_all("b")  # needs every page: a is parked, b is never evicted while read
    assert [e for e in store.events] == [("park", "a")]
    assert reader.get("b").committed == 4 * GRID
    # c needs a fifth page that does not exist: it is too long, never read, and b is not evicted for it (it
    # used to leave for c's first four chunks, then c failed, and again at every look)
    reader.feed("c", random_ids(3, 5 * GRID), now=3.0)
    assert reader.read_all("c") == []
    assert list(store.events) == [("park", "a")]
    assert reader.get("c").committed == 0 and reader.get("b").is_resident


def test_a_session_larger_than_the_cap_is_kept_while_read_and_alone(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path, cap_nbytes=0)
    store.cap_nbytes = session_nbytes(engine, reader, 2 * GRID)
    reader.feed("a", random_ids(1, 2 * GRID), now=1.0)
    reader.read_all("a")
    reader.feed("b", random_ids(2, 4 * GRID), now=2.0)
    reader.read_all("b")  # past the cap with every other session gone: b is still read to the end
    assert list(store.events) == [("park", "a")]
    assert reader.get("b").committed == 4 * GRID and reader.get("b").is_resident
    assert reader.resident_nbytes() > store.cap_nbytes  # the one case the cap is exceeded: b alone
    reader.feed("a", reader.get("a").ids, now=3.0)  # after a feed the cap holds: b is not the session fed
    assert list(store.events)[1:] == [("park", "b")] and reader.resident_nbytes() <= store.cap_nbytes
    reader.read_all("a")
    assert list(store.events)[2:] == [("restore", "a")]


@pytest.mark.parametrize("has_disk", [True, False], ids=["disk", "no-disk"])
@pytest.mark.parametrize("seed", range(6))
def test_the_cap_holds_after_every_feed_and_read_and_states_stay_exact(engine, tmp_path, seed, has_disk):
    """A random script of feeds (growing, diverging) and reads over four sessions."""
    rng = random.Random(seed)
    reader, store = make_reader(engine, tmp_path if has_disk else None, cap_nbytes=0, pool_bytes=14 * 32768)
    # one session at its largest fits, with little room beside it
    store.cap_nbytes = session_nbytes(engine, reader, 5 * GRID, checkpoints=5)
    ids: dict[str, list[int]] = {}
    for t in range(40):
        sid, op = f"s{rng.randrange(4)}", rng.choice(["extend", "extend", "diverge", "step", "all", "all"])
        cur = ids.get(sid, [])
        if op == "extend" or (op == "diverge" and not cur):
            ids[sid] = (cur + random_ids(t, rng.randrange(1, 100)))[: 5 * GRID + 7]
            reader.feed(sid, ids[sid], prompt_end=len(ids[sid]), now=float(t))
        elif op == "diverge":
            ids[sid] = cur[: rng.randrange(len(cur))] + random_ids(1000 + t, rng.randrange(1, 60))
            reader.feed(sid, ids[sid], now=float(t))
        elif sid in reader.sessions:
            reader.read_step(sid) if op == "step" else reader.read_all(sid)
        assert reader.resident_nbytes() <= store.cap_nbytes
    assert store.counts.evictions > 0
    fresh_reader = ShadowReader(engine, grid=GRID, pool_bytes=8 << 20)
    for sid in ids:
        reader.feed(sid, ids[sid], now=1000.0)
        reader.read_all(sid)
        assert reader.resident_nbytes() <= store.cap_nbytes
        assert_fresh(reader, sid, fresh_reader)
    stats = store.stats()
    assert stats["parks" if has_disk else "drops"] > 0 and stats["misses"] == {}


def test_without_a_disk_the_least_recently_fed_is_dropped_and_read_again(engine, ref):
    reader, store = make_reader(engine, None, cap_nbytes=0)
    store.cap_nbytes = session_nbytes(engine, reader, 3 * GRID) + session_nbytes(engine, reader, 0)
    reader.feed("a", random_ids(1, 3 * GRID), now=1.0)
    reader.read_all("a")
    reader.feed("b", random_ids(2, 3 * GRID), now=2.0)
    assert reader.get("a").is_resident
    reader.read_all("b")
    assert list(store.events) == [("drop", "a")] and reader.get("a").committed == 0
    reader.feed("a", reader.get("a").ids, now=3.0)
    chunks = reader.get("a").stats.chunks_read
    reader.read_all("a")
    assert reader.get("a").stats.chunks_read == chunks + 3  # read again from row 0
    assert_fresh(reader, "a", ref)
    assert store.stats()["drops"] == 2 and store.stats()["parks"] == 0


def test_ids_changed_while_parked_go_back_to_a_checkpoint(engine, ref, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    ids = random_ids(5, 5 * GRID)
    reader.feed("s", ids, prompt_end=2 * GRID + 5, now=1.0)
    reader.read_all("s")
    store.park(reader, reader.get("s"))
    new = ids[: 3 * GRID + 3] + random_ids(6, 50)
    reader.feed("s", new, now=2.0)
    reader.read_all("s")
    session = reader.get("s")
    assert session.stats.rollbacks == 1 and session.stats.ids_reread == 3 * GRID
    assert_fresh(reader, "s", ref)


def test_ask_on_a_parked_session_brings_it_back(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    reader.feed("s", random_ids(3, 2 * GRID + 9), now=1.0)
    reader.read_all("s")
    snap = snapshot(reader, reader.get("s"))
    answer_before = reader.ask("s", random_ids(4, 5), ["A", "B"])
    store.park(reader, reader.get("s"))
    answer_after = reader.ask("s", random_ids(4, 5), ["A", "B"])
    assert answer_after.distribution == answer_before.distribution
    assert_same(reader, reader.get("s"), snap)


def test_ttl_and_disk_cap_remove_the_oldest_files(engine, ref, tmp_path):
    wall = [1000.0]
    reader, store = make_reader(engine, tmp_path, ttl_s=100.0, wall_clock=lambda: wall[0])
    for t, k in enumerate("abc"):
        reader.feed(k, random_ids(t, 2 * GRID), now=float(t))
        reader.read_all(k)
        wall[0] = 1000.0 + 40 * t
        assert store.park(reader, reader.get(k))
    size = store.parked["a"].nbytes
    assert store.sweep(reader, now=1099.0) == []
    assert store.sweep(reader, now=1101.0) == ["a"]  # a was written at 1000
    assert files_in(tmp_path) == sorted(disk.file_name(k) for k in "bc")
    assert reader.get("a").committed == 0 and not reader.get("a").is_resident
    store.disk_cap_nbytes = int(1.5 * size)
    wall[0] = 1102.0
    reader.feed("a", reader.get("a").ids, now=10.0)
    reader.read_all("a")  # read again from row 0 (its file expired)
    assert ("restore", "a") not in store.events
    assert store.park(reader, reader.get("a"))  # room for a: b (1040) and c (1080) go, oldest first
    assert list(store.events)[-3:] == [("disk_cap", "b"), ("disk_cap", "c"), ("park", "a")]
    assert files_in(tmp_path) == [disk.file_name("a")]
    stats = store.stats()
    assert (stats["expired"], stats["disk_evictions"], stats["files"]) == (1, 2, 1)
    reader.feed("b", reader.get("b").ids, now=11.0)
    reader.read_all("b")
    assert_fresh(reader, "b", ref)


def test_ttl_is_applied_as_sessions_are_fed(engine, tmp_path):
    wall = [0.0]
    reader, store = make_reader(engine, tmp_path, ttl_s=10.0, wall_clock=lambda: wall[0])
    reader.feed("a", random_ids(1, GRID), now=0.0)
    reader.read_all("a")
    store.park(reader, reader.get("a"))
    wall[0] = 11.0
    reader.feed("b", random_ids(2, GRID), now=1.0)
    assert ("expired", "a") in store.events and files_in(tmp_path) == []


@pytest.mark.parametrize("field,reason", [("weights_id", "weights"), ("signature", "signature"), ("kernel", "kernel"),
                                          ("session_id", "session_id")])
def test_a_file_of_another_model_is_refused_and_read_again(engine, ref, tmp_path, field, reason):
    reader, store = make_reader(engine, tmp_path)
    for i, k in enumerate("ab"):
        reader.feed(k, random_ids(i, 3 * GRID), now=float(i))
        reader.read_all(k)
    snap_b = snapshot(reader, reader.get("b"))
    store.park(reader, reader.get("a"))
    store.park(reader, reader.get("b"))
    rewrite_meta(tmp_path / disk.file_name("a"), **{field: "something-else"})
    reader.feed("a", reader.get("a").ids, now=5.0)
    reader.read_all("a")
    assert store.stats()["misses"] == {reason: 1}
    assert reader.get("a").stats.chunks_read == 6  # 3 before, 3 again from row 0
    assert_fresh(reader, "a", ref)
    assert files_in(tmp_path) == [disk.file_name("b")]
    reader.feed("b", reader.get("b").ids, now=6.0)
    reader.read_all("b")
    assert_same(reader, reader.get("b"), snap_b)


def test_a_file_of_another_manifest_is_refused_at_start(engine, store_cache_dir, tmp_path):
    """The same weights in another dtype: the state tensors' dtypes differ, so the manifest's signature does."""
    wide = Engine(resolve("", torch.device("cpu"), torch.float64, store_cache_dir))
    assert wide.manifest().signature() != engine.manifest().signature()
    other, other_store = make_reader(wide, tmp_path)
    ids = random_ids(1, 3 * GRID)
    other.feed("s", ids, now=1.0)
    other.read_all("s")
    other_store.park_all(other)
    reader, store = make_reader(engine, tmp_path)
    report = store.attach(reader)
    assert report["sessions"] == 0 and report["misses"] == {"signature": 1}
    assert files_in(tmp_path) == [] and "s" not in reader.sessions


def test_a_file_whose_tensors_are_not_the_manifests_is_a_miss(engine, ref, tmp_path):
    """Fingerprints that match over tensors that do not (a renamed section): the restore refuses it, the
    session is read again from row 0."""
    reader, store = make_reader(engine, tmp_path)
    ids = random_ids(2, 3 * GRID)
    reader.feed("s", ids, now=1.0)
    reader.read_all("s")
    store.park(reader, reader.get("s"))
    path = tmp_path / disk.file_name("s")
    header = disk.read_header(path)
    tensors = disk.read_tensors(header)
    name = next(k for k in tensors if k.startswith("state.s."))
    tensors["state.s.foreign"] = tensors.pop(name)
    disk.write_file(path, tensors, header.meta)
    reader.feed("s", ids, now=2.0)
    reader.read_all("s")
    assert store.stats()["misses"] == {"signature": 1}
    assert reader.get("s").stats.chunks_read == 6  # 3 before, 3 again from row 0
    assert_fresh(reader, "s", ref)
    assert files_in(tmp_path) == []


def test_a_file_of_another_grid_is_refused_at_start(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    ids = random_ids(1, 4 * GRID)
    reader.feed("s", ids, now=1.0)
    reader.read_all("s")
    store.park_all(reader)
    other, other_store = make_reader(engine, tmp_path, grid=2 * GRID)
    report = other_store.attach(other)
    assert report["sessions"] == 0 and report["misses"] == {"grid": 1}
    assert files_in(tmp_path) == [] and "s" not in other.sessions
    other.feed("s", ids, now=2.0)
    other.read_all("s")
    fresh = ShadowReader(engine, grid=2 * GRID, pool_bytes=8 << 20)
    assert_fresh(other, "s", fresh)


def test_planned_stop_and_start_resume_without_reading_again(engine, ref, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    odd = 'user/../../x "q" \x00 🙂'
    ids = {"plain": random_ids(1, 3 * GRID + 5), odd: random_ids(2, 5 * GRID), "empty": random_ids(3, 10)}
    snaps = {}
    for t, (k, v) in enumerate(ids.items()):
        reader.feed(k, v, prompt_end=len(v) - 40 if len(v) > 40 else None, now=float(t))
        reader.read_step(k)  # leave a backlog on some
        snaps[k] = snapshot(reader, reader.get(k))
    report = store.park_all(reader)
    assert report["parked"] == 3 and report["failed"] == [] and len(files_in(tmp_path)) == 3
    assert reader.resident_nbytes() == 0

    again, again_store = make_reader(engine, tmp_path)
    report = again_store.attach(again)
    assert report["sessions"] == 3 and report["misses"] == {}
    for k, v in ids.items():
        s = again.get(k)
        assert not s.is_resident and s.ids == v and s.committed == snaps[k]["committed"]
        assert s.checkpoint_lines == snaps[k]["checkpoint_lines"]
        assert s.stats.chunks_read == reader.get(k).stats.chunks_read
    for t, (k, v) in enumerate(ids.items()):
        s = again.get(k)
        assert again_store.bring_back(again, s)
        assert_same(again, s, snaps[k])
        again.feed(k, v + random_ids(10 + t, GRID), now=10.0 + t)
        again.read_all(k)
        assert s.stats.chunks_read == (len(v) + GRID) // GRID  # nothing read twice
        assert_fresh(again, k, ref)
    assert again_store.stats()["restores"] == 3 and files_in(tmp_path) == []


def test_close_forgets_the_file(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    reader.feed("s", random_ids(1, GRID), now=1.0)
    reader.read_all("s")
    store.park(reader, reader.get("s"))
    reader.close("s")
    assert files_in(tmp_path) == [] and store.stats()["files"] == 0


def test_stats_name_every_counter(engine, tmp_path):
    reader, store = make_reader(engine, tmp_path)
    reader.feed("s", random_ids(1, 2 * GRID), now=1.0)
    reader.read_all("s")
    resident = reader.resident_nbytes()
    stats = store.stats()
    assert stats["resident_bytes"] == resident and stats["resident_sessions"] == 1
    store.park(reader, reader.get("s"))
    stats = store.stats()
    assert stats["resident_bytes"] == 0 and stats["parked_sessions"] == 1 and stats["files"] == 1
    assert stats["parked_bytes"] == (tmp_path / disk.file_name("s")).stat().st_size
    for key in ("evictions", "parks", "restores", "drops", "expired", "disk_evictions", "misses", "cap_bytes",
                "last_park_ms", "last_restore_ms"):
        assert key in stats


def test_from_settings_reads_the_switches(tmp_path):
    from qse.settings import EngineSettings

    s = ShadowStore.from_settings(EngineSettings({"QSE_SHADOW_GB": "0.5", "QSE_SHADOW_DISK": "auto",
                                                  "QSE_CACHE_DIR": str(tmp_path), "QSE_SHADOW_DISK_GB": "2",
                                                  "QSE_SHADOW_DISK_TTL_S": "60"}))
    assert (s.cap_nbytes, s.disk_dir, s.disk_cap_nbytes, s.ttl_s) == (1 << 29, tmp_path / "shadow-disk", 2 << 30, 60.0)
    assert ShadowStore.from_settings(EngineSettings({"QSE_SHADOW_DISK": "off"})).disk_dir is None
    assert ShadowStore.from_settings(EngineSettings({"QSE_SHADOW_DISK": str(tmp_path / "d")})).disk_dir == tmp_path / "d"


def test_the_kernel_fingerprint_names_the_forward_source(engine):
    """A fused projection rounds unlike its parts: a change of the forward's code alone (no kernel source
    changed) must refuse states written before it."""
    import hashlib
    import inspect
    from pathlib import Path

    model = engine.model
    source = Path(inspect.getsourcefile(type(model)))
    with_model = disk.kernel_fingerprint(engine.device, "naive", model)
    expected = f"forward-{type(model).__name__}-{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}"
    assert expected in with_model.split("|")
    assert with_model != disk.kernel_fingerprint(engine.device, "naive")


def test_the_fingerprint_of_naive_state_ignores_triton_and_names_the_cpu_capability(engine, monkeypatch):
    """A CPU server's naive state does not depend on Triton: installing or upgrading it (the test extras do)
    keeps every saved session readable; a Triton op set's state does depend on it. On a CPU the vector
    capability that computed it is named (another host's AVX-512 kernels round unlike AVX2)."""
    import qse_kernels

    cpu = torch.device("cpu")
    naive, triton = disk.kernel_fingerprint(cpu, "naive"), disk.kernel_fingerprint(cpu, "triton")
    monkeypatch.setattr(qse_kernels, "triton_version", lambda: "99.0.0")
    assert disk.kernel_fingerprint(cpu, "naive") == naive
    assert disk.kernel_fingerprint(cpu, "triton") != triton
    assert f"cpu:{torch.backends.cpu.get_cpu_capability()}" in naive.split("|")
