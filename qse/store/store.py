"""A session book's residency manager: resident states under a byte cap, then pinned host memory, then disk.

    resident (cache in the KV pool) --evict: past the cap, least recently fed--> host (pinned buffers)
        host, past its own cap, oldest first --spill--> disk (one file a session)
        <--bring_back: fed or asked again, exact, from whichever tier holds it--
    no host room and no disk, or the write failed --drop: the state is forgotten; the ids stay, read
                                                     again from row 0
    ids journal: every feed writes the session's ids (one small file a session), so a killed process
                 still knows every session that was fed; its state is read again from them

Invariants:
  * after `after_feed` and `make_room` return, the resident bytes (GridSession.nbytes: KV pages in
    use, recurrent, conv, checkpoints) plus what the caller is about to add are at most `cap_nbytes`,
    unless the kept session alone is larger than the cap;
  * the session being fed or read (`keep`) is never evicted;
  * a session is resident, on the host or parked, one at a time: its file is removed once it is back;
  * a parked session keeps its ids and committed length in memory (the conductor maps requests by
    ids; the status shows the position), its state and checkpoints are only on disk;
  * a file that cannot be used is a miss: logged with its reason, counted, removed, and the session
    is read again from row 0. Nothing raises to the reader and no other session is touched.

Moves run beside the device work. A session leaving the device is copied to host memory on a stream of
its own (CUDA; an event marks the copies' end) and its state is detached at once; its pool pages go back
once the copies have landed (`poll`, at the next call, or at once when the pool needs them). A file is
written by the mover thread (`background_writes`; one queue of whole-session writes) from those host
copies, so no write, no fsync, runs on the caller's thread; a session whose file is still being written
is brought back from its host copy (waiting only for that session's device-to-host copy, if it is still
running), and the late file is removed. `safe_point` lands finished moves and keeps the host cap; a
planned stop (`park_all`) and `flush` wait for every move.

A parked session comes back without a file read on the owner's thread when it is asked for ahead:
`prefetch` hands its file to the loader thread (its own, so a load never queues behind big writes),
which reads it (on CUDA straight to the device, through the disk tier's fixed pinned buffers, on a stream
of its own) and checks the header, the fingerprint and the checksum; the read lands at the next `poll` (a safe point, a feed, a restore) as a fetched copy of the file, and
`ready` says so. The file stays parked until the session comes back (the fetched copy is a read-ahead,
never the only copy: it may be let go at any time), so the tier a turn reports stays "disk". A bad file
found by the loader is a miss when it lands; a load whose session came back, was closed or lost its
file meanwhile is dropped when it lands. A restore that meets its own load in flight waits for it.

All calls come from the owner's thread (the executor that owns its device work); the mover and the
loader threads only write files from host tensors they are handed, or read one file into host tensors,
and never touch the store's books.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import structlog
import torch

from ..engine.kv import PagedKV
from ..models.state import ModelState, StateManifest, StateMismatch
from ..settings import EngineSettings
from ..core.prefix import common_prefix
from ..sessions.grid import GridSessions
from ..sessions.session import KINDS, PROMPT, Checkpoint, GridSession, SessionStats, new_epoch
from . import disk
from .arena import PinnedArena
from .disk import FileHeader, FileMiss, Fingerprint
from .policy import ParkedFile, Resident, plan_room, plan_sweep

log = structlog.get_logger("qse.store")

GIB = 1 << 30


@dataclass
class Parked:
    """A session whose state is in one file."""

    session_id: str
    path: Path
    nbytes: int  # the file's size
    written_s: float  # wall clock at the rename
    committed: int
    no_prefetch: bool = False  # a read-ahead failed for a reason not the file's: it is read when it comes back


@dataclass
class HostEntry:
    """A session whose state is in pinned host memory (or still being copied there)."""

    session_id: str
    record: "_Record"  # ids, state and checkpoints as of the move, on the host
    nbytes: int
    moved_s: float  # monotonic, for the host tier's least-recently-moved order
    copied: object = None  # torch.cuda.Event after the device-to-host copies; None: they have landed
    held: object = None  # the device cache copied from: its pages go back to the pool once copied

    def wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # this session's copies only, not the device


@dataclass
class Writing:
    """A session's file being written by the mover thread from its host copy."""

    entry: HostEntry  # the host copy the file is written from (readable by a turn meanwhile)
    path: Path
    written_s: float
    future: Future
    why: str = "park"  # "park" (a resident session) or "spill" (from the host tier)
    cancelled: bool = False  # the session came back (or was closed) first: the file is removed when it lands


@dataclass
class Loading:
    """A parked session's file being read by the loader thread (`prefetch`)."""

    parked: Parked  # the file read: the load lands only while the session is still parked in this one
    future: Future  # -> (_Record on the host, ms the read took); FileMiss for a file that cannot be used


@dataclass
class Fetched:
    """A parked session's file read ahead (onto the device on CUDA); the file stays parked until the session is
    back."""

    parked: Parked
    record: "_Record"
    nbytes: int
    read_ms: float  # the loader thread's read (off the owner's thread)
    landed_s: float  # monotonic: the oldest fetched copy is let go first


@dataclass
class StoreCounts:
    evictions: int = 0  # resident sessions pushed out by the cap or the pool (parked or dropped)
    parks: int = 0  # files written (evictions and park_all)
    restores: int = 0  # files read back into the pool
    host_moves: int = 0  # resident states moved to pinned host memory
    host_restores: int = 0  # host states brought back into the pool
    host_spills: int = 0  # host states written to disk to keep the host cap
    prefetches: int = 0  # files read ahead by the loader thread that landed (usable)
    prefetch_drops: int = 0  # read-ahead copies let go unused (the session went, or another needed the room)
    drops: int = 0  # states forgotten by the store (no disk, write failed, file expired or evicted)
    expired: int = 0  # files removed by the time-to-live
    disk_evictions: int = 0  # files removed by the disk cap
    park_nbytes: int = 0
    restore_nbytes: int = 0
    last_park_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    last_restore_ms: dict[str, float] = dataclasses.field(default_factory=dict)


def _publishes(method):
    """A store verb called from outside the book changes where sessions are: the book's snapshot (what status
    reads off-thread) is published again on this, the owning, thread before the verb returns."""

    @functools.wraps(method)
    def verb(self, reader: GridSessions, *args, **kwargs):
        try:
            return method(self, reader, *args, **kwargs)
        finally:
            reader.publish()

    return verb


