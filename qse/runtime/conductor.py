"""The asyncio conductor: the served model's turns, and the reader's time around and inside them.

    idle loop (every poll_s)               turn (one request at a time on the engine lock, FIFO)
    ------------------------               ----------------------------------------------------
    quiet? -> engine lock, never           feed the prompt to the reader (rollback if it diverged)
      queueing; box lock, never waiting    prefill -> first token: the ration counts from after_s past it
    IdleBurst: chunks while <= burst_s,    decode round | reader's slice (2 %) | narrator's slice (3 %) | ...
      none once a request waits            end: feed the output, close the turn's ledger, emit the record

Who decides: qse/core's `Scheduler` (qse/core/scheduler.py), the one copy the replay runs too: this module
reports events (a turn arrived, the round loop asks, a round ended, the idle window looks, a read ended, a turn
ended) with `now` and carries out the action it answers (open a turn, run a round, read a slice or a burst,
nothing). Who carries it out: this module on the event loop, `ChunkRunner` on the reader's executor thread
(plan_read + PlanDriver, asking the window's decision before every chunk), and the engines' executors for every
piece of device work. Every measured piece goes into the GPU-time ledger (core's GpuLedger), per turn and in
total.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Callable

import msgspec
import structlog

from ..core.chunk_cost import ChunkCostEstimator
from ..core.drive import Stop
from ..core.idle import IdleBurst, IdleWindow, SessionBacklog
from ..core.ledger import Role, ms_to_us
from ..core.locks import HeldLocks, LockRank, Priority
from ..core.plan import ROLE_OF_WINDOW, Window, check_group, whole_chunks
from ..core.prefix import common_prefix
from ..core.ration import RationSlice
from ..core.rounds import Prompt, Read, RoundPlan
from ..core.rounds import Running as RunningView
from ..core.scheduler import (Arrived, Busy, IdleOpened, IdlePoll, OpenIdle, OpenTurn, ReadEnded, ReadPlan,
                              RoundDue, RoundEnded, RunRound, Scheduler, SliceView, TurnEnded)
from ..engine.engine import Engine
from ..engine.sampling import Sampler, SamplingParams
from ..policy import Policy
from ..sessions.grid import GridSessions
from ..sessions.served import LaunchedRound, ServedSessions, ServedTurn
from ..shadow.reader import READ_FIRST, AskResult, ShadowError, ShadowReader
from .executor import EngineExecutor
from .ledger import RuntimeLedger
from .locks import LockBoard
from .reading import ChunkRunner, ReadOutcome, TurnIds, learn
from .narrator import NARRATOR_QUESTION, Narration, Narrator
from .router import ROUTER_LETTERS, ROUTER_QUESTION, Answer, Journal, RouterQueue

log = structlog.get_logger("qse.conductor")

class ConductorStopped(RuntimeError):
    """The conductor was stopped (a planned stop); the request was not run."""


@dataclass
class ShadowOptions:
    """The profile's shadow block."""

    mode: str = "on"  # off | on
    narrator: str = "off"  # off | on
    router: str = "off"  # off | shadow
    router_min_tokens: int = 8192
    narrator_max_tokens: int = 48  # the longest summary


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    session_id: str | None = None  # explicit (X-Session-Id); else mapped by longest common prefix
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    router_label: str | None = None  # the served router's own class for this turn, if a proxy passes it
    # written by the conductor when the turn starts (the server's usage reads it): prompt ids whose state the
    # served session reused
    cached_tokens: int | None = None
    # the live narrator (the profile's narrator on): called on the event loop with the summary of this turn's
    # thought, while the turn runs (qse/runtime/narrator.py); None: the turn is not narrated
    narrate: Callable[[Narration], None] | None = None
    # asked on the event loop before every round: why the turn must end now (the server's ticket: "abort" for a
    # client that left, "shutdown" past a stop's grace), or None. A turn whose consumer waits for its first
    # token cannot close the generator, and a long prompt read on for a client long gone (79k ids: 53 s)
    ended: Callable[[], str | None] | None = None


@dataclass
class TurnRecord:
    request_id: str
    session_id: str | None
    arrival_s: float
    first_token_s: float | None
    end_s: float
    prompt_tokens: int
    shared_prefix_tokens: int
    output_tokens: int
    model: str
    prefill_ms: float
    decode_ms: float
    reader_ration_ms: float
    finish_reason: str
    decode_tokens_per_s: float
    reader_share: float  # reader ration / served decode time
    narrator_ms: float = 0.0  # the narrator's slices inside this turn
    start_s: float | None = None  # when the turn got the engine lock (arrival + queueing)
    # wall time the decode waited on the reader's slices: their device time plus every host step around it
    # (what the served model loses to the ration is this, not reader_ration_ms)
    reader_ration_wall_ms: float = 0.0
    reader_ration_slices: int = 0  # the slices it took (each costs the decode a fixed host overhead)
    # ids of the prompt's kept prefix (what it shares with the session's ids before it) the reader had not read
    # at the turn's start; None for a session's first turn or without a reader (the replay's freshness)
    reader_behind_tokens: int | None = None
    cached_tokens: int = 0  # prompt ids whose served state was reused (not read this turn)
    cache_tier: str | None = None  # where that state came from: device, host, disk


