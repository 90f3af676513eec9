"""Grid sessions: a session's exact state on the grid, for any engine (the reader's and the served model's).

`feed` tells the book what a session now holds (a new prompt, or the prompt plus output so far); it
never reads. `read_step` reads exactly one grid chunk of one session, so a scheduler can stop between
any two chunks; `launch_step` and `finish_step` split it in two, so that the next chunk is launched
while the device still runs the one before (`read_all`, and the conductor's windows). A re-rendered
prompt rolls back to the newest checkpoint at or below the first differing id (`rollback`).

Two users: the shadow reader (qse/shadow/reader.py: questions and summaries on forks) and the served
model's turns (qse/sessions/served.py: the tail under one chunk and the decode above the committed
rows). The residency manager (qse/store) asks and moves sessions only through the public verbs here.
"""

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np
import structlog
import torch

from ..core.checkpoints import CheckpointBook, CheckpointRules
from ..core.plan import check_group
from ..core.prefix import common_prefix
from ..engine.engine import DeviceClock, Engine
from ..engine.graphs import ForwardGraphs, capture_mode
from ..engine.kv import KVPool, PagedKV
from .session import GridSession, new_epoch

log = structlog.get_logger("qse.sessions")


class SessionError(ValueError):
    """Bad input to a session book (unknown session, bad ids, a read over the window)."""


class SessionTooLong(SessionError):
    """A session (or a question on it) needs more rows than the whole KV pool holds: it is not read, and
    nothing can be answered on it until its ids fit."""

    def __init__(self, message: str, rows: int, max_rows: int):
        super().__init__(message)
        self.rows = rows
        self.max_rows = max_rows