class ShadowStore:
    """Implements the reader's `Residency` protocol with a disk tier.

    cap_nbytes:      resident state cap (QSE_SHADOW_GB)
    disk_dir:        directory of parked files; None: no disk tier (past the cap, states are dropped)
    disk_cap_nbytes: cap on the parked files (QSE_SHADOW_DISK_GB); the oldest go first
    ttl_s:           a parked file older than this is removed (QSE_SHADOW_DISK_TTL_S)
    wall_clock:      seconds since the epoch, for file ages (files outlive the process)
    host_arena_nbytes: host memory pinned once for the host copies of moves and parks (`arena.py`); 0: each
                     move allocates its own pinned buffers (tools and tests). The server pins the host cap.

    One store serves one reader, and one reader owns a disk directory.
    """

    def __init__(self, cap_nbytes: int, disk_dir: Path | str | None = None, disk_cap_nbytes: int = 64 * GIB,
                 ttl_s: float = 48 * 3600.0, wall_clock: Callable[[], float] = time.time, host_cap_nbytes: int = 0,
                 journal: bool = False, background_writes: bool = False, host_arena_nbytes: int = 0):
        """background_writes: files are written by the mover thread (the server); False writes them on the
        caller's thread before the call returns (tools and tests that want the file there at once)."""
        if cap_nbytes < 0 or disk_cap_nbytes < 0 or ttl_s < 0 or host_cap_nbytes < 0 or host_arena_nbytes < 0:
            raise ValueError(f"store caps and ttl must be >= 0, got cap={cap_nbytes} disk_cap={disk_cap_nbytes} "
                             f"host_cap={host_cap_nbytes} ttl={ttl_s} host_arena={host_arena_nbytes}")
        self.host_arena_nbytes = int(host_arena_nbytes)
        self.arena: PinnedArena | None = None  # made (and pinned, off this thread) when the store meets its device
        self.cap_nbytes = int(cap_nbytes)
        self.host_cap_nbytes = int(host_cap_nbytes)
        self.host: dict[str, HostEntry] = {}
        self.journal = journal  # write each fed session's ids beside the parked files (needs a disk tier)
        self.disk_dir = Path(disk_dir).expanduser() if disk_dir is not None else None
        self.disk_cap_nbytes = int(disk_cap_nbytes)
        self.ttl_s = float(ttl_s)
        self.wall_clock = wall_clock
        self.parked: dict[str, Parked] = {}
        self.counts = StoreCounts()
        self.misses: Counter[str] = Counter()
        self.events: deque[tuple[str, str]] = deque(maxlen=256)  # (verb, session id), newest last
        self._dir_ready = False
        self._over_cap: set[str] = set()
        self._reader: GridSessions | None = None
        self._fingerprint: Fingerprint | None = None
        # wall ms spent, by phase (the Residency protocol's spent_ms): a restore's own time excludes the
        # evictions it made room with, which count as "evict"
        self._spent = {"evict": 0.0, "restore": 0.0}
        self.writing: dict[str, Writing] = {}
        self._mover = ThreadPoolExecutor(1, thread_name_prefix="qse-mover") if background_writes else None
        # the ids journals on a thread of their own: small files that must not wait behind a session's big write
        # (a kill in that wait would forget the session), in order with their removals
        self._journaler = ThreadPoolExecutor(1, thread_name_prefix="qse-journal") if background_writes else None
        self.loading: dict[str, Loading] = {}
        self.fetched: dict[str, Fetched] = {}
        self._loader: ThreadPoolExecutor | None = None  # made on the first prefetch
        self._load_stream = None  # the loader's own CUDA stream: its copies never queue behind the rounds
        self._removing: list[Future] = []  # removals queued: files renamed away (mover), journals (journal thread)
        self._journaling: list[Future] = []  # journal writes queued on the journal thread: (session, error or None)
        self._stream = None  # the device-to-host copies' own stream (CUDA), made on first use

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "ShadowStore":
        """The reader's store: QSE_SHADOW_GB on the device, the host tier, the disk tier (QSE_SHADOW_DISK)."""
        return cls._configured(settings, "QSE_SHADOW_GB", "shadow-disk", None)

    @classmethod
    def for_served(cls, settings: EngineSettings) -> "ShadowStore":
        """The served model's own store: its device cap, the same host cap, a disk directory of its own
        (its files carry the served weights' fingerprint, so the two books never read each other's)."""
        return cls._configured(settings, "QSE_SERVED_CACHE_GB", "served-disk", "served")

    @classmethod
    def _configured(cls, settings: EngineSettings, cap_setting: str, auto_dir: str, subdir: str | None) -> "ShadowStore":
        raw = settings.get("QSE_SHADOW_DISK").strip()
        if raw.lower() == "off":
            disk_dir = None
        elif raw.lower() in ("", "auto"):
            disk_dir = settings.cache_dir() / auto_dir
        else:  # an operator's directory: the reader's files at its top, the served book's in a folder of it
            disk_dir = Path(raw).expanduser() / subdir if subdir else Path(raw).expanduser()
        return cls(int(settings.get(cap_setting) * GIB), disk_dir, int(settings.get("QSE_SHADOW_DISK_GB") * GIB),
                   settings.get("QSE_SHADOW_DISK_TTL_S"), host_cap_nbytes=int(settings.get("QSE_HOST_CACHE_GB") * GIB),
                   journal=True, background_writes=True,
                   host_arena_nbytes=int(settings.get("QSE_HOST_CACHE_GB") * GIB))

    def tier_of(self, session_id: str) -> str | None:
        """Where a non-resident session's state is: "host", "disk", or None (nowhere: read again). A session
        whose file is still being written is on the host: it comes back from its host copy."""
        if session_id in self.host or session_id in self.writing:
            return "host"
        if session_id in self.parked:
            return "disk"
        return None

    def ready(self, session_id: str) -> bool:
        """Whether bringing the session back reads no file on the owner's thread: its state is resident, in
        host memory, read ahead (`prefetch` landed), or nowhere (read again from row 0). False while it is only
        in a file, or still loading. Any thread may ask (an answer of one moment)."""
        parked = self.parked.get(session_id)
        return parked is None or parked.no_prefetch or session_id in self.fetched

    @_publishes
    def prefetch(self, reader: GridSessions, session_id: str) -> Future | None:
        """Start reading a parked session's file on the loader thread (onto the device on CUDA, into host memory
        elsewhere); the load in flight (done once read; it lands at the next `poll`), or None when there is nothing to wait
        for (`ready`). Lands what has finished first."""
        self._bind(reader)
        self.poll(reader)
        if self.ready(session_id):
            return None
        loading = self.loading.get(session_id)
        if loading is not None:
            return loading.future
        parked = self.parked[session_id]
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="qse-loader")
        engine = reader.engine
        if engine.device.type == "cuda" and self._load_stream is None:
            self._load_stream = torch.cuda.Stream(engine.device)
        future = self._loader.submit(_load_job, parked.path, self._fingerprint_of(reader), session_id, reader.grid,
                                     engine.cfg.vocab_size, engine.manifest(), self._load_stream)
        self.loading[session_id] = Loading(parked, future)
        self.events.append(("prefetch", session_id))
        return future

    # ---- the Residency protocol ----------------------------------------------------------------
    def make_room(self, reader: GridSessions, pages: int, keep: GridSession) -> bool:
        """Free `pages` pool pages and keep the cap with them (and the checkpoint the chunk may take)."""
        need_nbytes = pages * reader.pool.page_nbytes
        if keep.is_resident and reader.chunk_may_checkpoint(keep):
            need_nbytes += reader.engine.cost(0)
        return self._fit(reader, keep, pages, need_nbytes)

    def spent_ms(self) -> dict[str, float]:
        return dict(self._spent)

    def bring_back(self, reader: GridSessions, session: GridSession) -> bool:
        """Restore a parked session exactly; False (a miss, or never parked) means read it again."""
        t0, evict0 = time.perf_counter(), self._spent["evict"]
        try:
            restored = self._restore(reader, session)
        finally:
            self._spent["restore"] += (time.perf_counter() - t0) * 1e3 - (self._spent["evict"] - evict0)
        if restored:
            return True
        # the reader now makes a fresh state (recurrent + conv): keep the cap with it
        self._fit(reader, session, 0, reader.engine.cost(0))
        return False

    def _restore(self, reader: GridSessions, session: GridSession) -> bool:
        self._bind(reader)
        self.poll(reader)
        held = self.host.pop(session.session_id, None)
        writing = self.writing.get(session.session_id)
        if held is None and writing is not None and not writing.cancelled:
            writing.cancelled = True  # its file lands late and is removed; the host copy is read now
            held = writing.entry
        if held is not None:
            held.wait_copied()  # this session's own copies, if they are still on their way
            self._release_held(held)
            return self._bring_in(reader, session, held.record, None, held.nbytes, time.perf_counter(), time.perf_counter())
        loading = self.loading.get(session.session_id)
        if loading is not None:  # the same read, already under way, is no slower than a new one
            self._land_load(reader, loading)  # waits for it
        entry = self.parked.pop(session.session_id, None)
        fetched = self.fetched.pop(session.session_id, None)
        if entry is None:
            return False
        t0 = time.perf_counter()
        if fetched is not None and fetched.parked is entry:
            return self._bring_in(reader, session, fetched.record, entry.path, entry.nbytes, t0, t0,
                                  prefetch_ms=fetched.read_ms)
        try:
            record = self._load(reader, entry.path, session.session_id)
        except (FileMiss, *_BAD_FIELD) as exc:
            self._miss(entry.path, session.session_id, _as_miss(exc))
            return False
        return self._bring_in(reader, session, record, entry.path, entry.nbytes, t0, time.perf_counter())

    def _bring_in(self, reader: GridSessions, session: GridSession, record: "_Record", path: Path | None, nbytes: int,
                  t0: float, t_read: float, count: bool = True, prefetch_ms: float = 0.0) -> bool:
        """A record (from the host tier, or a file at `path`, read here or ahead by the loader: prefetch_ms)
        into the pool; False is a miss. count=False: a move that could not go ahead put back (no restore
        counted)."""
        tier = "disk" if path is not None else "host"
        where = path if path is not None else Path(session.session_id)
        state = record.state
        pages = -(-state.length // reader.pool.page_rows)
        need = pages * reader.pool.page_nbytes + sum(t.numel() * t.element_size() for t in state.sections.values())
        need += sum(c.nbytes for c in record.checkpoints)
        self._fit(reader, session, pages, need)
        kv = PagedKV(reader.pool)
        try:
            cache = reader.engine.restore_cache(state, kv)
        except StateMismatch as exc:
            kv.release_all()
            self._miss(where, session.session_id, FileMiss("signature", str(exc)), unlink=path is not None)
            return False
        if cache is None:
            kv.release_all()
            self._miss(where, session.session_id, FileMiss("no_room", f"the pool has {reader.pool.num_free} free pages, the state needs {pages}"),
                       unlink=path is not None)
            return False
        device = reader.engine.device
        session.cache = cache
        session.committed = state.length
        # queued without a wait each (hundreds of small tensors); the synchronize below waits for them all, before
        # the record's host buffers can go
        session.checkpoints = [Checkpoint(c.position, [t.to(device, non_blocking=True) for t in c.recurrent],
                                          [t.to(device, non_blocking=True) for t in c.conv], set(c.kinds))
                               for c in record.checkpoints]
        session.divergence_lines = record.divergence_lines
        session.mode = record.mode
        if path is not None:
            self._unlink(path)
        # the session may have been fed other ids while parked: go back as a resident one would
        first_diff = common_prefix(record.ids, session.ids, session.committed)
        if first_diff < session.committed:
            reader.rollback(session, first_diff)
        reader.engine.synchronize()
        t_done = time.perf_counter()
        if not count:
            return True
        if tier == "disk":
            self.counts.restores += 1
            self.counts.restore_nbytes += nbytes
        else:
            self.counts.host_restores += 1
        self.events.append(("restore" if tier == "disk" else "host_restore", session.session_id))
        self.counts.last_restore_ms = {"read_ms": (t_read - t0) * 1e3, "restore_ms": (t_done - t_read) * 1e3,
                                       "total_ms": (t_done - t0) * 1e3, "nbytes": nbytes, "tier": tier,
                                       "prefetch_ms": prefetch_ms}
        log.info("store_restore", session=session.session_id, tier=tier, position=session.committed, nbytes=nbytes,
                 ms=round((t_done - t0) * 1e3, 3), prefetched=prefetch_ms > 0, rolled_back_to=session.committed if first_diff < state.length else None)
        return True

    def after_feed(self, reader: GridSessions, session: GridSession) -> None:
        """A feed is a safe point (a turn's start, between rounds): room for the cap, moves landed, the host cap."""
        self._fit(reader, session, 0, 0)
        self.safe_point(reader)
        if self.parked:
            self.sweep(reader)

    def forget(self, reader: GridSessions, session: GridSession) -> None:
        entry = self.host.pop(session.session_id, None)
        if entry is not None:
            entry.wait_copied()  # its pages may be reused only once the copies have read them
            self._release_held(entry)
        writing = self.writing.get(session.session_id)
        if writing is not None:
            writing.cancelled = True
        self._let_go(session.session_id)  # a load in flight is dropped when it lands: its file is gone
        entry = self.parked.pop(session.session_id, None)
        if entry is not None:
            self._unlink(entry.path)
        if self.disk_dir is not None:
            self._remove_journal(session.session_id)

    def note_ids(self, reader: GridSessions, session: GridSession) -> None:
        """Journal the session's ids (a feed): one small file a session, replaced whole by a rename, so a
        killed process still knows the session and reads its state again from these ids."""
        if not self.journal or not self._disk_ready():
            return
        self._bind(reader)
        assert self.disk_dir is not None
        meta = {"format": disk.FORMAT, "version": str(disk.VERSION), **self._fingerprint_of(reader).metadata(),
                "content": "ids", "session_id": session.session_id,
                "checkpoint_lines": json.dumps(sorted(session.checkpoint_lines)), "written_s": repr(self.wall_clock())}
        path = self.disk_dir / _ids_name(session.session_id)
        if self._journaler is not None:  # a copy of the list here (fast); the tensor, its hash and the file there
            try:
                self._journaling.append(self._journaler.submit(_journal_job, path, session.session_id,
                                                           list(session.ids), meta))
                return
            except RuntimeError:  # the journal's thread has shut down (a stop): write it here
                pass
        _, error = _journal_job(path, session.session_id, session.ids, meta)
        if error is not None:
            self._journal_failed(session.session_id, error)

    def _journal_failed(self, session_id: str, exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError):
            self._dir_ready = False
        self._count_write_miss(session_id, FileMiss(disk.write_reason(exc), exc.strerror or str(exc)))

    def _remove_journal(self, session_id: str) -> None:
        """A session's journal goes in order with its writes: behind any still queued on the journal's thread (a
        journal written after its session was closed would bring the session back at the next start)."""
        assert self.disk_dir is not None
        self._remove(self.disk_dir / _ids_name(session_id), self._journaler)

    def _remove(self, path: Path, thread: ThreadPoolExecutor | None) -> None:
        """Remove the file on `thread`, in order behind what it has queued, or here without one (or once it has
        shut down: a stop)."""
        if thread is not None:
            try:
                self._removing.append(thread.submit(_remove_file, path))
                return
            except RuntimeError:
                pass
        _remove_file(path)

    # ---- parking -------------------------------------------------------------------------------
    @_publishes
    def park(self, reader: GridSessions, session: GridSession, wait: bool = True) -> bool:
        """Write a resident session to disk and free its state; False (it stays resident) if it cannot.
        The state is copied to the host and detached at once; the file is written by the mover thread
        (background_writes), and `wait` waits for it (False: an eviction, which never waits on a disk)."""
        if not session.is_resident or not self._disk_ready():
            return False
        self._bind(reader)
        t0 = time.perf_counter()
        entry = self._detach(reader, session)
        writing = self._queue_write(reader, session, entry, "park")
        if writing is None:  # (counted as a miss) the state stays where it was: resident again
            entry.wait_copied()
            self._release_held(entry)
            self._bring_in(reader, session, entry.record, None, entry.nbytes, t0, t0, count=False)
            return False
        if wait:  # a failed write leaves the session resident, as before the call
            if not self._land(reader, writing, drop=False):
                self._bring_in(reader, session, entry.record, None, entry.nbytes, t0, t0, count=False)
                return False
        elif self._mover is None:
            self._land(reader, writing)
        self.counts.last_park_ms = {"total_ms": (time.perf_counter() - t0) * 1e3, "nbytes": entry.nbytes, "wait": wait}
        return True

    def _queue_write(self, reader: GridSessions, session: GridSession, entry: HostEntry, why: str) -> Writing | None:
        """Hand one session's file (from its host copy) to the mover; None (nothing queued, counted as a
        miss) if it cannot be written."""
        if not self._disk_ready():
            return None
        assert self.disk_dir is not None
        before = self.writing.get(session.session_id)
        if before is not None:  # an older write of the same file lands first (it is cancelled or stale)
            before.cancelled = True
            self._land(reader, before)
        fp = self._fingerprint_of(reader)
        record = entry.record
        tensors = _session_tensors(record)
        estimate = sum(t.numel() * t.element_size() for t in tensors.values()) + 64 * 1024
        if estimate > self.disk_cap_nbytes:
            self._count_write_miss(session.session_id, FileMiss("disk_cap", f"{estimate} bytes, the disk cap is {self.disk_cap_nbytes}"))
            return None
        self.sweep(reader, incoming_nbytes=estimate)
        written_s = self.wall_clock()
        meta = {"format": disk.FORMAT, "version": str(disk.VERSION), **fp.metadata(), **_session_meta(session, record),
                "model": reader.engine.name, "written_s": repr(written_s),
                "ids_sha256": disk.tensor_sha256(tensors["ids"])}
        path = self.disk_dir / disk.file_name(session.session_id)
        job = (entry.copied, path, tensors, meta)
        if self._mover is not None:
            future = self._mover.submit(_write_job, *job)
        else:
            future = Future()
            try:
                future.set_result(_write_job(*job))
            except OSError as exc:
                future.set_exception(exc)
        writing = Writing(entry, path, written_s, future, why)
        self.writing[session.session_id] = writing
        return writing

    def _land(self, reader: GridSessions, writing: Writing, drop: bool = True) -> bool:
        """A queued write has finished (waits for it): the file is registered as parked (True), or removed if
        the session came back meanwhile; a failed write (counted as a miss) drops the state, with `drop`."""
        exc = writing.future.exception()  # waits
        sid = writing.entry.session_id
        if self.writing.get(sid) is writing:
            del self.writing[sid]
        writing.entry.wait_copied()  # (done: the write waited for it)
        self._release_held(writing.entry)
        session = reader.sessions.get(sid)
        if exc is not None:
            if isinstance(exc, FileNotFoundError):
                self._dir_ready = False  # the directory went away: make it again next time
            if session is not None:
                self._count_write_miss(session.session_id, FileMiss(disk.write_reason(exc), getattr(exc, "strerror", None) or str(exc)))
                if drop and not writing.cancelled and not session.is_resident:
                    reader.drop_state(session)
                    self.counts.drops += 1
                    self.events.append(("drop", sid))
            return False
        nbytes = writing.future.result()
        if writing.cancelled or session is None or session.is_resident:
            self._unlink(writing.path)  # the session came back or went: the file is stale
            return False
        self.parked[sid] = Parked(sid, writing.path, nbytes, writing.written_s, writing.entry.record.state.length)
        self.counts.parks += 1
        self.counts.park_nbytes += nbytes
        if writing.why == "spill":
            self.counts.host_spills += 1
        self.events.append((writing.why, sid))
        log.info("store_park", session=sid, position=writing.entry.record.state.length, nbytes=nbytes,
                 why=writing.why)
        return True

    def poll(self, reader: GridSessions) -> None:
        """Land what has finished moving (never waits): pages whose copies have landed go back to the pool,
        files that have been written are registered."""
        for entry in list(self.host.values()):
            if entry.copied is not None and entry.copied.query():
                self._release_held(entry)
        for writing in list(self.writing.values()):
            if writing.future.done():
                self._land(reader, writing)
        for loading in list(self.loading.values()):
            if loading.future.done():
                self._land_load(reader, loading)
        self._removing = [f for f in self._removing if not f.done()]
        self._land_journals(wait=False)

    @_publishes
    def flush(self, reader: GridSessions) -> None:
        """Wait for every move in flight and land it (a planned stop, a status that must be exact, tests)."""
        for entry in list(self.host.values()):
            entry.wait_copied()
            self._release_held(entry)
        for writing in list(self.writing.values()):
            self._land(reader, writing)
        for loading in list(self.loading.values()):
            self._land_load(reader, loading)
        removing, self._removing = self._removing, []
        for fut in removing:
            fut.result()
        self._land_journals(wait=True)

    def _land_journals(self, wait: bool) -> None:
        """Journal writes the journal's thread has done (all of them, with `wait`): a failed one is counted as
        a write miss."""
        still = []
        for fut in self._journaling:
            if not wait and not fut.done():
                still.append(fut)
                continue
            session_id, error = fut.result()
            if error is not None:
                self._journal_failed(session_id, error)
        self._journaling = still

    def _land_load(self, reader: GridSessions, loading: Loading) -> None:
        """A read-ahead has finished (waits for it): a fetched copy of the file, where the session is still
        parked in it; a file that cannot be used is a miss now (the session is read again from row 0)."""
        exc = loading.future.exception()  # waits
        parked = loading.parked
        sid = parked.session_id
        if self.loading.get(sid) is loading:
            del self.loading[sid]
        session = reader.sessions.get(sid)
        if self.parked.get(sid) is not parked or session is None or session.is_resident:
            return  # the session came back, was closed, or its file went meanwhile: the read is stale
        if isinstance(exc, FileMiss):
            del self.parked[sid]
            self._miss(parked.path, sid, exc)
            reader.drop_state(session)  # no state anywhere now: the ids are read again from row 0
            return
        if exc is not None:  # not the file's fault (host memory, say): it is read when the session comes back
            parked.no_prefetch = True
            log.warning("store_prefetch_failed", session=sid, error=repr(exc), path=str(parked.path))
            return
        record, read_ms, copied = loading.future.result()
        if copied is not None:  # the loader's copies to the device (done: the job waited for its staging buffers)
            copied.synchronize()
            current = torch.cuda.current_stream(reader.engine.device)
            for t in _record_tensors(record):
                if t.is_cuda:
                    t.record_stream(current)  # freed with the owner's work, not the loader's
        self.fetched[sid] = Fetched(parked, record, _record_nbytes(record), read_ms, time.monotonic())
        self.counts.prefetches += 1
        self.events.append(("fetched", sid))
        log.info("store_prefetched", session=sid, nbytes=parked.nbytes, read_ms=round(read_ms, 3))
        # read-ahead copies are held within the host cap, the newest kept whatever its size
        while len(self.fetched) > 1 and sum(f.nbytes for f in self.fetched.values()) > self.host_cap_nbytes:
            self._let_go(min((f for f in self.fetched.values() if f is not self.fetched[sid]),
                             key=lambda f: f.landed_s).parked.session_id)

    def _let_go(self, session_id: str) -> None:
        """A read-ahead copy unused: its file is still parked (or gone with the session)."""
        if self.fetched.pop(session_id, None) is not None:
            self.counts.prefetch_drops += 1

    def safe_point(self, reader: GridSessions) -> None:
        """Between rounds or in the idle window: land finished moves and keep the host cap (spills go to the
        mover). A turn's own evictions only copy to the host; what they put over the host cap goes here."""
        self._bind(reader)
        self.poll(reader)
        self._keep_host_cap(reader)

    def _release_held(self, entry: HostEntry) -> None:
        """The device state a finished copy read from: its pages back to the pool."""
        if entry.copied is not None and not entry.copied.query():
            return
        entry.copied = None
        if entry.held is not None:
            entry.held.kv.release_all()
            entry.held = None

    def _detach(self, reader: GridSessions, session: GridSession) -> HostEntry:
        """The session's state copied to the host (asynchronously on CUDA) and detached from the session."""
        record, copied = _host_record(reader, session, self._copy_stream(reader), self.arena)
        entry = HostEntry(session.session_id, record, _record_nbytes(record), time.monotonic(), copied,
                          session.cache if copied is not None else None)
        if copied is None:
            session.kv.release_all()
        session.cache = None
        session.checkpoints = []
        return entry

    def _copy_stream(self, reader: GridSessions):
        if reader.engine.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(reader.engine.device)
        return self._stream

    def _settle_pool(self, reader: GridSessions, pages: int) -> None:
        """The pool needs pages that moves in flight still hold: wait for those copies (oldest first)."""
        for entry in sorted((e for e in (*self.host.values(), *(w.entry for w in self.writing.values()))
                             if e.held is not None), key=lambda e: e.moved_s):
            if reader.pool.can_allocate(pages):
                return
            entry.wait_copied()
            self._release_held(entry)

    # ---- the host tier -------------------------------------------------------------------------
    @_publishes
    def move_to_host(self, reader: GridSessions, session: GridSession, keep_cap: bool = True) -> bool:
        """A resident session's state into pinned host memory, its pool pages freed; older host states
        spill to disk (or are dropped) to keep the host cap. False (it stays resident) if it cannot fit."""
        self._bind(reader)
        if not session.is_resident or session.nbytes > self.host_cap_nbytes:
            return False
        t0 = time.perf_counter()
        entry = self._detach(reader, session)
        self.host[session.session_id] = entry
        self.counts.host_moves += 1
        self.events.append(("host", session.session_id))
        log.info("store_host_move", session=session.session_id, position=session.committed, nbytes=entry.nbytes,
                 ms=round((time.perf_counter() - t0) * 1e3, 3), in_flight=entry.copied is not None)
        if keep_cap:
            self._keep_host_cap(reader)
        return True

    def host_nbytes(self) -> int:
        return sum(e.nbytes for e in list(self.host.values()))  # a copy first: status reads it off-thread

    def _keep_host_cap(self, reader: GridSessions) -> None:
        while self.host and self.host_nbytes() > self.host_cap_nbytes:
            oldest = min(self.host.values(), key=lambda e: e.moved_s)
            self._spill(reader, oldest)

    def _spill(self, reader: GridSessions, entry: HostEntry) -> bool:
        """A host state to disk by the mover (dropped if it cannot be queued); True if it was queued."""
        del self.host[entry.session_id]
        session = reader.sessions.get(entry.session_id)
        if session is None:
            entry.wait_copied()
            self._release_held(entry)
            return False
        writing = self._queue_write(reader, session, entry, "spill")
        if writing is not None:
            return self._land(reader, writing) if self._mover is None else True
        entry.wait_copied()
        self._release_held(entry)
        reader.drop_state(session)
        self.counts.drops += 1
        self.events.append(("drop", entry.session_id))
        return False

    @_publishes
    def park_all(self, reader: GridSessions, wait: bool = True) -> dict:
        """Planned stop: write every resident session, least recently fed first (so the disk cap keeps
        the newest). Sessions that cannot be written stay resident and are reported. wait=False: every
        session leaves the device (a copy to pinned memory) and its write is queued; `flush` lands them, so
        a caller holding the engine (a reader's release) holds it for the copies, not for the writes."""
        t0 = time.perf_counter()
        resident = sorted((s for s in reader.sessions.values() if s.is_resident), key=lambda s: s.last_fed_s)
        queued, failed = [], []
        for entry in sorted(self.host.values(), key=lambda e: e.moved_s):
            (queued if self._spill(reader, entry) else failed).append(entry.session_id)
        for s in resident:
            (queued if self.park(reader, s, wait=False) else failed).append(s.session_id)
        if not wait:
            report = {"queued": len(queued), "failed": failed, "seconds": time.perf_counter() - t0}
            log.info("store_park_all", **report)
            return report
        self.flush(reader)  # every write lands before the stop
        parked = [sid for sid in queued if sid in self.parked]
        failed += [sid for sid in queued if sid not in self.parked]
        report = {"parked": len(parked), "failed": failed, "files": len(self.parked),
                  "parked_bytes": sum(p.nbytes for p in self.parked.values()), "seconds": time.perf_counter() - t0}
        log.info("store_park_all", **report)
        return report

    @_publishes
    def attach(self, reader: GridSessions) -> dict:
        """At start: register every usable file's session as parked (ids known, state on disk), so it
        resumes without reading again; remove torn temporaries and unusable files (misses)."""
        self._bind(reader)
        if not self._disk_ready():
            return {"sessions": 0, "misses": {}, "disk": None}
        assert self.disk_dir is not None
        fp = self._fingerprint_of(reader)
        found, misses = 0, Counter()
        try:
            names = sorted(os.listdir(self.disk_dir))
        except OSError as exc:
            log.warning("store_attach_failed", dir=str(self.disk_dir), error=exc.strerror or str(exc))
            return {"sessions": 0, "misses": {}, "disk": str(self.disk_dir)}
        journals = {}
        for name in names:
            if name.endswith(".ids" + disk.SUFFIX):
                journals[name] = self.disk_dir / name
        names = [n for n in names if n not in journals]
        for name in names:
            path = self.disk_dir / name
            if disk.is_temp_name(name):
                self._unlink(path)  # a writer died before its rename: never a file
                log.info("store_torn_temp_removed", path=str(path))
                continue
            if not name.endswith(disk.SUFFIX):
                continue
            try:
                header = disk.read_header(path)
                fp.check(header.meta)
                session_id = header.meta.get("session_id", "")
                if disk.file_name(session_id) != name:
                    raise FileMiss("session_id", f"file {name} holds session {session_id!r}")
                ids = _read_ids(header, reader.engine.cfg.vocab_size)
                committed = _meta_int(header.meta, "committed")
                lines = {int(x) for x in _meta_json(header.meta, "checkpoint_lines")}
                stats = _session_stats(header.meta)
                written_s = float(header.meta.get("written_s", "nan"))
                if not (0 <= committed <= len(ids)) or written_s != written_s:
                    raise FileMiss("corrupt", f"committed {committed} of {len(ids)} ids, written_s {written_s}")
            except (FileMiss, *_BAD_FIELD) as exc:
                miss = _as_miss(exc)
                misses[miss.reason] += 1
                self._miss(path, None, miss)
                continue
            existing = reader.sessions.get(session_id)
            if existing is not None and (existing.is_resident or session_id in self.parked):
                if existing.is_resident:
                    self._unlink(path)  # the resident state is newer than any file
                continue
            if existing is None:
                session = reader.new_session(session_id, ids=ids, stats=stats)
                session.checkpoint_lines = lines
                reader.sessions[session_id] = session
            else:  # known but dropped: keep what it was fed since; bring_back goes back where ids differ
                session = existing
                session.checkpoint_lines |= {p for p in lines if p <= len(session.ids)}
            session.mode = header.meta.get("mode", "eager")
            session.committed = committed
            session.checkpoints = []
            self.parked[session_id] = Parked(session_id, path, header.size, written_s, committed)
            found += 1
        known = self._attach_journals(reader, journals, fp, misses)
        self.sweep(reader)
        report = {"sessions": found, "journaled": known, "misses": dict(misses), "disk": str(self.disk_dir),
                  "parked_bytes": sum(p.nbytes for p in self.parked.values())}
        log.info("store_attach", **report)
        return report

    def _attach_journals(self, reader: GridSessions, journals: dict[str, Path], fp: Fingerprint, misses: Counter) -> int:
        """Sessions the ids journal knows: a session with a state file takes the journal's newer ids (its
        state rolls back where they differ when it comes back); one without is known with no state and is
        read again from row 0. Returns how many sessions the journal brought that no state file had."""
        known = 0
        for name, path in journals.items():
            try:
                header = disk.read_header(path)
                fp.check(header.meta)
                session_id = header.meta.get("session_id", "")
                if _ids_name(session_id) != name:
                    raise FileMiss("session_id", f"file {name} holds session {session_id!r}")
                ids = _read_ids(header, reader.engine.cfg.vocab_size)
                lines = {int(x) for x in _meta_json(header.meta, "checkpoint_lines")}
            except (FileMiss, *_BAD_FIELD) as exc:
                miss = _as_miss(exc)
                misses[miss.reason] += 1
                self._miss(path, None, miss)
                continue
            session = reader.sessions.get(session_id)
            if session is None:
                session = reader.new_session(session_id, ids=ids)
                session.checkpoint_lines = lines
                reader.sessions[session_id] = session
                known += 1
            elif not session.is_resident:
                session.ids = ids
                session.epoch = new_epoch()
                session.checkpoint_lines |= {p for p in lines if p <= len(ids)}
            session.checkpoint_lines = {p for p in session.checkpoint_lines if p <= len(session.ids)}
        return known

    @_publishes
    def sweep(self, reader: GridSessions, now: float | None = None, incoming_nbytes: int = 0) -> list[str]:
        """Remove files past the time-to-live, then the oldest until the disk cap holds (with room
        for a file of `incoming_nbytes`); their sessions are read again when fed. Returns their ids."""
        now = self.wall_clock() if now is None else now
        files = [ParkedFile(p.session_id, p.written_s, p.nbytes) for p in self.parked.values()]
        decision = plan_sweep(files, now, self.ttl_s, self.disk_cap_nbytes, incoming_nbytes)
        for why, ids in (("expired", decision.expired), ("disk_cap", decision.evicted)):
            for sid in ids:
                entry = self.parked.pop(sid)
                self._let_go(sid)
                self._unlink(entry.path)
                if why == "expired":
                    self.counts.expired += 1
                else:
                    self.counts.disk_evictions += 1
                self.events.append((why, sid))
                session = reader.sessions.get(sid)
                if session is not None and not session.is_resident:
                    reader.drop_state(session)
                    self.counts.drops += 1
                log.info("store_file_removed", session=sid, why=why, age_s=round(now - entry.written_s, 3), nbytes=entry.nbytes)
        return decision.expired + decision.evicted

    # ---- status --------------------------------------------------------------------------------
    def stats(self) -> dict:
        reader = self._reader
        snap = reader.snapshot if reader is not None else None  # the owning thread's, read whole
        c = self.counts
        return {
            "moving_sessions": len(self.writing),
            "cap_bytes": self.cap_nbytes,
            "resident_bytes": snap.resident_nbytes if snap is not None else 0,
            "resident_sessions": snap.num_resident if snap is not None else 0,
            "parked_sessions": len(self.parked),
            "host_sessions": len(self.host),
            "host_bytes": self.host_nbytes(),
            "host_cap_bytes": self.host_cap_nbytes,
            "host_arena_bytes": self.arena.nbytes if self.arena is not None else 0,
            "host_arena_fallbacks": self.arena.fallbacks if self.arena is not None else 0,
            "host_moves": c.host_moves,
            "host_restores": c.host_restores,
            "host_spills": c.host_spills,
            "loading_sessions": len(self.loading),
            "fetched_sessions": len(self.fetched),
            "fetched_bytes": sum(f.nbytes for f in list(self.fetched.values())),
            "prefetches": c.prefetches,
            "prefetch_drops": c.prefetch_drops,
            "parked_bytes": sum(p.nbytes for p in list(self.parked.values())),
            "files": len(self.parked),
            "disk_dir": str(self.disk_dir) if self.disk_dir is not None else None,
            "disk_cap_bytes": self.disk_cap_nbytes,
            "ttl_s": self.ttl_s,
            "evictions": c.evictions,
            "parks": c.parks,
            "restores": c.restores,
            "drops": c.drops,
            "expired": c.expired,
            "disk_evictions": c.disk_evictions,
            "park_bytes_total": c.park_nbytes,
            "restore_bytes_total": c.restore_nbytes,
            "last_park_ms": dict(c.last_park_ms),
            "last_restore_ms": dict(c.last_restore_ms),
            "misses": dict(self.misses),
        }

    # ---- internals -----------------------------------------------------------------------------
    def _bind(self, reader: GridSessions) -> None:
        if self._reader is not reader:
            self._reader = reader
            self._fingerprint = None
            if reader.engine.device.type == "cuda" and self.disk_dir is not None:
                threading.Thread(target=disk.prepare_staging, name="qse-staging", daemon=True).start()
            if self.arena is None and self.host_arena_nbytes:  # parks copy through it too, host tier or not
                self.arena = PinnedArena(self.host_arena_nbytes, pin=reader.engine.device.type == "cuda")
                self.arena.start()

    def _fingerprint_of(self, reader: GridSessions) -> Fingerprint:
        if self._fingerprint is None:
            engine = reader.engine
            self._fingerprint = Fingerprint(engine.resolved.weights_id, reader.grid, engine.manifest().signature(),
                                            disk.kernel_fingerprint(engine.device, getattr(engine, "kernels", None),
                                                                    getattr(engine, "model", None)))
        return self._fingerprint

    def _fit(self, reader: GridSessions, keep: GridSession, pages: int, need_nbytes: int) -> bool:
        self._bind(reader)
        self.poll(reader)
        others = [Resident(s.session_id, s.last_fed_s, s.nbytes, len(s.kv.pages))
                  for s in reader.sessions.values() if s.is_resident and s is not keep and not s.pinned]
        room = plan_room(others, keep.nbytes, reader.pool.num_free, pages, need_nbytes, self.cap_nbytes)
        for sid in room.victims:
            self._evict(reader, reader.sessions[sid])
        if not reader.pool.can_allocate(pages):
            self._settle_pool(reader, pages)
        if not room.fits_cap and keep.session_id not in self._over_cap:
            self._over_cap.add(keep.session_id)  # once a session: it warns again only after it fitted
            log.warning("store_over_cap", session=keep.session_id, nbytes=keep.nbytes + need_nbytes, cap=self.cap_nbytes,
                        hint="the resident cap (QSE_SHADOW_GB or QSE_SERVED_CACHE_GB) is smaller than this one session; it "
                             "stays resident alone")
        elif room.fits_cap:
            self._over_cap.discard(keep.session_id)
        return reader.pool.can_allocate(pages)

    def _evict(self, reader: GridSessions, session: GridSession) -> None:
        t0 = time.perf_counter()
        try:
            self._evict_one(reader, session)
        finally:
            self._spent["evict"] += (time.perf_counter() - t0) * 1e3

    def _evict_one(self, reader: GridSessions, session: GridSession) -> None:
        """Inside a read or a turn: a copy to the host, never a write on this thread (a write goes to the
        mover; the host cap is kept at the next safe point, or here when no mover runs)."""
        self.counts.evictions += 1
        if self.host_cap_nbytes and self.move_to_host(reader, session, keep_cap=self._mover is None):
            return
        if self.park(reader, session, wait=False):
            return
        reader.drop_state(session)
        self.counts.drops += 1
        self.events.append(("drop", session.session_id))
        log.info("store_drop", session=session.session_id, disk=self.disk_dir is not None)

    def _disk_ready(self) -> bool:
        if self.disk_dir is None:
            return False
        if not self._dir_ready:
            try:
                self.disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("store_disk_unavailable", dir=str(self.disk_dir), error=exc.strerror or str(exc))
                return False
            self._dir_ready = True
        return True

    def _load(self, reader: GridSessions, path: Path, session_id: str) -> "_Record":
        """On the owner's thread: the file straight to the device (a session not read ahead)."""
        header = _checked_header(path, self._fingerprint_of(reader), session_id)
        tensors, _ = _read_state_file(header, reader.engine.device)  # verifies the checksum
        return _decode(header, tensors, reader.grid, reader.engine.cfg.vocab_size, reader.engine.manifest())

    def _miss(self, path: Path, session_id: str | None, miss: FileMiss, unlink: bool = True) -> None:
        self.misses[miss.reason] += 1
        self.events.append(("miss:" + miss.reason, session_id or path.name))
        if unlink:
            self._unlink(path)
        log.warning("store_miss", session=session_id, reason=miss.reason, detail=miss.detail, path=str(path))

    def _count_write_miss(self, session_id: str, miss: FileMiss) -> None:
        self.misses[miss.reason] += 1
        self.events.append(("miss:" + miss.reason, session_id))
        log.warning("store_miss", session=session_id, reason=miss.reason, detail=miss.detail,
                    dir=str(self.disk_dir), write=True)

    def _unlink(self, path: Path) -> None:
        """The file goes. With a mover it is renamed out of the way at once (a name change, however large the
        file) and the mover removes it: unlinking a 2.6 GB file took about a second on an H200 host, on the
        owner's thread, inside a turn's restore. The new name is a writer's temporary, so one left by a crash is
        removed at the next attach; a file written later under the old name is never touched."""
        if self._mover is not None:
            doomed = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{disk.TMP_SUFFIX}")
            try:
                os.rename(path, doomed)
            except FileNotFoundError:
                return
            except OSError as exc:
                log.warning("store_unlink_failed", path=str(path), error=exc.strerror or str(exc))
                return
            path = doomed
        self._remove(path, self._mover)


# ---- the session <-> file mapping ----------------------------------------------------------------
# what a well-formed header with nonsense in a field raises while it is decoded (a miss, not a crash)
_BAD_FIELD = (ValueError, TypeError, KeyError, IndexError, RuntimeError)


def _as_miss(exc: Exception) -> FileMiss:
    return exc if isinstance(exc, FileMiss) else FileMiss("corrupt", f"{type(exc).__name__}: {exc}")


@dataclass
class _Record:
    ids: list[int]
    state: ModelState
    checkpoints: list[Checkpoint]
    mode: str
    divergence_lines: list[int]


def _session_tensors(record: _Record) -> dict[str, torch.Tensor]:
    state = record.state
    out = {"ids": _ids_tensor(record.ids)}
    for i, c in enumerate(record.checkpoints):
        for j, t in enumerate(c.recurrent):
            out[f"ckpt.{i}.recurrent.{j}"] = t
        for j, t in enumerate(c.conv):
            out[f"ckpt.{i}.conv.{j}"] = t
    for name, t in state.sections.items():
        out[f"state.s.{name}"] = t
    for name, t in state.views.items():
        out[f"state.v.{name}"] = t
    return out


def _session_meta(session: GridSession, record: _Record) -> dict[str, str]:
    state, checkpoints = record.state, record.checkpoints
    return {
        "session_id": session.session_id,
        "committed": str(state.length),
        "num_ids": str(len(record.ids)),
        "checkpoints": json.dumps([c.position for c in checkpoints]),
        "checkpoint_counts": json.dumps([[len(c.recurrent), len(c.conv)] for c in checkpoints]),
        "checkpoint_kinds": json.dumps([sorted(c.kinds) for c in checkpoints]),
        "divergence_lines": json.dumps(record.divergence_lines),
        "checkpoint_lines": json.dumps(sorted(session.checkpoint_lines)),
        "mode": record.mode,
        "stats": json.dumps(dataclasses.asdict(session.stats)),
    }


def _host_record(reader: GridSessions, session: GridSession, stream=None,
                 arena: PinnedArena | None = None) -> tuple[_Record, object]:
    """The session's state and checkpoints copied to the host, and the event after the copies (None: they
    are done). On CUDA the copies go to pinned buffers on `stream`, behind the work already launched on the
    current stream, and nothing waits for them here; elsewhere plain copies, done on return."""
    pin = stream is not None

    def to_host(t: torch.Tensor) -> torch.Tensor:
        out = arena.take(t.shape, t.dtype) if arena is not None else None
        if out is None and arena is not None:
            # no room (moves still being written hold their pieces): plain memory. Its copy holds this thread
            # (~14 GB/s), where a fresh pinned allocation would hold every thread's CUDA calls for its whole
            # length (benchmarks/NOTES.md, host_stall)
            arena.fallbacks += 1
            return t.to("cpu", copy=True)
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out

    def take() -> _Record:
        state = reader.engine.cache_state(session.cache)
        host_state = ModelState(sections={k: to_host(v) for k, v in state.sections.items()},
                                views={k: to_host(v) for k, v in state.views.items()}, length=state.length)
        checkpoints = [Checkpoint(c.position, [to_host(x) for x in c.recurrent], [to_host(x) for x in c.conv],
                                  set(c.kinds)) for c in session.checkpoints]
        return _Record(list(session.ids), host_state, checkpoints, session.mode, list(session.divergence_lines))

    if stream is None:
        return take(), None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        record = take()
        # the checkpoints' device tensors were made on the current stream and are freed with the session
        for c in session.checkpoints:
            for t in (*c.recurrent, *c.conv):
                t.record_stream(stream)
        copied = torch.cuda.Event()
        copied.record(stream)
    return record, copied


def _checked_header(path: Path, fp: Fingerprint, session_id: str) -> FileHeader:
    header = disk.read_header(path)
    fp.check(header.meta)
    if header.meta.get("session_id") != session_id:
        raise FileMiss("session_id", f"file holds session {header.meta.get('session_id')!r}, expected {session_id!r}")
    return header


def _load_job(path: Path, fp: Fingerprint, session_id: str, grid: int, vocab_size: int, manifest: StateManifest,
              stream) -> tuple["_Record", float, object]:
    """On the loader thread: one parked file read, header, fingerprint and checksum checked; (the record, ms, the
    event after its copies to the device, or None). With a CUDA `stream` the large tensors go to the device
    through the disk tier's two fixed pinned buffers on that stream, so a load allocates no pinned memory (a
    fresh pinned allocation of a 60k session's size took about a second on an H200 host) and its
    landing is a device-to-device copy; without one (CPU) the file is read into host memory. A file that cannot
    be used raises FileMiss; anything else (device memory, say) is not the file's fault and raises as it is."""
    t0 = time.perf_counter()
    header = _checked_header(path, fp, session_id)
    tensors, copied = _read_state_file(header, stream.device if stream is not None else torch.device("cpu"), stream)
    try:
        record = _decode(header, tensors, grid, vocab_size, manifest)
    except _BAD_FIELD as exc:
        raise _as_miss(exc) from None
    return record, (time.perf_counter() - t0) * 1e3, copied


def _read_state_file(header: FileHeader, device: torch.device, stream=None) -> tuple[dict[str, torch.Tensor], object]:
    """A parked file's tensors (checksum verified) and the event after their copies (None: done or none). On
    CUDA every tensor goes to the device (on `stream` when given); where the device has no room for a whole
    copy beside the pool, the file is read into host memory instead and the restore copies it a tensor at a
    time (slower, never a failed turn)."""
    if device.type == "cuda":
        try:
            if stream is None:
                return disk.read_tensors(header, device=device, stream_min_nbytes=0), None
            with torch.cuda.stream(stream):
                tensors = disk.read_tensors(header, device=device, stream_min_nbytes=0)
                copied = torch.cuda.Event()
                copied.record(stream)
            return tensors, copied
        except torch.cuda.OutOfMemoryError:
            log.warning("store_load_to_host", path=str(header.path), nbytes=header.size,
                        why="no room on the device for the file's copy")
    return disk.read_tensors(header), None


def _write_job(copied, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    """On the mover thread: wait for the host copies (that session's only), then write the file."""
    if copied is not None:
        copied.synchronize()
    return disk.write_file(path, tensors, meta)


def _ids_tensor(ids: list[int]) -> torch.Tensor:
    """int32 ids from a list, about three times faster than torch.tensor (a 60k session: ~3 ms against ~8)."""
    return torch.from_numpy(np.fromiter(ids, dtype=np.int32, count=len(ids)))


def _journal_job(path: Path, session_id: str, ids: list[int], meta: dict[str, str]) -> tuple[str, OSError | None]:
    """Write a session's ids journal (on the journal thread, or here without one); (the session, the error or
    None)."""
    tensor = _ids_tensor(ids)
    try:
        disk.write_file(path, {"ids": tensor}, {**meta, "ids_sha256": disk.tensor_sha256(tensor)}, sync=False)
    except OSError as exc:
        return session_id, exc
    return session_id, None


def _remove_file(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("store_unlink_failed", path=str(path), error=exc.strerror or str(exc))


def _record_tensors(record: _Record) -> list[torch.Tensor]:
    state = record.state
    return [*state.sections.values(), *state.views.values(),
            *(x for c in record.checkpoints for x in (*c.recurrent, *c.conv))]


def _record_nbytes(record: _Record) -> int:
    return sum(t.numel() * t.element_size() for t in _record_tensors(record))


def _ids_name(session_id: str) -> str:
    return disk.file_name(session_id)[: -len(disk.SUFFIX)] + ".ids" + disk.SUFFIX


def _meta_int(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        raise FileMiss("corrupt", f"metadata {key}={meta.get(key)!r} is not an integer") from None


def _meta_json(meta: dict[str, str], key: str) -> list:
    try:
        value = json.loads(meta[key])
    except (KeyError, ValueError):
        raise FileMiss("corrupt", f"metadata {key}={meta.get(key)!r} is not JSON") from None
    if not isinstance(value, list):
        raise FileMiss("corrupt", f"metadata {key} is not a list")
    return value


def _session_stats(meta: dict[str, str]) -> SessionStats:
    try:
        raw = json.loads(meta.get("stats", "{}"))
        known = {f.name for f in dataclasses.fields(SessionStats)}
        return SessionStats(**{k: v for k, v in raw.items() if k in known})
    except (ValueError, TypeError, AttributeError):
        return SessionStats()  # statistics only: not worth a miss


def _check_ids(ids: torch.Tensor, vocab_size: int) -> list[int]:
    if ids.dim() != 1 or ids.dtype != torch.int32:
        raise FileMiss("corrupt", f"ids tensor has shape {tuple(ids.shape)} and dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise FileMiss("corrupt", f"ids outside the vocabulary [0, {vocab_size})")
    return ids.tolist()


def _read_ids(header: FileHeader, vocab_size: int) -> list[int]:
    """The ids alone (attach): checked against their own hash, the body is verified at bring_back."""
    ids = disk.read_tensors(header, ["ids"])["ids"]
    if disk.tensor_sha256(ids) != header.meta.get("ids_sha256"):
        raise FileMiss("checksum", "the ids do not match their hash")
    return _check_ids(ids, vocab_size)


def _decode(header: FileHeader, tensors: dict[str, torch.Tensor], grid: int, vocab_size: int,
            manifest: StateManifest) -> _Record:
    meta = header.meta
    committed = _meta_int(meta, "committed")
    positions = [int(p) for p in _meta_json(meta, "checkpoints")]
    counts = _meta_json(meta, "checkpoint_counts")
    # files written before checkpoints had kinds hold prompt-end checkpoints only
    kinds = _meta_json(meta, "checkpoint_kinds") if "checkpoint_kinds" in meta else [[PROMPT]] * len(positions)
    div_lines = [int(p) for p in _meta_json(meta, "divergence_lines")] if "divergence_lines" in meta else []
    if len(kinds) != len(positions) or not all(isinstance(k, list) and k and set(k) <= KINDS for k in kinds):
        raise FileMiss("corrupt", f"checkpoint kinds {kinds!r} do not fit the positions")
    if "ids" not in tensors:
        raise FileMiss("corrupt", "no ids tensor")
    ids = _check_ids(tensors["ids"], vocab_size)
    sections = {k[len("state.s."):]: t for k, t in tensors.items() if k.startswith("state.s.")}
    views = {k[len("state.v."):]: t for k, t in tensors.items() if k.startswith("state.v.")}
    if committed > len(ids) or committed % grid or any(v.shape[0] != committed for v in views.values()):
        raise FileMiss("corrupt", f"committed {committed} does not fit {len(ids)} ids, grid {grid} and the KV rows")
    checkpoints = []
    if len(counts) != len(positions):
        raise FileMiss("corrupt", "checkpoint positions and counts differ")
    for i, (position, (num_rec, num_conv)) in enumerate(zip(positions, counts)):
        try:
            rec = [tensors[f"ckpt.{i}.recurrent.{j}"] for j in range(num_rec)]
            cnv = [tensors[f"ckpt.{i}.conv.{j}"] for j in range(num_conv)]
        except KeyError as exc:
            raise FileMiss("corrupt", f"checkpoint {i} lacks {exc}") from None
        # a checkpoint holds the GDN state: the manifest's sections, in the cache's order
        if not 0 < position <= committed or position % grid or not manifest.fits_sections([*rec, *cnv]):
            raise FileMiss("corrupt", f"checkpoint {i} at {position} does not match the state")
        checkpoints.append(Checkpoint(position, rec, cnv, set(kinds[i])))
    return _Record(ids, ModelState(sections=sections, views=views, length=committed), checkpoints, meta.get("mode", "eager"),
                   div_lines)


__all__ = ["GIB", "Fetched", "HostEntry", "Loading", "Parked", "ShadowStore", "StoreCounts"]
