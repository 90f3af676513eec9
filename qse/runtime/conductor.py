"""The asyncio conductor: the served model's turns, and the reader's time around and inside them.

    idle loop (every poll_s)               turn (one request at a time on the engine lock, FIFO)
    ------------------------               ----------------------------------------------------
    quiet? -> engine lock, never           feed the prompt to the reader (rollback if it diverged)
      queueing; box lock, never waiting    prefill -> first token: the ration counts from after_s past it
    IdleBurst: chunks while <= burst_s,    decode round | reader's slice (2 %) | narrator's slice (3 %) | ...
      none once a request waits            end: feed the output, close the turn's ledger, emit the record

Who decides: qse/core's `Scheduler` (qse/core/scheduler.py), the one copy the replay runs too: the conductor
reports events (a turn arrived, the round loop asks, a round ended, the idle window looks, a read ended, a turn
ended) with `now` and carries out the action it answers (open a turn, run a round, read a slice or a burst,
nothing). Who carries it out: the conductor (its modules below) on the event loop, `ChunkRunner` on the reader's
executor thread (plan_read + PlanDriver, asking the window's decision before every chunk), and the engines'
executors for every piece of device work. Every measured piece goes into the GPU-time ledger (core's GpuLedger), per turn and in
total.

Modules, along the scheduler's events: `turn.py` (a turn's request, records and its two ends), `rounds.py`
(RoundDue: the round loop, the round launched ahead), `windows.py` (RoundEnded, IdlePoll, IdleOpened,
ReadEnded: the reader's slices and the idle window); this one is the facade that holds the state they share
(the queues, the ledger, the executors), the questions, the lifecycle and the status.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import msgspec
import structlog

from ..core.chunk_cost import ChunkCostEstimator
from ..core.idle import IdleBurst
from ..core.ids import same_namespace
from ..core.ledger import Role, ms_to_us
from ..core.locks import Priority
from ..core.plan import ROLE_OF_WINDOW, Window, check_group
from ..core.prefix import common_prefix
from ..core.ration import RationSlice
from ..core.scheduler import Scheduler
from ..core.spec import SpecPlanner
from ..engine.engine import Engine
from ..engine.rounds import pool_slots_for
from ..policy import Policy
from ..sessions.grid import GridSessions
from ..sessions.served import ServedSessions, require_mtp_head
from ..shadow.reader import READ_FIRST, AskResult, ShadowError, ShadowReader
from .executor import EngineExecutor, landed
from .ledger import RuntimeLedger
from .locks import LockBoard
from .narrator import Narrator
from .reading import ChunkRunner
from .rounds import LaunchedAhead, RoundLoop
from .router import ROUTER_LETTERS, ROUTER_QUESTION, Answer, Journal, RouterQueue
from .turn import ConductorStopped, GenerateRequest, RoundEntry, Turn, TurnLifecycle, TurnRecord  # noqa: F401 (the API)
from .windows import ReaderWindows

log = structlog.get_logger("qse.conductor")  # one logger for the conductor's modules: its events keep their name


@dataclass
class ShadowOptions:
    """The profile's shadow block."""

    mode: str = "on"  # off | on
    narrator: str = "off"  # off | on
    router: str = "off"  # off | shadow
    router_min_tokens: int = 8192
    narrator_max_tokens: int = 48  # the longest summary