@dataclass
class _Turn:
    """A running turn, as the conductor needs it between two decode rounds."""

    req: GenerateRequest
    turn_id: str  # the ledger's key
    session_id: str | None
    arrival_s: float
    shared_prefix_tokens: int
    start_s: float | None = None
    first_token_s: float | None = None
    out_ids: list[int] = field(default_factory=list)
    finish: str = "length"
    ration_wall_s: float = 0.0  # wall time of the reader's slices between rounds
    ration_slices: int = 0
    reader_behind_tokens: int | None = None  # set by _turn_start (TurnRecord says what it is)
    reader_epoch: int | None = None  # the reader session's epoch once _turn_start fed it the prompt
    cached_tokens: int = 0
    cache_tier: str | None = None

    @property
    def num_known(self) -> int:
        return len(self.req.prompt_ids) + len(self.out_ids)

    def ids_view(self, end: int | None = None) -> TurnIds:
        """The turn's ids up to `end` (None: all), as a reader slice learns them (only what is new)."""
        return TurnIds(self.req.prompt_ids, tuple(self.out_ids), self.reader_epoch, end)


_END = object()  # a turn's stream is over


@dataclass(eq=False)
class _Running:
    """A turn in the round loop: what the loop hands its generator, and what the next round feeds it."""

    turn: _Turn
    out: asyncio.Queue  # ids, then _END (or an exception)
    done: asyncio.Future  # set once the loop has finished the turn (its slot free, its record emitted)
    arrival_no: int = 0  # arrival order (ties and the overdue turns go first come first served)
    unread_tokens: int = 0  # prompt ids its turn must read (an estimate until the turn opens)
    overtaken: int = 0  # turns that arrived after it and got their first token before it
    seq: ServedTurn | None = None
    sampler: Sampler | None = None
    token: int | None = None  # the next round's input: the last id sampled (on the host)
    in_flight: int = 0  # ids launched and not read back yet (0 or 1: a round launched ahead)
    last_round_s: float = float("-inf")  # when its last round was planned or its first token came (the yield)
    closed: bool = False  # the consumer left: end at the next round

    def departed(self) -> str | None:
        """Why the turn ends at the next round, if it does: its consumer closed it, or its request ended."""
        if self.closed:
            return "abort"
        ended = self.turn.req.ended
        return ended() if ended is not None else None

    def running(self) -> RunningView:
        """As the round planner sees a running turn: the ids it has and those in flight stay under max_tokens
        (a stop id in flight may still end it: that round's id is then dropped)."""
        return RunningView(self, self.turn.req.max_tokens - len(self.turn.out_ids) - self.in_flight, self.last_round_s)

    def prompt(self) -> Prompt:
        """As the round planner sees a turn before its first token."""
        if self.seq is None:
            return Prompt(self, self.arrival_no, self.unread_tokens, self.overtaken)
        return Prompt(self, self.arrival_no, self.seq.start.prompt_tokens - self.seq.session.committed,
                      self.overtaken, self.seq.chunks_left)