class UnknownSession(SessionError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


@dataclass
class ChunkReport:
    session_id: str
    position: int  # committed rows after the chunk
    backlog: int  # whole-chunk ids still to read
    gpu_ms: float
    context: int  # rows the chunk attended over before it (its start position)
    chunks: int = 1  # grid chunks this launch read (a chunk group: gpu_ms is theirs together)


@dataclass
class PendingChunk:
    """A chunk launched on the device, not yet read back (`GridSessions.launch_step`)."""

    session: "GridSession"
    start: int  # the chunk's first row
    marks: tuple | None = None  # (start, end) device marks until finish_step reads them
    gpu_ms: float = 0.0
    chunks: int = 1  # grid chunks launched together (a chunk group)
    # the chunk's final hiddens [rows, H] (a book with chunk_hidden): valid until the book's next chunk launch
    hidden: Any = None


@dataclass
class FeedReport:
    session_id: str
    position: int
    backlog: int
    tail: int
    rolled_back_to: int | None  # grid line the reader went back to, if a rollback happened
    first_diff: int | None



class Residency(Protocol):
    """What the reader asks of the residency manager (qse/store). The default drops LRU sessions.

    make_room is asked before every growth of a session's KV pages (not only when the pool is
    short), so a manager can keep a byte cap as sessions are read; True means the pages are free.
    """

    def make_room(self, reader: "GridSessions", pages: int, keep: GridSession) -> bool: ...

    def bring_back(self, reader: "GridSessions", session: GridSession) -> bool: ...

    def after_feed(self, reader: "GridSessions", session: GridSession) -> None: ...

    def forget(self, reader: "GridSessions", session: GridSession) -> None: ...

    def note_ids(self, reader: "GridSessions", session: GridSession) -> None:
        """A feed: keep the session's ids where a restart finds them (nothing, without a journal)."""

    def tier_of(self, session_id: str) -> str | None:
        """Where a non-resident session's state is ("host", "disk"), or None: it is read again."""

    def ready(self, session_id: str) -> bool:
        """Whether bringing the session back reads no file on the owning thread (resident, in host memory, read
        ahead, or nowhere); False while its state is only in a file or still loading (`prefetch`). Any thread
        may ask."""

    def prefetch(self, reader: "GridSessions", session_id: str) -> "Future | None":
        """Start reading a parked session's state into host memory beside the device work; the load in flight
        (it lands at the next safe point, then `ready`), or None when there is nothing to wait for."""

    def safe_point(self, reader: "GridSessions") -> None:
        """Between rounds or in the idle window (never inside a ration slice): land finished moves, keep
        the tiers' caps. A feed is one too (`after_feed`)."""

    def spent_ms(self) -> dict[str, float]:
        """Running totals of the wall ms the manager spent, by phase ("evict": moving other sessions out;
        "restore": bringing a session back, its file read included): a turn reports their growth."""

    def park_all(self, reader: "GridSessions", wait: bool = True) -> dict:
        """Planned stop: write every resident session where a restart finds it; a report of what was
        parked, or {} where there is nowhere to park (nothing is written). wait=False: the sessions leave
        the device and their writes are queued, not waited for (`flush` lands them)."""

    def flush(self, reader: "GridSessions") -> None:
        """Wait for every move in flight and land it."""

    def stats(self) -> dict:
        """The tiers and their counts, for status (a store's include "parked_sessions"); {} without a store."""


class DropLRU:
    """No disk: past the pool, the least recently fed session is dropped and later read again."""

    def make_room(self, reader: "GridSessions", pages: int, keep: GridSession) -> bool:
        while not reader.pool.can_allocate(pages):
            victims = [s for s in reader.sessions.values()
                       if s.is_resident and s is not keep and s.kv.pages and not s.pinned]
            if not victims:
                return False
            reader.drop_state(min(victims, key=lambda s: s.last_fed_s))
        return True

    def bring_back(self, reader: "GridSessions", session: GridSession) -> bool:
        return False

    def after_feed(self, reader: "GridSessions", session: GridSession) -> None:
        return None

    def forget(self, reader: "GridSessions", session: GridSession) -> None:
        return None

    def note_ids(self, reader: "GridSessions", session: GridSession) -> None:
        return None

    def tier_of(self, session_id: str) -> str | None:
        return None

    def ready(self, session_id: str) -> bool:
        return True

    def prefetch(self, reader: "GridSessions", session_id: str) -> "Future | None":
        return None

    def safe_point(self, reader: "GridSessions") -> None:
        return None

    def spent_ms(self) -> dict[str, float]:
        return {}

    def park_all(self, reader: "GridSessions", wait: bool = True) -> dict:
        return {}

    def flush(self, reader: "GridSessions") -> None:
        return None

    def stats(self) -> dict:
        return {}


class SessionView(NamedTuple):
    """One session as a status shows it, taken on the book's owning thread."""

    session_id: str
    position: int  # committed rows
    known: int  # ids the session holds
    backlog: int
    behind: int
    nbytes: int
    resident: bool
    checkpoints: tuple[int, ...]  # prompt-end checkpoint rows
    rollbacks: int
    ids_reread: int
    chunks_read: int
    too_long: bool = False  # longer than the whole KV pool: not read (GridSession.max_rows)


class BookSnapshot(NamedTuple):
    """Every session's view at one moment of the owning thread (immutable: any thread may read it)."""

    sessions: tuple[SessionView, ...] = ()

    @property
    def resident_nbytes(self) -> int:
        return sum(v.nbytes for v in self.sessions)

    @property
    def num_resident(self) -> int:
        return sum(1 for v in self.sessions if v.resident)

    @property
    def backlog(self) -> int:
        return sum(v.backlog for v in self.sessions)


def _view(s: GridSession) -> SessionView:
    return SessionView(s.session_id, s.committed, len(s.ids), s.backlog, s.behind, s.nbytes, s.is_resident,
                       tuple(s.checkpoint_positions()), s.stats.rollbacks, s.stats.ids_reread, s.stats.chunks_read,
                       s.is_too_long)


@dataclass
class BookStats:
    chunks: int = 0
    gpu_ms: float = 0.0
    asks: int = 0
    summaries: int = 0
    drops: int = 0
    restarts: int = 0
    shared_rows: int = 0  # rows sessions started from another session's state (start_from_donor)
    last_answers: list[dict] = field(default_factory=list)


class GridSessions:
    def __init__(self, engine: Engine, grid: int = 512, pool_bytes: int = 4 << 30, max_checkpoints: int = 6,
                 page_rows: int | None = None, residency: Residency | None = None, clock=time.monotonic,
                 graphs: bool | str | None = None, recent_checkpoints: int = 0, divergence_checkpoints: int = 0,
                 chunk_group: int = 1, who: str = "the reader", kv_slots: int | None = None,
                 chunk_hidden: bool = False, ladder_from: int = 0):
        """graphs: True/False, None for CUDA graphs where the device is CUDA and the kernels are Triton's
        (the entry point passes False where QSE_SHADOW_GRAPHS is off), or "static": the graph path's buffers and flow without capturing (CPU tests).

        Checkpoints beside the prompt ends' (`max_checkpoints`): the newest `recent_checkpoints` grid lines
        read, the lines of the newest `divergence_checkpoints` places where a prompt re-rendered, and the
        ladder's lines, `ladder_from` rows times a power of two (qse/core/checkpoints.py). All three are 0
        here; `qse serve` passes the settings (QSE_SHADOW_RECENT_CHECKPOINTS, 4 by default,
        QSE_SHADOW_DIVERGENCE_CHECKPOINTS, 0; the served sessions' QSE_SERVED_CHECKPOINT_LADDER, 8192): in the
        weka replay 4 recent lines took fresh turn starts from 95.5 % to 97.6 %, for up to 4 more states (19.5
        MB each on the 0.8B) a session.

        chunk_group: the chunks `read_all` launches together where they fit (see launch_step), on the graph
        path; 1 reads one chunk a launch.

        kv_slots: the KV slots a page of the pool holds (None: one an attention layer; the served model's
        pool where its rounds draft with the MTP head has one more, qse/engine/rounds.py pool_slots_for): the
        same pool_bytes then hold fewer pages. chunk_hidden: each grid chunk is read with the final-hidden taps,
        handed out on its PendingChunk (`hidden`), for the served model's MTP head; one chunk a launch then
        (no chunk groups). The state and the KV rows are the same bits either way."""
        if grid < 1:
            raise SessionError(f"grid must be a positive number of rows, got {grid}")
        self.engine = engine
        self.who = who  # names this book in errors ("the reader", "the served model")
        self.grid = grid
        self.max_checkpoints = max_checkpoints
        for name, value in (("max_checkpoints", max_checkpoints), ("recent_checkpoints", recent_checkpoints),
                            ("divergence_checkpoints", divergence_checkpoints)):
            if not isinstance(value, int) or value < 0:
                raise SessionError(f"{name} must be a whole number >= 0, got {value!r}")
        _check_chunks(chunk_group, "chunk_group")
        self.chunk_group = chunk_group
        self.chunk_hidden = chunk_hidden
        # every session's checkpoint book follows these (qse/core/checkpoints.py: the one copy of the rules)
        try:
            self.checkpoint_rules = CheckpointRules.counted(grid, max_checkpoints, recent_checkpoints,
                                                            divergence_checkpoints, ladder_from)
        except ValueError as exc:
            raise SessionError(str(exc)) from None
        cfg = engine.cfg
        page_rows = page_rows or grid
        if grid % page_rows:
            raise SessionError(f"the grid ({grid}) must be a multiple of the KV page size ({page_rows})")
        num_slots = len(cfg.attention_layers) if kv_slots is None else kv_slots
        if num_slots < len(cfg.attention_layers):
            raise SessionError(f"kv_slots={kv_slots}: a page holds at least one KV slot an attention layer "
                               f"({len(cfg.attention_layers)})")
        self.pool = KVPool.for_budget(pool_bytes, page_rows, num_slots, cfg.num_key_value_heads,
                                      cfg.head_dim, engine.dtype, engine.device)
        self.sessions: dict[str, GridSession] = {}
        self.residency: Residency = residency or DropLRU()
        self.clock = clock
        self.stats = BookStats()
        self.graphs = self._make_graphs(graphs)
        self._device_clock = DeviceClock(engine.device)
        self.mode = "graph" if self.graphs is not None else "eager"
        # the status: views rebuilt on the owning thread after each change (`publish`), read from anywhere
        self._views: dict[str, SessionView] = {}
        self.snapshot = BookSnapshot()

    def _make_graphs(self, graphs: bool | str | None) -> ForwardGraphs | None:
        capture = capture_mode(self.engine, graphs, self.who, SessionError)
        if capture is None:
            return None
        return ForwardGraphs(self.engine.model, self.pool, capture=capture, max_tokens=max(1024, self.grid))

    def warm(self) -> None:
        """Capture the grid chunk's graph now rather than on the first read (a capture takes a few
        hundred ms; a server does it before it takes requests)."""
        if self.graphs is not None:
            self.graphs.warm(self.grid, 1 if self.chunk_hidden else self.chunk_group, hidden=self.chunk_hidden)

    # ---- sessions ----------------------------------------------------------------------------
    def get(self, session_id: str) -> GridSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"unknown session {session_id!r}")
        return session

    def open(self, session_id: str) -> GridSession:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.new_session(session_id, self._new_cache(), mode=self.mode)
            self.sessions[session_id] = session
        return session

    def new_session(self, session_id: str, cache=None, **fields) -> GridSession:
        """A session with this book's checkpoint rules (not registered: the caller adds it to `sessions`)."""
        return GridSession(session_id, self.grid, cache, book=CheckpointBook(self.checkpoint_rules),
                           max_rows=self.max_rows, **fields)

    @property
    def max_rows(self) -> int:
        """The most rows one session may hold: the whole KV pool."""
        return self.pool.num_pages * self.pool.page_rows

    def too_long(self, session: GridSession, rows: int, what: str) -> SessionTooLong:
        return SessionTooLong(f"{what} needs {rows} rows of {self.who}'s KV pool, which holds {self.max_rows}: "
                              f"session {session.session_id!r} is too long for it", rows, self.max_rows)

    def _new_cache(self):
        return self.engine.new_cache(kv=PagedKV(self.pool))

    def close(self, session_id: str) -> None:
        session = self.get(session_id)
        self.residency.forget(self, session)
        self.drop_state(session)
        del self.sessions[session_id]
        self.publish()

    def drop_state(self, session: GridSession) -> None:
        """Forget the state (not the ids): the session is read again from row 0 when fed."""
        if session.cache is not None:
            session.kv.release_all()
        session.cache = None
        session.committed = 0
        session.apply_dropped(session.book.clear())
        self.stats.drops += 1

    def ensure_resident(self, session: GridSession) -> None:
        """The session's state in memory: as it was (parked state brought back), or empty, to be read
        again from row 0."""
        if session.cache is not None:
            return
        if self.residency.bring_back(self, session):
            return
        session.cache = self._new_cache()
        session.committed = 0
        session.apply_dropped(session.book.clear())
        session.mode = self.mode

    def start_from_donor(self, session: GridSession, limit: int, may_share: Callable[[str, str], bool],
                         min_rows: int | None = None) -> str | None:
        """A session about to read from row 0 starts instead from another resident session's checkpoint: the
        highest row at most `limit` that a session `may_share(session_id, donor_id)` holds a state at and
        whose ids up to it are this session's (a system prompt and tools that agents of one harness share).
        Its KV rows below that row and the state there are copied: the grid's state at a row depends only on
        the ids below it, so the session holds what reading them would have given, bit for bit. The grid line
        at or below the longest prefix it shares with any of them becomes one of its checkpoint lines (read
        from there, it takes the state at the shared head: the next session to begin so starts there). Returns
        the donor's id, or None (nothing shared: no donor at min_rows or more, default two chunks, or no room)."""
        if session.cache is None or session.committed != 0:
            return None
        least = 2 * self.grid if min_rows is None else min_rows
        best_row, donor, longest = 0, None, 0
        for other in list(self.sessions.values()):
            if other is session or other.cache is None or not may_share(session.session_id, other.session_id):
                continue
            shared = common_prefix(other.ids, session.ids, min(limit, other.committed))
            longest = max(longest, shared)
            row = max((r for r in other.states if r <= shared), default=0)
            if row > best_row:
                best_row, donor = row, other
        head_line = (longest // self.grid) * self.grid
        if head_line >= least:
            session.book.lines.add(head_line)
        if donor is None or best_row < least:
            return None
        pages = session.kv.pages_for(best_row)
        if not session.kv.ensure(best_row):  # (no room: read as before)
            return None
        self.pool.copy_pages(donor.kv.pages[:pages], session.kv.pages[:pages])
        session.cache.set_state(*donor.states[best_row])
        session.cache.length = session.committed = best_row
        session.apply(session.book.after_chunk(best_row, launch_end=False))  # its own lines there, as if read
        session.stats.shared_rows += best_row
        self.stats.shared_rows += best_row
        return donor.session_id

    # ---- feeding -----------------------------------------------------------------------------
    def feed(self, session_id: str, ids: list[int], prompt_end: int | None = None, now: float | None = None) -> FeedReport:
        """The session now holds `ids` (the whole session so far). Reads nothing."""
        self._check_ids(ids)
        session = self.open(session_id)
        session.last_fed_s = self.clock() if now is None else now
        rolled_back, first_diff = None, None
        if session.cache is not None and session.committed:
            first_diff = common_prefix(session.ids, ids, session.committed)
            if first_diff < session.committed:
                rolled_back = self.rollback(session, first_diff)
        session.ids = list(ids)
        session.epoch = new_epoch()
        if prompt_end is not None and not 0 <= prompt_end <= len(ids):
            raise SessionError(f"prompt_end {prompt_end} is outside [0, {len(ids)}]")
        # the prompt end's line joins the lines; where the state already stands on it, it is kept now
        session.apply(session.book.feed(len(ids), prompt_end,
                                        session.committed if session.cache is not None else None))
        session.behind_at_turn_start = session.behind
        self.residency.after_feed(self, session)
        self.residency.note_ids(self, session)
        self.publish()  # a feed may have moved other sessions too
        return FeedReport(session_id, session.committed, session.backlog, len(ids) - session.readable_end,
                          rolled_back, first_diff)

    def append(self, session_id: str, new_ids: list[int], now: float | None = None) -> FeedReport:
        """`feed` of what the session holds plus new_ids, checking only the new ids (nothing read can
        differ, so there is nothing to roll back): what a decode round costs the reader's host time."""
        session = self.get(session_id)
        self._check_ids(new_ids)
        session.ids.extend(new_ids)
        session.last_fed_s = self.clock() if now is None else now
        session.behind_at_turn_start = session.behind
        self.residency.after_feed(self, session)
        self.publish(session)
        return FeedReport(session_id, session.committed, session.backlog, len(session.ids) - session.readable_end, None, None)

    def _check_ids(self, ids: list[int]) -> None:
        if not isinstance(ids, (list, tuple)):
            raise SessionError(f"ids must be a list of token ids, got {type(ids).__name__}")
        vocab = self.engine.cfg.vocab_size
        if ids:  # at once in numpy (an agent's whole session every turn: 60k ids, ~10x faster than a loop);
            # anything numpy does not make a row of integers is looked at one by one for the message
            try:
                arr = np.array(ids)
            except (ValueError, TypeError, OverflowError):
                arr = None
            if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu" and 0 <= arr.min() and arr.max() < vocab:
                return
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < vocab:
                raise SessionError(f"token id {i!r} is outside the vocabulary [0, {vocab})")
        if ids:
            raise SessionError(f"ids must be token ids (integers in [0, {vocab})), got elements of {type(ids[0]).__name__}")

    def rollback(self, session: GridSession, first_diff: int) -> int:
        """Go back to the newest checkpoint at or below `first_diff` (row 0 without one; the book decides):
        KV rows below it stay, the GDN state is the checkpoint's; returns the row gone back to."""
        cache = session.cache
        assert cache is not None
        back = session.book.roll_back(first_diff)
        position = back.row
        if position == 0:
            for t in cache.recurrent:
                t.zero_()
            for t in cache.conv:
                t.zero_()
            session.stats.restarts += 1
            self.stats.restarts += 1
        else:
            cache.set_state(*session.states[position])
        session.apply_dropped(back.dropped)
        session.kv.truncate(position)
        session.stats.ids_reread += session.committed - position
        session.stats.rollbacks += 1
        cache.length = position
        session.committed = position
        return position

    # ---- reading -----------------------------------------------------------------------------
    def read_step(self, session_id: str) -> ChunkReport | None:
        """Read one whole grid chunk of the session; None if it has no whole chunk waiting."""
        pending = self.launch_step(session_id)
        return None if pending is None else self.finish_step(pending)

    def launch_step(self, session_id: str, chunks: int = 1, limit: int | None = None) -> "PendingChunk | None":
        """Launch the session's next whole grid chunk without waiting for the device; None if it has no
        whole chunk waiting. The session's rows advance at once (the next launch reads the chunk after),
        and the device runs the launches in order. Every pending chunk must go through `finish_step`, in
        launch order, before anything else of the reader runs.

        chunks > 1 (graph path): up to that many chunks in one replay, a chunk group (qse/engine/graphs.py:
        one chunk's second half of the layers beside the next one's first half), the same
        bits as one at a time. A group is a power of two of chunks, never more than are waiting, and ends
        at the first prompt or divergence line inside it, so its checkpoints fall on its end (recent ones
        are taken at a launch's end, one a group)."""
        session = self.get(session_id)
        self.ensure_resident(session)
        backlog = self._backlog(session, limit)
        if backlog < self.grid:
            return None
        start = session.committed
        count = self._group_size(session, chunks, backlog)
        if count > 1 and not self.graphs.can_group(count, self.grid):  # no room to capture it: one chunk
            count = 1
        while True:  # a group the pool has no room for reads one chunk instead
            rows = count * self.grid
            pages = session.kv.pages_for(start + rows) - len(session.kv.pages)
            if pages <= 0 or self.residency.make_room(self, pages, session):
                break
            if count == 1:
                raise MemoryError(f"{self.who}'s KV pool ({self.pool.num_pages} pages) cannot hold session {session_id!r} at {start + rows} rows")
            count = 1
        ids = session.ids[start : start + rows]
        begin = None
        try:
            if self.graphs is not None:
                begin = self._launch_graph_chunk(session, ids, start, count)
                hidden = self.graphs.final_hidden(rows) if self.chunk_hidden else None
                pending = PendingChunk(session, start, chunks=count, hidden=hidden)
            else:  # eager: the engine measures (and waits for) the forward itself
                taps = self.engine.model.new_taps(rows, ("final_hidden",)) if self.chunk_hidden else None
                _, gpu_ms = self.engine.forward(session.cache, self.engine.host_ids(ids), logits="none", taps=taps)
                pending = PendingChunk(session, start, gpu_ms=gpu_ms, hidden=None if taps is None else taps["final_hidden"])
        except BaseException:
            self._recover(session, start)
            raise
        session.committed = start + rows
        session.stats.chunks_read += count
        session.stats.ids_read += rows
        self._checkpoints_after_chunk(session)  # device copies, in order after the chunk
        if begin is not None:  # the chunk's device time includes its checkpoint copies
            pending.marks = (begin, self._device_clock.mark())
        return pending

    def _recover(self, session: GridSession, start: int) -> None:
        """A chunk's forward failed (an out-of-memory, say) after some of its layers had written the session's
        state in place: the session goes back to its newest checkpoint at or below the chunk's start, whose
        state is a copy of its own (exact), or, where even that fails, keeps its ids and loses its state (read
        again from row 0). Never on from a half-read chunk."""
        try:
            if session.cache is not None:
                self.rollback(session, start)
                return
        except BaseException as exc:  # (the rollback's own copies failed too)
            log.warning("session_state_dropped", session=session.session_id, error=repr(exc))
        self.drop_state(session)

    def _backlog(self, session: GridSession, limit: int | None) -> int:
        """Whole-chunk ids waiting below `limit` (a row; None: every whole chunk known)."""
        end = session.readable_end if limit is None else min(session.readable_end, limit)
        return max(0, end - session.committed)

    def _group_size(self, session: GridSession, chunks: int, backlog: int) -> int:
        """How many chunks the next launch reads: 1 without graphs or when asked for 1; else the largest
        power of two up to `chunks` that are all waiting and hold no prompt or divergence line inside."""
        _check_chunks(chunks, "chunks")
        if chunks == 1 or self.graphs is None or self.chunk_hidden:
            return 1
        return session.book.group_chunks(session.committed, min(chunks, backlog // self.grid))

    def finish_step(self, pending: "PendingChunk") -> ChunkReport:
        """Wait for a launched chunk (or group); its report, with the device time it took."""
        if pending.marks is not None:  # (ms waits for the end mark)
            pending.gpu_ms = self._device_clock.ms(*pending.marks)
            pending.marks = None
        session, gpu_ms, end = pending.session, pending.gpu_ms, pending.start + pending.chunks * self.grid
        session.stats.last_chunk_ms = gpu_ms / pending.chunks
        session.stats.total_chunk_ms += gpu_ms
        self.stats.chunks += pending.chunks
        self.stats.gpu_ms += gpu_ms
        self.publish(session)
        return ChunkReport(session.session_id, end, max(0, session.readable_end - end), gpu_ms, pending.start,
                           pending.chunks)

    def _launch_graph_chunk(self, session: GridSession, ids: list[int], start: int, chunks: int = 1) -> Any:
        """Launch the chunk's (or the group's) replay; the device mark before it."""
        if not session.kv.ensure(start + len(ids)):
            raise MemoryError(f"{self.who}'s KV pool cannot hold session {session.session_id!r} at {start + len(ids)} rows")
        return self.graphs.run_chunks(session.cache, ids, start, chunks, hidden=self.chunk_hidden)

    def read_all(self, session_id: str, lookahead: int = 1, group: int | None = None,
                 limit: int | None = None) -> list[ChunkReport]:
        """Every whole chunk waiting, `lookahead` launches ahead of the one being read back (the host's
        launch then overlaps the device's work), `group` chunks a launch where they fit (None: the reader's
        chunk_group); the bits equal reading them one at a time."""
        group = self.chunk_group if group is None else group
        reports: list[ChunkReport] = []
        in_flight: deque[PendingChunk] = deque()
        try:
            while (pending := self.launch_step(session_id, group, limit)) is not None:
                in_flight.append(pending)
                while len(in_flight) > lookahead:
                    reports.append(self.finish_step(in_flight.popleft()))
        finally:
            while in_flight:
                reports.append(self.finish_step(in_flight.popleft()))
        return reports

    @staticmethod
    def _checkpoints_after_chunk(session: GridSession) -> None:
        """The book's checkpoints at a launch's end (the committed row)."""
        session.apply(session.book.after_chunk(session.committed))

    @staticmethod
    def chunk_may_checkpoint(session: GridSession) -> bool:
        """Whether the session's next chunk may take a checkpoint (what a byte cap must leave room for)."""
        return session.book.may_take_at(session.committed + session.grid)

    def sessions_with_backlog(self) -> list[GridSession]:
        """Sessions with a whole chunk to read, least behind first (cheapest to make fresh)."""
        ready = [s for s in self.sessions.values() if s.backlog >= self.grid]
        return sorted(ready, key=lambda s: (s.backlog, s.last_fed_s))

    def reserve_rows(self, session: GridSession, rows: int, forwarded: int) -> None:
        """KV pages for `rows` rows of a session (a fork above its committed rows), room made through the
        residency manager; MemoryError if the pool cannot hold them."""
        if rows > self.max_rows:
            raise self.too_long(session, rows, f"a fork of {forwarded} ids above row {session.committed}")
        pages = session.kv.pages_for(rows) - len(session.kv.pages)
        if pages > 0 and not self.residency.make_room(self, pages, session):
            raise MemoryError(f"{self.who}'s KV pool cannot hold a fork of {forwarded} ids on session {session.session_id!r}")
        if not session.kv.ensure(rows):
            raise MemoryError(f"{self.who}'s KV pool cannot hold session {session.session_id!r} at {rows} rows")

    @staticmethod
    def end_fork(session: GridSession) -> None:
        """KV pages above the committed rows given back; the length back at the committed rows."""
        session.kv.truncate(session.committed)
        session.cache.length = session.committed

    # ---- exactness ---------------------------------------------------------------------------
    def fresh_prefill(self, ids: list[int], session_id: str = "__fresh__", group: int | None = None) -> GridSession:
        """A new session holding ids, read chunk by chunk on this reader's grid (for checks); group: chunks a
        launch (None: the reader's chunk_group; 1: one at a time, the contract's own definition)."""
        if session_id in self.sessions:
            self.close(session_id)
        self.feed(session_id, ids)
        self.read_all(session_id, group=group)
        return self.get(session_id)

    def state_equal(self, a: GridSession, b: GridSession) -> dict[str, bool]:
        """Bit equality of committed length, every KV row, the recurrent and the conv state."""
        assert a.cache is not None and b.cache is not None
        out = {"committed": a.committed == b.committed}
        if not out["committed"]:
            return {**out, "kv": False, "recurrent": False, "conv": False}
        kv_equal = True
        for slot in range(len(self.engine.cfg.attention_layers)):
            ka, va = a.kv.read(slot, a.committed) if a.committed else (None, None)
            kb, vb = b.kv.read(slot, b.committed) if b.committed else (None, None)
            if ka is not None and not (torch.equal(ka, kb) and torch.equal(va, vb)):
                kv_equal = False
        out["kv"] = kv_equal
        out["recurrent"] = all(torch.equal(x, y) for x, y in zip(a.cache.recurrent, b.cache.recurrent))
        out["conv"] = all(torch.equal(x, y) for x, y in zip(a.cache.conv, b.cache.conv))
        return out

    def resident_nbytes(self) -> int:
        # the event loop asks this (status) while the engine's thread may add a session: list() copies the
        # dict in one step under the GIL, a generator over the live view would fail mid-way
        return sum(s.nbytes for s in list(self.sessions.values()))

    def safe_point(self) -> None:
        """Between rounds or in the idle window, on the owning thread: the residency manager lands its moves
        and keeps its caps (never inside a ration slice), and the snapshot shows where sessions now are."""
        self.residency.safe_point(self)
        self.publish()

    def publish(self, session: GridSession | None = None) -> None:
        """On the owning thread, after a change: `session`'s view (None: every session's) rebuilt and the
        snapshot replaced whole, so another thread reads one consistent moment and never iterates what this
        thread is changing. A move made for room inside a read shows at the next feed or safe point."""
        if session is None:
            self._views = {sid: _view(s) for sid, s in self.sessions.items()}
        elif session.session_id in self.sessions:
            self._views[session.session_id] = _view(session)
        self.snapshot = BookSnapshot(tuple(self._views.values()))



def _check_chunks(value: int, name: str) -> None:
    """core's check of a chunk count, as the reader's own error."""
    try:
        check_group(value, name)
    except ValueError as exc:
        raise SessionError(str(exc)) from None


__all__ = ["BookSnapshot", "BookStats", "SessionView", "ChunkReport", "DropLRU", "FeedReport", "GridSessions", "PendingChunk", "Residency", "SessionError",
           "UnknownSession"]