class Conductor(TurnLifecycle, RoundLoop, ReaderWindows):
    """The facade: the served model's turns in rounds (rounds.py), the reader's time around and inside them
    (windows.py), a turn's two ends (turn.py), the questions, the lifecycle and the status."""

    def __init__(self, served: Engine, reader: ShadowReader | None, options: ShadowOptions | None = None,
                 policy: Policy | None = None, on_turn: Callable[[TurnRecord], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, serving: ServedSessions | None = None):
        """serving: the served model's sessions (made from the policy when None, without a disk or host
        tier; `qse serve` passes one with its store, and a benchmark that makes many conductors passes one,
        so its pool and graphs are made once). policy: what the entry point read from the settings (None: the
        shipped defaults, for tests)."""
        self.served = served
        self.options = options or ShadowOptions()
        self.reader = reader if self.options.mode == "on" else None
        self.policy = policy or Policy()
        self.on_turn = on_turn
        self.clock = clock
        self.board = LockBoard()
        self.ledger = RuntimeLedger()
        cfg = self.policy
        self.estimator = ChunkCostEstimator(cfg.chunk_prior_ms)
        self.serving = serving or served_sessions(served, cfg)
        # every decision on what the engine runs next (rounds, slices, the idle window): the conductor carries
        # them out and reports what happened
        self.scheduler = Scheduler(cfg, self.estimator, self.ledger, max_running=self.serving.rounds.max_running,
                                   served_grid=self.serving.grid,
                                   reader_grid=self.reader.grid if self.reader is not None else None)
        # before the executors' threads start: it checks the reader's lookahead and lead
        self.runner = (ChunkRunner(self.reader, self.estimator, self.ledger, clock, lookahead=cfg.reader_lookahead,
                                   launch_lead_ms=cfg.launch_lead_ms, idle_group=cfg.idle_group,
                                   may_share=same_namespace if cfg.share_heads else None)
                       if self.reader is not None else None)
        self.served_exec = EngineExecutor("served")
        self.reader_exec = self.served_exec if (reader is None or reader.engine is served) else EngineExecutor("reader")
        self._idle_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        # the router's questions (shadow mode): queued at turn start, answered where the reader reaches them
        self.router = RouterQueue(self.reader.grid if self.reader is not None else 1, self.options.router_min_tokens,
                                  served.chat.turn_end_id, clock)
        self.journal = Journal(self.policy.journal_dir)
        self._session_prompts: dict[str, list[int]] = {}
        self._unread_since: dict[str, float] = {}  # session -> when its oldest unread chunk became known
        self.narrator = Narrator(served.chat.thought_end_id, self.options.narrator_max_tokens, cfg.chunk_prior_ms)
        self._waiting: deque[RoundEntry] = deque()  # turns waiting for the round loop, first come first served
        self._reading: list[RoundEntry] = []  # turns whose prompts the rounds read, a few chunks a round
        self._running: list[RoundEntry] = []  # turns in the rounds
        # turns that joined the queue since the round in flight was planned (rebound whole, never appended to: the
        # served thread reads it to cut the round, QSE_ROUND_CUT)
        self._joined: tuple[RoundEntry, ...] = ()
        self._round_task: asyncio.Task | None = None
        self._arrivals = itertools.count()
        self._in_flight: LaunchedAhead | None = None  # the round launched ahead (rounds.py)
        # speculative decoding (QSE_SPECULATE): whether a round verifies drafts, and how wide (any width the
        # rounds hold graphs for: a wide verify pays alone, a narrow one in a full batch)
        width = self.serving.rounds.verify_width
        self.spec_planner = SpecPlanner(tuple(range(2, width + 1))) if width else None
        self._waiting_changed = asyncio.Event()
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._turn_seq = itertools.count()
        self._stopping = False
        self._stopped = False
        self._started = False
        self.turns = 0
        self.idle_bursts = 0
        self._seed_estimator()

    def _seed_estimator(self) -> None:
        """Start from the reader's own measurements where it has some (sessions read before we started)."""
        if self.reader is None:
            return
        for s in self.reader.sessions.values():
            if s.stats.last_chunk_ms > 0 and s.committed >= self.reader.grid:
                self.estimator.observe(s.committed - self.reader.grid, s.stats.last_chunk_ms)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.policy.gc_freeze:
            # what exists now (weights' wrappers, tokenizer tables, graphs) lives as long as the process: out
            # of the collector's sight, a full collection during a turn scans only what turns allocate (it
            # scanned ~170k objects, 80 ms, between two decode rounds)
            gc.collect()
            gc.freeze()
        self._started = True
        self._start_idle()

    def _start_idle(self) -> None:
        if self.reader is not None and self._idle_task is None and not self._stopping:
            self._wake = asyncio.Event()
            self._idle_task = asyncio.create_task(self._idle_loop(), name="qse-idle-reader")

    # ---- the reader's residency (qse/runtime/planner.py loads and releases it) -----------------
    def attach_reader(self, reader: ShadowReader) -> None:
        """The planner loaded the reader: it follows the turns from now, and learns every served session's ids
        (read in the idle windows) so a session served before it loaded is not unknown to it. The caller holds
        the engine lock: no turn, question or chunk runs."""
        if self.options.mode != "on":
            raise ShadowError("the shadow reader is off in this profile")
        if self.reader is not None:
            raise ShadowError("a reader is attached already; release it first")
        cfg = self.policy
        self.reader = reader
        self.router.grid = reader.grid
        self.scheduler.reader_grid = reader.grid
        self.runner = ChunkRunner(reader, self.estimator, self.ledger, self.clock, lookahead=cfg.reader_lookahead,
                                  launch_lead_ms=cfg.launch_lead_ms, idle_group=cfg.idle_group,
                                  may_share=same_namespace if cfg.share_heads else None)
        self.reader_exec = self.served_exec if reader.engine is self.served else EngineExecutor("reader")
        self._seed_estimator()
        for sid, session in list(self.serving.book.sessions.items()):
            if session.ids and sid not in reader.sessions:
                reader.feed(sid, list(session.ids), len(session.ids))
                self._note_backlog(sid)
        if self._started:
            self._start_idle()

    async def detach_reader(self) -> ShadowReader | None:
        """Release the reader: every resident session leaves the device for its disk tier (when it has one),
        its thread stops, and the conductor serves without it. The caller holds the engine lock, so only the
        copies off the device happen under it: the files are written after it (the caller lands them with the
        residency's `flush` once it has let the engine go)."""
        reader = self.reader
        if reader is None:
            return None
        queued = await self.reader_exec.run(reader.residency.park_all, reader, False)
        if queued:
            log.info("conductor_parked", book="reader", result=queued)
        self.reader = None
        self.runner = None
        self.router.pending.clear()
        self._unread_since.clear()
        if self.reader_exec is not self.served_exec:
            self.reader_exec.shutdown()
        self.reader_exec = self.served_exec
        return reader

    async def stop(self) -> None:
        """Planned stop: the idle burst stops before its next chunk, the request in flight (and those queued
        before the stop) finish, then every resident session is written (if the store has a disk tier)."""
        if self._stopping:
            return
        self._stopping = True
        if self._idle_task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._idle_task
            self._idle_task = None
        try:
            async with self.board.engine_lock(Priority.SERVED):
                self._stopped = True
                if self.reader is not None:
                    parked = await self.reader_exec.run(self.reader.residency.park_all, self.reader)
                    if parked:
                        log.info("conductor_parked", book="reader", result=parked)
                book = self.serving.book
                parked = await self.served_exec.run(book.residency.park_all, book)
                if parked:
                    log.info("conductor_parked", book="served", result=parked)
        finally:
            self._stopped = True
            self.served_exec.shutdown()
            if self.reader_exec is not self.served_exec:
                self.reader_exec.shutdown()
            if self.policy.gc_freeze:
                gc.unfreeze()  # what start froze may be collected again (and is, at exit)

    def _refuse_if_released(self) -> None:
        if self.reader is None:  # released while the question waited for the engine
            raise ShadowError("the shadow reader was released; load it again to ask")

    def _refuse_if_stopped(self) -> None:
        if self._stopped:
            raise ConductorStopped("the conductor is stopped (a planned stop); send the request again "
                                   "after the restart")

    # ---- sessions ----------------------------------------------------------------------------
    def map_session(self, prompt_ids: list[int], explicit: str | None, namespace: str = "",
                    head_tokens: int = 0) -> str | None:
        """Explicit id, else the session in `namespace` (ids that start with it) that this prompt continues,
        else a new id in `namespace`. The prompt continues the session with which it shares the longest common
        prefix when that prefix is at least one grid chunk and longer than `head_tokens`: the caller's measure
        of what two separate conversations may share (a system prompt and a first user turn), so that sharing
        only a head never joins them. `namespace` is the server's tenant boundary: mapping never crosses it.
        The reader's sessions are searched when it is on, else the served model's."""
        if explicit:
            return explicit
        book = self.reader if self.reader is not None else self.serving.book
        best, best_len = None, 0
        for sid, session in list(book.sessions.items()):
            if not sid.startswith(namespace):
                continue
            n = common_prefix(session.ids, prompt_ids)
            if n > best_len:
                best, best_len = sid, n
        if best is not None and best_len >= book.grid and best_len > head_tokens:
            return best
        return f"{namespace}s-{uuid.uuid4().hex[:16]}"

    # ---- questions ----------------------------------------------------------------------------
    def render_question(self, question: str) -> list[int]:
        """A question as the reader's chat format asks it (the format is the model's business, not ours)."""
        return self.reader.engine.chat.question_ids(question)

    async def ask(self, session_id: str, question: str, choices: list[str], upto: int | None = None,
                  behind: str = READ_FIRST) -> AskResult:
        """A question on a fork. Whole chunks the reader has not read are read on the grid first and kept for
        the session (behind="read", charged to the question), or left unseen (behind="answer_now")."""
        ids = self._question_ids(session_id, question)
        limit = self.policy.max_question_tokens
        if len(ids) > limit:
            raise ShadowError(f"the question has {len(ids)} tokens, over the limit of {limit} (QSE_MAX_QUESTION_TOKENS)")
        return await self._on_fork(session_id, Priority.QUESTION, Role.READER_ASK, upto, behind,
                                   self.reader.ask, session_id, ids, choices, upto, behind)

    def _question_ids(self, session_id: str, text: str) -> list[int]:
        """A known session's question, rendered; refused at once where there is no reader."""
        if self.reader is None:
            raise ShadowError("the shadow reader is off in this profile")
        self.reader.get(session_id)
        return self.render_question(text)

    async def _on_fork(self, session_id: str, priority: Priority, role: Role, upto: int | None, behind: str,
                       call, *args):
        """A question's or a summary's turn on the engine: behind the turns, catch up (router questions first)
        and run `call` on the reader's thread; the catch-up's device time and ids count in its result.

        A session whose reader state is only in a file loads first, holding nothing (`_reader_loaded`): the
        rounds, an arriving request and the reader's other work go on while its file is read, and the engine
        is taken once the load has landed, so the restore under it is a host copy. A session parked again
        while its asker waited for the engine is loaded again the same way (a few times at most: then its
        file is read under the engine, as a session never read ahead is)."""
        for attempt in range(_LOAD_ATTEMPTS):
            await self._reader_loaded(session_id)
            async with self.board.engine_lock(priority):
                self._refuse_if_stopped()
                self._refuse_if_released()
                if not await self._bring_back_if_ready(session_id, force=attempt == _LOAD_ATTEMPTS - 1):
                    continue
                read_ms, read_tokens = await self._catch_up(session_id, upto, behind)
                result = await self.reader_exec.run(call, *args)
                self.ledger.record(role, result.gpu_ms + read_ms)
                break
        self._note_backlog(session_id)
        return replace(result, gpu_ms=result.gpu_ms + read_ms, read_ms=result.read_ms + read_ms,
                       read_tokens=result.read_tokens + read_tokens)

    async def _reader_loaded(self, session_id: str) -> None:
        """Until bringing the session's reader state back reads no file on the reader's thread (`ready`): a
        state only in a file starts loading on the store's loader thread (one short hop to the reader's
        thread), and the load is awaited on the event loop, holding no lock and no thread. A file that cannot
        be used lands as a miss (the session is read again from row 0)."""
        while (reader := self.reader) is not None and not self._stopped and not reader.residency.ready(session_id):
            load = await self.reader_exec.run(reader.residency.prefetch, reader, session_id)
            if load is None:  # landed at that hop (or the session is gone: the question says so under the lock)
                return
            await landed(load)

    async def _bring_back_if_ready(self, session_id: str, force: bool = False) -> bool:
        """Under the engine lock: the session's reader state resident again where that reads no file on the
        reader's thread (force: whatever it reads); False when it was parked again meanwhile and must load."""
        session = self.reader.sessions.get(session_id)
        if session is None or session.is_resident:  # nothing on this loop moves a session while we hold the engine
            return True
        return await self.reader_exec.run(self._restore_if_ready, session_id, force)

    def _restore_if_ready(self, session_id: str, force: bool) -> bool:
        """On the reader's thread: the readiness check and the restore in one step (nothing runs between)."""
        reader = self.reader
        session = reader.sessions.get(session_id)
        if session is None:
            return True
        if not force and not reader.residency.ready(session_id):
            log.info("reader_load_again", session=session_id)
            return False
        reader.ensure_resident(session)
        return True

    async def _catch_up(self, session_id: str, upto: int | None, behind: str) -> tuple[float, int]:
        """Before a question: where router questions wait inside the backlog, read up to each, answer it, and
        go on (a question's read must not pass them); the reader's own catch-up reads the rest. Returns the
        device ms and the ids read."""
        if behind != READ_FIRST or not self.router.pending.get(session_id):
            return 0.0, 0
        spent, rows = 0.0, 0
        while self.router.pending.get(session_id):
            session = self.reader.get(session_id)
            stops = [r for r in self.router.stop_rows(session_id) if r >= session.committed]
            end = len(session.ids) if upto is None else upto
            reports = await self.reader_exec.run(self.reader.catch_up, session_id, min([end, *stops]))
            spent += sum(r.gpu_ms for r in reports)
            rows += sum(r.chunks for r in reports) * self.reader.grid
            if not await self._answer_router(session_id):
                break
        return spent, rows

    async def summarize(self, session_id: str, prompt: str, max_tokens: int, behind: str = READ_FIRST):
        """A summary on a fork, asked outside a turn (the summarize route, or a turn whose thought the live
        narrator did not reach): it waits for the engine behind the turns and questions, then reads what is
        still behind (charged to the narrator), or answers at once with behind="answer_now"."""
        ids = self._question_ids(session_id, prompt)
        stop = (self.reader.engine.chat.turn_end_id,)
        return await self._on_fork(session_id, Priority.NARRATOR, Role.NARRATOR, None, behind,
                                   self.reader.summarize, session_id, ids, max_tokens, stop, behind)

    def _committed(self, session_id: str) -> int | None:
        session = self.reader.sessions.get(session_id) if self.reader is not None else None
        return None if session is None else session.committed

    async def _answer_router(self, session_id: str, window: Window | None = None, turn_id: str | None = None,
                             decision: IdleBurst | RationSlice | None = None) -> int:
        """Answer the pending router questions the reader has reached (the next chunk would pass them). One
        answered inside a turn's slice (a ration's, the narrator's) is charged to that slice's role and turn
        and spends the slice's budget; elsewhere (the idle window, before a question) it is a question's."""
        ids = self.render_question(ROUTER_QUESTION)

        async def ask(position: int) -> Answer:
            result = await self.reader_exec.run(self.reader.ask, session_id, ids, ROUTER_LETTERS, position)
            if window is not None and turn_id is not None:
                self.ledger.record(ROLE_OF_WINDOW[window], result.gpu_ms, turn_id=turn_id)
                if decision is not None:
                    decision.spent_us += ms_to_us(result.gpu_ms) or 0
            else:
                self.ledger.record(Role.READER_ASK, result.gpu_ms)
            return Answer(result.label, result.probability)

        return await self.router.answer_ready(session_id, self._committed(session_id), ask, self.journal)

    # ---- status ------------------------------------------------------------------------------
    def served_cache_status(self) -> dict[str, Any]:
        """The served sessions' cache: queries and hits in tokens, hits per tier, the store's tiers."""
        serving = self.serving
        book = serving.book
        snap = book.snapshot  # taken on the served engine's thread: read whole, never iterated as it changes
        out: dict[str, Any] = {"grid": book.grid, "sessions": len(snap.sessions), "resident_sessions": snap.num_resident,
                               "resident_bytes": snap.resident_nbytes, **dict(serving.counts)}
        store = book.residency.stats()
        if store:
            out["store"] = store
        return out

    def status(self) -> dict[str, Any]:
        running = [e.turn.req.request_id for e in self._reading + self._running]
        out: dict[str, Any] = {
            "served_model": self.served.name,
            "served_mode": self.serving.mode,
            "served_cache": self.served_cache_status(),
            "shadow": self.options.mode,
            "turns": self.turns,
            "ledger_ms": {k: round(v, 3) for k, v in self.ledger.total_ms.items()},
            "idle_bursts": self.idle_bursts,
            "running": running,
            "waiting": len(self._waiting) + self.board.engine.num_waiting,  # turns queued, then others at the engine
        }
        if self.reader is None:
            return out
        r = self.reader
        snap = r.snapshot  # taken on the reader's thread: read whole, never iterated as it changes
        out.update({
            "slot": {"model": r.engine.name, "grid": r.grid, "device": str(r.engine.device), "dtype": str(r.engine.dtype).replace("torch.", ""),
                     "kernels": r.engine.kernels, "mode": r.mode,
                     "pool_pages": r.pool.num_pages, "pool_free_pages": r.pool.num_free},
            "sessions": [
                {"session": v.session_id, "position": v.position, "known": v.known, "backlog": v.backlog,
                 "behind": v.behind, "bytes": v.nbytes, "resident": v.resident,
                 "checkpoints": list(v.checkpoints), "rollbacks": v.rollbacks,
                 "ids_reread": v.ids_reread, "chunks_read": v.chunks_read, "too_long": v.too_long}
                for v in snap.sessions
            ],
            "backlog": snap.backlog,
            "resident_bytes": snap.resident_nbytes,
            "last_answers": list(r.stats.last_answers),
            "router_pending": self.router.num_pending,
            "router": msgspec.structs.asdict(self.router.counts),
            "narrator": self.narrator.status(),
            "chunk_estimate_ms": self.estimator.estimate_ms(0),
        })
        store = r.residency.stats()
        if store:
            out["store"] = store
        return out


_LOAD_ATTEMPTS = 3  # loads a question's session may need before its file is read under the engine



def served_sessions(engine: Engine, policy: Policy, residency=None) -> ServedSessions:
    """The served model's sessions as the policy sizes them (residency: the store with its host and disk
    tiers; None drops least recently fed sessions past the pool). QSE_SPECULATE=mtp: a model without an MTP
    head is refused here, before the pool is made; the pool's pages hold the head's KV slot too, and the prompts'
    grid chunks are read with the final-hidden taps, for the head's rows of them."""
    check_group(policy.served_chunk_group, "the served chunk group (QSE_SERVED_CHUNK_GROUP)")
    if policy.mtp:
        require_mtp_head(engine)
    book = GridSessions(engine, grid=policy.served_grid, pool_bytes=int(policy.served_kv_gb * (1 << 30)),
                        **policy.served_checkpoints(), residency=residency, chunk_group=policy.served_chunk_group,
                        graphs=None if policy.served_graphs else False, who="the served model",
                        kv_slots=pool_slots_for(engine.cfg, policy.mtp), chunk_hidden=policy.mtp)
    return ServedSessions(book, max_running=policy.max_running, verify_width=policy.verify_width, mtp=policy.mtp,
                          may_share=same_namespace if policy.share_heads else None)