class Conductor:
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
        # every decision on what the engine runs next (rounds, slices, the idle window): this module carries
        # them out and reports what happened
        self.scheduler = Scheduler(cfg, self.estimator, self.ledger, max_running=self.serving.rounds.max_running,
                                   served_grid=self.serving.grid,
                                   reader_grid=self.reader.grid if self.reader is not None else None)
        # before the executors' threads start: it checks the reader's lookahead and lead
        self.runner = (ChunkRunner(self.reader, self.estimator, self.ledger, clock, lookahead=cfg.reader_lookahead,
                                   launch_lead_ms=cfg.launch_lead_ms, idle_group=cfg.idle_group)
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
        self._waiting: deque[_Running] = deque()  # turns waiting for the round loop, first come first served
        self._reading: list[_Running] = []  # turns whose prompts the rounds read, a few chunks a round
        self._running: list[_Running] = []  # turns in the rounds
        self._round_task: asyncio.Task | None = None
        self._arrivals = itertools.count()
        # the round launched ahead, whose ids are read back in the next round's hop: (its turns, the launch)
        self._in_flight: tuple[list[_Running], LaunchedRound] | None = None
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
                                  launch_lead_ms=cfg.launch_lead_ms, idle_group=cfg.idle_group)
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

    def _note_backlog(self, session_id: str) -> None:
        """Keep when each session's oldest unread chunk became known (the idle window reads the oldest first)."""
        session = self.reader.sessions.get(session_id) if self.reader is not None else None
        if session is not None and session.backlog >= self.reader.grid:
            self._unread_since.setdefault(session_id, self.clock())
        else:
            self._unread_since.pop(session_id, None)

    # ---- the served turns, in rounds -----------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[int]:
        """Stream the served model's token ids for one request; the reader follows the turn. The turn waits for
        the round loop, which reads its prompt a few grid chunks a round beside the running turns' decode, then
        decodes it with every other running turn, one batched round a token. Closing the generator ends the
        turn at the next round."""
        arrival = self.clock()
        self.scheduler.on(Arrived(arrival))
        self._check_prompt(req.prompt_ids)
        self._refuse_if_stopped()
        session_id = self.map_session(req.prompt_ids, req.session_id) or f"s-{uuid.uuid4().hex[:16]}"
        turn = _Turn(req, f"{req.request_id}#{next(self._turn_seq)}", session_id, arrival,
                     self._shared_prefix(session_id, req.prompt_ids))
        lock = self._session_locks.setdefault(session_id, asyncio.Lock())
        async with lock:  # one turn a session at a time: the next one starts from what this one kept
            entry = _Running(turn, asyncio.Queue(), asyncio.get_running_loop().create_future(),
                             arrival_no=next(self._arrivals),
                             unread_tokens=self.serving.unread_estimate(session_id, req.prompt_ids))
            self._waiting.append(entry)
            self._waiting_changed.set()
            self._kick_rounds()
            try:
                while True:
                    item = await entry.out.get()
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                entry.closed = True  # the loop ends the turn at its next round (or drops it from the queue)
                await asyncio.shield(entry.done)

    @property
    def num_waiting(self) -> int:
        """Turns queued for the round loop (not yet started)."""
        return len(self._waiting)

    async def wait_for_waiting(self, count: int) -> None:
        """Until at least `count` turns are queued for the round loop (tests order tasks with this)."""
        while len(self._waiting) < count:
            self._waiting_changed.clear()
            await self._waiting_changed.wait()

    async def rounds_ended(self) -> None:
        """Until the round loop has nothing left (a round launched past a turn's end included)."""
        while self._round_task is not None:
            await asyncio.shield(self._round_task)

    def _kick_rounds(self) -> None:
        if self._round_task is None:
            self._round_task = asyncio.create_task(self._round_loop(), name="qse-rounds")

    async def _round_loop(self) -> None:
        """Ask, do, report: the scheduler opens waiting turns while slots are free, then runs one round (a batched
        decode of every running turn and the next pieces of the prompts being read), then each turn's token (a
        first token when its prompt's tail was read), then the reader's slice between rounds. The engine is held
        while any turn runs, reads or waits (the idle window and the questions wait for the loop to end)."""
        try:
            async with self.board.engine_lock(Priority.SERVED, HeldLocks()):
                while True:
                    await self._drop_departed()
                    # a turn whose served state is only in a file is weighed once its load (beside the rounds)
                    # has landed: it then opens with a host copy, and no round waits for a file read
                    loads = await self._prefetch_waiting()
                    ready = [e.prompt() for e in self._waiting if self.serving.is_ready(e.turn.session_id)]
                    action = self.scheduler.on(RoundDue(
                        self.clock(), ready, [e.prompt() for e in self._reading],
                        [e.running() for e in self._running], self._in_flight is not None))
                    if isinstance(action, OpenTurn):
                        self._waiting.remove(action.key)
                        await self._start_turn(action.key)
                    elif isinstance(action, RunRound):
                        await self._round(action.plan)
                        await self._between_rounds()
                    elif loads:  # nothing runs and the waiting turns' states are loading
                        await self._until_loaded(loads)
                    elif not self._waiting:
                        break
                # no await between the last look at the queues and this: a turn that arrives now starts a loop
                self._round_task = None
        finally:
            self._round_task = None
            for entry in list(self._waiting) + self._reading + self._running:  # the loop died: nobody waits forever
                if not entry.done.done():
                    entry.out.put_nowait(ConductorStopped("the served model's round loop stopped"))
                    entry.done.set_result(None)
            self._waiting.clear()
            self._reading.clear()
            self._running.clear()
            self._in_flight = None

    async def _drop_departed(self) -> None:
        """Turns whose clients left end now: queued ones unstarted, the others with their slots freed."""
        for entry in [e for e in self._waiting if e.departed()]:
            self._waiting.remove(entry)
            entry.turn.finish = entry.departed()
            await self._end(entry, started=False)
        for entry in [e for e in self._reading + self._running if e.departed()]:
            entry.turn.finish = entry.departed()
            await self._end(entry)

    async def _prefetch_waiting(self) -> list:
        """Waiting turns' sessions whose state is only in a file start loading, and finished loads land (one hop
        to the served thread, between rounds); the loads still in flight."""
        sids = [e.turn.session_id for e in self._waiting if not self.serving.is_ready(e.turn.session_id)]
        return await self.served_exec.run(self.serving.prefetch, sids) if sids else []

    async def _until_loaded(self, loads: list) -> None:
        """Nothing runs and the waiting turns' states are loading: until one load is done or a turn arrives."""
        self._waiting_changed.clear()  # (no await since the waiting turns were weighed: no arrival is missed)
        waits = [asyncio.ensure_future(_landed(load)) for load in loads]
        waits.append(asyncio.ensure_future(self._waiting_changed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _start_turn(self, entry: "_Running") -> None:
        """The turn opens: the reader learns the prompt, the served session reuses what it holds and reserves a
        slot; its prompt is read by the next rounds."""
        turn, req = entry.turn, entry.turn.req
        if entry.departed():  # the client left while it waited
            turn.finish = entry.departed()
            await self._end(entry, started=False)
            return
        if self._stopped:
            entry.out.put_nowait(ConductorStopped("the conductor is stopped (a planned stop); send the request "
                                                  "again after the restart"))
            await self._end(entry, started=False)
            return
        turn.start_s = self.clock()
        self.ledger.open_turn(turn.turn_id)
        try:
            await self._turn_start(turn)
            entry.seq = await self.served_exec.run(self.serving.open, turn.session_id, req.prompt_ids)
        except Exception as exc:
            entry.out.put_nowait(exc)
            await self._end(entry)
            return
        entry.sampler = Sampler(req.sampling, vocab_limit=self.served.chat.tokenizer.vocab_size)
        turn.cached_tokens, turn.cache_tier = entry.seq.start.cached_tokens, entry.seq.start.tier
        req.cached_tokens = entry.seq.start.cached_tokens
        self._reading.append(entry)

    async def _round(self, plan: RoundPlan) -> None:
        """One round in one hop to the served thread: a batched decode of the running turns, then the planned
        prompt reads, then the ids of the round launched ahead last time. Where every running turn samples on
        the device (launch_ahead), this round's ids stay on the device, feed the next round, and come back in
        the next hop: one hop a round, and the device never waits for the host between two rounds. A turn
        whose tail was read gets its first token."""
        batch = list(plan.decode)
        now = self.clock()
        for entry in batch:
            entry.last_round_s = now
        in_flight, self._in_flight = self._in_flight, None
        rows = {id(e): i for i, e in enumerate(in_flight[0])} if in_flight is not None else {}
        carry = [rows.get(id(e), -1) if e.in_flight else -1 for e in batch]
        ahead = self.policy.launch_ahead and bool(batch) and all(e.sampler.is_on_device for e in batch)
        # the earlier round's samplers that take its ids (a grammar's matcher): those of turns still running
        takers = [e.sampler if e in self._running else None for e in in_flight[0]] if in_flight else []
        try:
            launched, tokens, ms, reads, earlier = await self.served_exec.run(
                self._round_on_thread, batch, carry, ahead, plan.reads, in_flight[1] if in_flight else None, takers)
        except Exception as exc:  # the round failed: every turn in it ends with the error
            for entry in batch + [r.key for r in plan.reads] + (in_flight[0] if in_flight else []):
                if not entry.done.done():
                    entry.out.put_nowait(exc)
                    await self._end(entry)
            return
        for entry, (read_ms, first, exc) in zip([r.key for r in plan.reads], reads):
            self.ledger.record(Role.SERVED_PREFILL, read_ms, turn_id=entry.turn.turn_id)
            if exc is not None:
                entry.out.put_nowait(exc)
                await self._end(entry)
            elif first is not None:
                await self._first_token(entry, first)
        if earlier is not None:
            await self._decoded(in_flight[0], *earlier)
        if launched is not None:
            for entry in batch:
                entry.in_flight = 1
            self._in_flight = (batch, launched)
        elif batch:
            await self._decoded(batch, tokens, ms)

    async def _decoded(self, batch: list["_Running"], tokens: list[int], ms: float) -> None:
        """A round's ids to its turns; a turn that ended since the round was launched drops its id (a stop read
        one round late: its kept state is the prompt's grid line, never the rows above)."""
        share = ms / len(batch)  # a round's device time, attributed evenly to its turns
        for entry, token in zip(batch, tokens):
            entry.in_flight = 0
            if entry not in self._running:
                self.ledger.record(Role.SERVED_DECODE, share)
                continue
            self.ledger.record(Role.SERVED_DECODE, share, turn_id=entry.turn.turn_id)
            await self._emit(entry, token)

    async def _first_token(self, entry: "_Running", token: int) -> None:
        turn = entry.turn
        turn.first_token_s = entry.last_round_s = self.clock()
        self._reading.remove(entry)
        self._running.append(entry)
        behind = [e.prompt() for e in list(self._waiting) + self._reading]
        for other in self.scheduler.rounds.overtaken(entry.prompt(), behind):
            other.overtaken += 1  # (prefill_order's starvation bound)
        await self._emit(entry, token)

    def _round_on_thread(self, batch: list["_Running"], carry: list[int], ahead: bool,
                         plan: tuple[Read, ...], earlier: LaunchedRound | None, takers: list[Sampler | None]):
        """The decode of `batch` (launched ahead, or sampled on the host and waited for), each planned read, then
        the earlier round's ids. Returns (the round launched ahead or None, the batch's ids when not ahead, their
        device ms, for each read (device ms, the first token if the tail was read, the error if it failed), the
        earlier round's (ids, device ms) or None).

        A grammar turn's next mask needs its last id on the host: where the earlier round holds one, its ids are
        read back between this round's forward and its sampling (the forward never waits for them; the matcher
        and the mask run on the host while the device runs the forward), each taker taking its row's id."""
        launched, tokens, ms = None, [], 0.0
        back: tuple[list[int], float] | None = None

        def take_earlier() -> None:
            nonlocal back
            if earlier is not None and back is None:
                back = earlier.finish()
                for sampler, token in zip(takers, back[0]):
                    if sampler is not None:
                        sampler.taken(token)

        take_first = any(s is not None and s.grammar is not None for s in takers)
        if batch:
            seqs, host_ids = [e.seq for e in batch], [0 if c >= 0 else e.token for e, c in zip(batch, carry)]
            if ahead:
                launched = self.serving.launch_round(seqs, host_ids, carry, [e.sampler for e in batch],
                                                     between=take_earlier if take_first else None)
            else:
                logits, ms = self.serving.decode_round(seqs, host_ids, carry)
                if take_first:
                    take_earlier()
                tokens = [e.sampler(logits[i]) for i, e in enumerate(batch)]
        reads = []
        for entry, chunks, tail in plan:
            seq = entry.seq
            before = seq.start.gpu_ms
            try:
                if chunks:  # the last chunk is left running: the tail, or the next round, launches behind it
                    self.serving.read_chunks(seq, chunks, hold_last=True)
                first = None
                if tail and seq.chunks_left == 0:
                    first = self._read_tail(entry)
                reads.append((seq.start.gpu_ms - before, first, None))
            except Exception as exc:
                self.serving.finish(seq)
                reads.append((seq.start.gpu_ms - before, None, exc))
        take_earlier()
        return launched, tokens, ms, reads, back

    def _read_tail(self, entry: "_Running") -> int:
        """The prompt's tail and the first token, on the served thread."""
        seq, req = entry.seq, entry.turn.req
        logits = self.serving.first_token(seq)
        try:
            token = entry.sampler(logits[-1])
        except BaseException:
            self.serving.finish(seq)
            raise
        log.info("served_turn_start", session=seq.start.session_id, request_id=req.request_id, **{
            k: v for k, v in asdict(seq.start).items() if k != "session_id"})
        return token

    async def _emit(self, entry: "_Running", token: int) -> None:
        """A sampled token: the turn's end (a stop id, or max_tokens reached after it), or the next round's input."""
        turn, req = entry.turn, entry.turn.req
        if token in req.stop_ids:
            turn.finish = "stop"
            await self._end(entry)
            return
        turn.out_ids.append(token)
        entry.out.put_nowait(token)
        if len(turn.out_ids) >= req.max_tokens:
            turn.finish = "length"
            await self._end(entry)
            return
        entry.token = token

    async def _end(self, entry: "_Running", started: bool = True) -> None:
        for queue in (self._reading, self._running):
            if entry in queue:
                queue.remove(entry)
        if started:
            if entry.seq is not None:
                held_ms = await self.served_exec.run(self.serving.finish, entry.seq)
                if held_ms:  # a chunk of its prompt it left running, read back as it ended
                    self.ledger.record(Role.SERVED_PREFILL, held_ms, turn_id=entry.turn.turn_id)
            await self._turn_end(entry.turn)
        entry.out.put_nowait(_END)
        if not entry.done.done():
            entry.done.set_result(None)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ShadowError("empty prompt: at least one token id is needed")
        vocab = self.served.cfg.vocab_size
        # min and max in C first: a prompt of 10^5 ids checked id by id holds the event loop for milliseconds
        if set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < vocab:
            return
        bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < vocab)), None)
        if bad is not None:
            raise ShadowError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def _shared_prefix(self, session_id: str | None, ids: list[int]) -> int:
        prev = self._session_prompts.get(session_id or "")
        return common_prefix(prev, ids) if prev else 0

    async def _turn_start(self, turn: _Turn) -> None:
        """The reader learns the new prompt (rolling back where it diverged); the router's question queues."""
        sid = turn.session_id
        if self.reader is None or sid is None:
            return
        prompt = list(turn.req.prompt_ids)

        def feed() -> tuple[int | None, int]:
            before = self.reader.sessions.get(sid)
            kept = common_prefix(before.ids, prompt) if before is not None and before.ids else None
            report = self.reader.feed(sid, prompt, len(prompt))
            return None if kept is None else max(0, kept - report.position), self.reader.sessions[sid].epoch

        turn.reader_behind_tokens, turn.reader_epoch = await self.reader_exec.run(feed)
        self._session_prompts[sid] = prompt
        self._note_backlog(sid)
        if turn.req.narrate is not None and self.options.narrator == "on":
            self.narrator.follow(turn.turn_id, turn.req.request_id, sid, len(prompt), turn.req.narrate)
        if self.options.router == "shadow":
            session = self.reader.sessions[sid]
            self.router.queue(sid, turn.req.prompt_ids, turn.req.request_id, turn.req.router_label,
                              session.committed, session.behind_at_turn_start)

    async def _between_rounds(self) -> None:
        """The reader's slice where the scheduler opens one: the oldest running turn's ration (its prompt first,
        then the output so far), else the busy share's (the session whose unread chunk is oldest, gathered only
        when a slice is earned); then the narrator's for the turns it follows."""
        if self.reader is None or not (self._running or self._reading):
            return
        now = self.clock()
        backlogs = self._between_turns_backlogs(now) if self.scheduler.busy_may_open() else {}
        action = self.scheduler.on(RoundEnded(now, [self._slice_view(e.turn) for e in self._running], backlogs))
        if isinstance(action, ReadPlan):
            await self._slice(action, action.key)
        for entry in list(self._running):
            if entry.turn.turn_id in self.narrator.followed and not entry.closed:
                await self._narrate(entry.turn)

    def _slice_view(self, turn: _Turn, upto: int | None = None) -> SliceView:
        """A running turn as the scheduler weighs its slice: its own session, read up to `upto` ids (None: all
        it knows)."""
        session = self.reader.sessions.get(turn.session_id)
        return SliceView(turn, turn.turn_id, turn.session_id, turn.first_token_s,
                         session.committed if session is not None else 0,
                         turn.num_known if upto is None else upto,
                         session is not None and session.is_resident)

    async def _narrate(self, turn: _Turn) -> None:
        """The narrator's slice of a turn it follows: whole chunks of the session toward the thought's end, then,
        with less than a chunk left above the thought's end, the summary on a fork (charged to the turn)."""
        followed = self.narrator.followed[turn.turn_id]
        sid = turn.session_id
        session = self.reader.sessions.get(sid)
        if followed.done or turn.first_token_s is None or session is None or not session.is_resident:
            return
        end = self.narrator.thought_end(turn.turn_id, turn.out_ids)
        if whole_chunks(session.committed, end if end is not None else turn.num_known, self.reader.grid) > 0:
            action = self.scheduler.slice(Window.NARRATOR, self.clock(), self._slice_view(turn, end))
            if isinstance(action, ReadPlan):
                await self._slice(action, turn, end)
            return
        if end is None:
            return  # the thought goes on: nothing to summarise yet
        if not self.scheduler.summary_earned(self.clock(), self._slice_view(turn, end), self.narrator.summary_est_ms):
            return  # not earned yet
        ids = self.render_question(NARRATOR_QUESTION)
        result = await self.reader_exec.run(self._summarize_at, sid, turn.ids_view(end), ids,
                                            self.narrator.max_tokens)
        self.ledger.record(Role.NARRATOR, result.gpu_ms, turn_id=turn.turn_id)
        narration = Narration(sid, turn.req.request_id, result.text, len(result.token_ids), result.position,
                              round(result.gpu_ms, 3), live=True)
        log.info("narration", session=sid, request_id=turn.req.request_id, tokens=narration.tokens,
                 position=narration.position, gpu_ms=narration.gpu_ms, live=True)
        self.narrator.delivered(turn.turn_id, narration)

    def _summarize_at(self, session_id: str, upto: TurnIds, question_ids: list[int], max_tokens: int):
        """On the reader's thread: the session learns the turn's ids up to `upto` (if it holds fewer), then the
        summary decodes on a fork above all it holds."""
        learn(self.reader, self.reader.get(session_id), upto)
        return self.reader.summarize(session_id, question_ids, max_tokens, (self.reader.engine.chat.turn_end_id,))

    async def _slice(self, action: ReadPlan, turn: _Turn | None, end: int | None = None) -> None:
        """Carry out a slice the scheduler opened between two rounds: a turn's (its session, up to `end` of its
        ids: None, all it knows; the narrator: up to the thought's end), or the busy share's (turn None: the
        session's ids as the reader holds them). Every running turn waited for it: each is charged its wall
        (the decode loss each of them saw)."""
        now = self.clock()
        sl = action.decision
        num_chunks, stop = await self._read(action.window, action.session_id,
                                            turn.turn_id if turn is not None else None, sl,
                                            known=turn.ids_view(end) if turn is not None else None)
        self.scheduler.on(ReadEnded(self.clock(), stop))
        if action.window is Window.RATION:
            wall = self.clock() - now
            for entry in self._running:
                entry.turn.ration_wall_s += wall
                entry.turn.ration_slices += 1
        role = ROLE_OF_WINDOW[action.window]
        log.info("ration_slice", window=action.window.value, session=action.session_id,
                 request_id=turn.req.request_id if turn is not None else None, chunks=num_chunks,
                 gpu_ms=sl.spent_us / 1000, budget_ms=sl.budget_us / 1000,
                 spent_turn_ms=(self.ledger.spent_us(role, turn.turn_id if turn is not None else None) or 0) / 1000)

    async def _turn_end(self, turn: _Turn) -> None:
        sid = turn.session_id
        self.narrator.unfollow(turn.turn_id)
        if self.reader is not None and sid is not None and turn.out_ids:
            await self.reader_exec.run(self.reader.feed, sid, turn.ids_view().since(0))
            self._note_backlog(sid)
        balance = self.ledger.close_turn(turn.turn_id)
        end = self.clock()
        self.scheduler.on(TurnEnded(end, turn.turn_id))
        self.turns += 1
        prefill_ms = balance.gpu_ms(Role.SERVED_PREFILL) if balance else 0.0
        decode_ms = balance.gpu_ms(Role.SERVED_DECODE) if balance else 0.0
        ration_ms = balance.gpu_ms(Role.READER_RATION) if balance else 0.0
        n_decode = max(0, len(turn.out_ids) - 1)
        record = TurnRecord(
            request_id=turn.req.request_id, session_id=sid, arrival_s=turn.arrival_s,
            first_token_s=turn.first_token_s, end_s=end, prompt_tokens=len(turn.req.prompt_ids),
            shared_prefix_tokens=turn.shared_prefix_tokens, output_tokens=len(turn.out_ids), model=self.served.name,
            prefill_ms=prefill_ms, decode_ms=decode_ms, reader_ration_ms=ration_ms, finish_reason=turn.finish,
            decode_tokens_per_s=(n_decode / (decode_ms / 1e3)) if decode_ms > 0 else 0.0,
            reader_share=(ration_ms / decode_ms) if decode_ms > 0 else 0.0,
            narrator_ms=balance.gpu_ms(Role.NARRATOR) if balance else 0.0, start_s=turn.start_s,
            reader_ration_wall_ms=turn.ration_wall_s * 1e3, reader_ration_slices=turn.ration_slices,
            reader_behind_tokens=turn.reader_behind_tokens,
            cached_tokens=turn.cached_tokens,
            cache_tier=turn.cache_tier,
        )
        log.info("turn", **asdict(record))
        if self.on_turn is not None:
            self.on_turn(record)

    # ---- reading -----------------------------------------------------------------------------
    async def _read(self, window: Window, session_id: str, turn_id: str | None, decision: IdleBurst | RationSlice,
                    known: TurnIds | None = None) -> tuple[int, Stop | None]:
        """Whole chunks of one session while `decision` allows, on the reader's thread; a router question
        is asked where the turn inserted it, then reading goes on. Returns (chunks read, why it stopped)."""
        num_chunks = 0
        while True:
            now = self.clock()
            left_us = decision.left_us(now) if isinstance(decision, IdleBurst) else decision.left_us
            outcome: ReadOutcome | None = await self.reader_exec.run(
                self.runner.run, window, session_id, turn_id, decision, budget_ms=left_us / 1000,
                prompt_tokens=len(self._session_prompts.get(session_id, ())) or None, known=known,
                question_rows=self.router.stop_rows(session_id), request_waiting=self._request_waiting)
            if outcome is None:
                self._note_backlog(session_id)
                return num_chunks, None
            num_chunks += outcome.result.num_chunks
            self._note_backlog(session_id)
            for report in outcome.reports:
                log.info("chunk", window=window.value, session=session_id, position=report.position,
                         backlog=report.backlog, gpu_ms=round(report.gpu_ms, 3), chunks=report.chunks)
            if outcome.result.stop is Stop.REFUSED:
                log.error("chunk_not_recorded", window=window.value, session=session_id,
                          gpu_ms=outcome.reports[-1].gpu_ms if outcome.reports else None)
            answered = (await self._answer_router(session_id, window, turn_id, decision)
                        if (outcome.reports or outcome.is_at_question) else 0)
            if not outcome.is_at_question or not answered:  # (a gate with nothing to answer would spin)
                return num_chunks, outcome.result.stop

    def _request_waiting(self) -> bool:
        """Asked on the reader's thread before every idle chunk: someone waits for the engine, or we stop."""
        return self._stopping or self.board.engine.has_waiter_above(Priority.IDLE_READER)

    # ---- the idle window ---------------------------------------------------------------------
    async def _idle_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), self.scheduler.idle.poll_s)
            except TimeoutError:
                pass
            if self._stopping:
                break
            try:
                await self.idle_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the reader must never take the server down
                log.error("idle_read_failed", error=repr(exc))

    def _idle_has_work(self) -> bool:
        reader, ready = self.reader, self.runner.is_ready
        if any(s.backlog >= reader.grid and ready(s.session_id) for s in reader.sessions.values()):
            return True
        return any(ready(sid) for sid in self.router.sessions_ready(self._committed))

    def _idle_backlogs(self, now: float) -> dict[str, SessionBacklog]:
        """The sessions with a whole chunk unread, as the scheduler picks the idle window's next one (a parked
        session only once its state has loaded)."""
        grid, ready = self.reader.grid, self.runner.is_ready
        return {s.session_id: SessionBacklog(self._unread_since.setdefault(s.session_id, now), s.backlog // grid,
                                             s.committed)
                for s in self.reader.sessions.values() if s.backlog >= grid and ready(s.session_id)}

    def _between_turns_backlogs(self, now: float) -> dict[str, SessionBacklog]:
        """The busy share's sessions: those with a whole chunk unread and no turn open (waiting, read or running).
        Their agents are thinking, their next turns want them read, and while other agents run the idle window
        does not open for them; a session with a turn open is its own ration's (alone on the server, the idle
        window after the turn reads it, and a short turn's decode loses nothing)."""
        open_turns = {e.turn.session_id for e in (*self._waiting, *self._reading, *self._running)}
        return {sid: b for sid, b in self._idle_backlogs(now).items() if sid not in open_turns}

    async def idle_once(self) -> int:
        """One look at the idle window: read up to idle_burst_s if nothing runs or waits. Returns chunks read."""
        if self.reader is None or self._stopping:
            return 0
        board = self.board
        busy = Busy(request_running=board.engine.locked, request_waiting=board.engine.num_waiting > 0,
                    hold_on=board.holds > 0, box_locked=board.box.locked)
        if not IdleWindow.may_open(**busy._asdict()):
            self.scheduler.on(IdlePoll(self.clock(), busy, has_work=False))
            return 0
        # a safe point on every quiet look (never inside a ration slice): the reader's spills go to the mover, the
        # host cap holds, parked sessions with a backlog start loading (the window reads them once loaded, never
        # their files)
        await self.reader_exec.run(self.runner.safe_point)
        action = self.scheduler.on(IdlePoll(self.clock(), busy, self._idle_has_work()))
        if not isinstance(action, OpenIdle):
            return 0
        held = HeldLocks()
        if not board.engine.try_acquire(Priority.IDLE_READER):  # behind every waiter: it never queues
            return 0
        held.acquire(LockRank.ENGINE)
        chunks = 0
        try:
            if not board.try_box(held):  # without waiting
                return 0
            try:
                chunks = await self._idle_burst()
            finally:
                board.release_box(held)
        finally:
            board.engine.release()
            held.release(LockRank.ENGINE)
        if chunks:
            self.idle_bursts += 1
        return chunks

    async def _idle_burst(self) -> int:
        """Ask, read, report: the router's questions the reader stands at first, then the sessions the scheduler
        picks (the oldest unread chunk first) until it closes the burst."""
        for sid in self.router.sessions_ready(self._committed):
            if self.runner.is_ready(sid):
                await self._answer_router(sid)  # the reader already stands where these were asked
        opened = self.clock()
        action = self.scheduler.on(IdleOpened(opened, self._idle_backlogs(opened)))
        burst = self.scheduler.burst
        chunks = 0
        try:
            while isinstance(action, ReadPlan):
                num, stop = await self._read(Window.IDLE, action.session_id, None, action.decision)
                chunks += num
                now = self.clock()
                action = self.scheduler.on(ReadEnded(now, stop, self._idle_backlogs(now)))
        finally:
            if self.scheduler.burst is not None:  # a read failed: the burst closes with it
                self.scheduler.on(ReadEnded(self.clock(), None))
        log.info("idle_burst", chunks=chunks, gpu_ms=burst.spent_us / 1000 if burst is not None else 0.0,
                 wall_ms=round((self.clock() - opened) * 1e3, 3))
        return chunks

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
            await _landed(load)

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

    def served_session_rows(self) -> int | None:
        """The rows one served session can hold: the whole served KV pool (other sessions' pages are made room
        for), less one page a turn may hold above its rows while it decodes."""
        pool = self.serving.book.pool
        return max(0, (pool.num_pages - 1) * pool.page_rows)

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


async def _landed(load: Future) -> None:
    """Until a load of the store's loader thread is done, whatever its outcome (the store lands it, a bad file as
    a miss). Cancelling the waiter never cancels the load (the store waits for every load it started)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_) -> None:  # on the loader's thread, or here when the load is done already
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop has closed: nobody waits
            pass

    load.add_done_callback(wake)
    await done


def served_sessions(engine: Engine, policy: Policy, residency=None) -> ServedSessions:
    """The served model's sessions as the policy sizes them (residency: the store with its host and disk
    tiers; None drops least recently fed sessions past the pool)."""
    check_group(policy.served_chunk_group, "the served chunk group (QSE_SERVED_CHUNK_GROUP)")
    book = GridSessions(engine, grid=policy.served_grid, pool_bytes=int(policy.served_kv_gb * (1 << 30)),
                        **policy.served_checkpoints(), residency=residency, chunk_group=policy.served_chunk_group,
                        graphs=None if policy.served_graphs else False, who="the served model")
    return ServedSessions(book, max_running=policy.max_running)
