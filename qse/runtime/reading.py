"""The reader's read loop on the engine's executor thread: plan, synchronise, drive, account.

The event loop decides that a window opens (an `IdleBurst` or a `RationSlice`, from qse/core) and hands
the decision here; `ChunkRunner.run` runs on the reader's executor thread, where the session's state is
stable, and carries it out with core's `plan_read` and `PlanDriver`:

    session known ids (prompt, then output so far) --plan_read--> ReaderPlan
    sync the device (ration, narrator) --PlanDriver.run--> whole chunks while the decision allows
    each chunk: reader.launch_step, then reader.finish_step (measured ms) --> GpuLedger (role of the
    window, the turn) + estimator; `lookahead` chunks are launched ahead of the one read back, so the
    device never waits for the host's launch (in the idle window, only `launch_lead_ms` before the chunk
    in flight is expected to end: an arriving request still waits for at most one chunk). With an idle
    group (QSE_SHADOW_IDLE_GROUP > 1) an idle launch may read several chunks as one chunk group, read back
    before the next launch (a request then waits for at most one group)

A pending router question stops the plan before the chunk that would pass its position
(`QuestionGate`), so the conductor asks it exactly where the turn inserted it and then goes on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..core.chunk_cost import ChunkCostEstimator
from ..core.drive import ChunkDecision, DriveResult, PlanDriver
from ..core.ledger import GpuLedger
from ..core.plan import ReaderPlan, Window, check_group, check_lookahead, plan_read
from ..sessions.grid import PendingChunk
from ..sessions.session import GridSession
from ..shadow.reader import ChunkReport, ShadowReader


@dataclass(frozen=True)
class TurnIds:
    """What a running turn knows, as a reader slice may learn it: the prompt it fed the reader's session
    (which then stood at `epoch`), then its output so far, up to `end`. A slice takes what is new from here
    rather than the whole session's list built and compared again (an agent's 100k ids, every slice)."""

    prompt: Sequence[int]
    out: tuple[int, ...]  # a copy: the event loop goes on appending to the turn's own list
    epoch: int | None = None  # the reader session's epoch right after the turn's feed (None: not known)
    end: int | None = None  # None: all of them (the narrator: up to a thought's end)

    def __len__(self) -> int:
        known = len(self.prompt) + len(self.out)
        return known if self.end is None else min(self.end, known)

    def since(self, start: int) -> list[int]:
        """The ids from `start` to the end."""
        end, p = len(self), len(self.prompt)
        if start >= p:
            return list(self.out[start - p:end - p])
        return list(self.prompt[start:min(end, p)]) + list(self.out[:max(0, end - p)])


def learn(reader: ShadowReader, session: GridSession, known: TurnIds) -> None:
    """The reader's session learns what the turn knows beyond what it holds. While the session stands at the
    epoch the turn fed its prompt at, it holds that prompt and a prefix of the turn's output (one turn a session
    at a time, and only appends since): only the new ids are handed over. Otherwise the lists are compared, and
    a session that holds something else is fed the turn's ids (rolling back where they differ)."""
    held = len(session.ids)
    if len(known) <= held:
        return
    if known.epoch is not None and known.epoch == session.epoch and held >= len(known.prompt):
        reader.append(session.session_id, known.since(held))
        return
    ids = known.since(0)
    if ids[:held] == session.ids:
        reader.append(session.session_id, ids[held:])
    else:
        reader.feed(session.session_id, ids)


class QuestionGate:
    """Wraps a window's decision: no chunk starts at a row where a pending question must be asked first
    (a chunk group is cut short before one)."""

    def __init__(self, decision: ChunkDecision, start_row: int, grid: int, question_rows: frozenset[int]):
        self.decision = decision
        self.row = start_row
        self.grid = grid
        self.question_rows = question_rows
        self.is_at_question = False

    def may_read_next(self, now: float, request_waiting: bool, next_chunk_est_ms: float) -> bool:
        if self.row in self.question_rows:
            self.is_at_question = True
            return False
        return self.decision.may_read_next(now, request_waiting, next_chunk_est_ms)

    def chunks_allowed(self, chunks: int) -> int:
        """How many of the next `chunks` one launch may read: none of them may start at a question's row
        (and no more than the decision allows)."""
        chunks = self.decision.chunks_allowed(chunks)
        for i in range(1, chunks):
            if self.row + i * self.grid in self.question_rows:
                return i
        return chunks

    def note_launch(self, chunks: int) -> None:
        """The driver launched `chunks` chunks from the gate's row: the row follows the launches (with
        lookahead they run ahead of the chunks read back and noted)."""
        self.row += chunks * self.grid
        self.decision.note_launch(chunks)

    def note_chunk(self, gpu_ms: float) -> None:
        self.decision.note_chunk(gpu_ms)


@dataclass
class HostTimes:
    """Where one read's host time went, on the reader's thread (perf_counter s): its entry, its first launch,
    its last chunk read back, its exit. Between the first launch and the last readback the device works (less
    the gaps the host leaves); before and after it does not: a read's fixed cost, paid at every session switch."""

    entered: float
    first_launch: float | None = None
    last_finish: float | None = None
    left: float | None = None

    def ms(self) -> dict[str, float]:
        """setup (entry to first launch), chunks (first launch to last readback), drain (last readback to exit)."""
        left = self.left if self.left is not None else self.entered
        first = self.first_launch if self.first_launch is not None else left
        last = self.last_finish if self.last_finish is not None else first
        return {"setup_ms": round((first - self.entered) * 1e3, 3), "chunks_ms": round((last - first) * 1e3, 3),
                "drain_ms": round((left - last) * 1e3, 3)}


@dataclass
class ReadOutcome:
    plan: ReaderPlan
    result: DriveResult
    reports: list[ChunkReport] = field(default_factory=list)  # one a chunk read, in order
    is_at_question: bool = False  # stopped before the chunk that passes a pending question
    host: HostTimes | None = None


class ChunkRunner:
    """Carries out one window's decision over one session. Call `run` on the reader's executor thread only."""

    def __init__(self, reader: ShadowReader, estimator: ChunkCostEstimator, ledger: GpuLedger,
                 clock: Callable[[], float], lookahead: int = 1, launch_lead_ms: float = 1.0,
                 sleep_until: Callable[[float], None] | None = None, idle_group: int = 1,
                 may_share: Callable[[str, str], bool] | None = None):
        """sleep_until(t): wait until `clock()` reaches t (default: time.sleep against `clock`). idle_group:
        chunks one launch may read in the idle window (ReaderPlan.group). may_share(a, b): whether a session
        with nothing read may start from session b's state (GridSessions.start_from_donor, QSE_SHARE_HEADS);
        None: never."""
        check_lookahead(lookahead, launch_lead_ms, "the reader's lookahead (QSE_SHADOW_LOOKAHEAD)",
                        "the launch lead (QSE_SHADOW_LAUNCH_LEAD_MS)")
        check_group(idle_group, "the idle window's chunk group (QSE_SHADOW_IDLE_GROUP)")
        self.idle_group = idle_group
        self.reader = reader
        self.estimator = estimator
        self.ledger = ledger
        self.clock = clock
        self.lookahead = lookahead
        self.launch_lead_ms = launch_lead_ms
        self.sleep_until = sleep_until or self._sleep_until
        self.driver = PlanDriver(estimator=estimator, ledger=ledger, clock=clock, sleep_until=self.sleep_until)
        self.may_share = may_share

    def safe_point(self) -> list[Future]:
        """Before an idle window, on the reader's thread (never inside a ration slice): the reader's moves land,
        and each session with a whole chunk waiting whose state is only in a file starts loading beside the work.
        The window reads such a session once its load has landed (`is_ready`), never the file on this thread.
        Returns the loads in flight."""
        reader = self.reader
        reader.safe_point()
        loads = [reader.residency.prefetch(reader, s.session_id) for s in reader.sessions_with_backlog()
                 if not reader.residency.ready(s.session_id)]
        return [f for f in loads if f is not None]

    def is_ready(self, session_id: str) -> bool:
        """Whether reading the session reads no file on this thread (any thread may ask)."""
        return self.reader.residency.ready(session_id)

    def _sleep_until(self, t: float) -> None:
        left = t - self.clock()
        if left > 0:
            time.sleep(left)

    def run(self, window: Window, session_id: str, turn_id: str | None, decision: ChunkDecision, *,
            budget_ms: float, prompt_tokens: int | None = None, known: TurnIds | None = None,
            question_rows: frozenset[int] = frozenset(),
            request_waiting: Callable[[], bool] = lambda: False) -> ReadOutcome | None:
        """Whole chunks of `session_id` while `decision` allows; None when there is no whole chunk to read.

        `known`: a running turn's ids; what the session does not hold yet (the served output so far) is learnt
        first (`learn`). `prompt_tokens` marks where the prompt ends (prompt chunks first, then output; logs only).
        """
        host = HostTimes(time.perf_counter())
        reader = self.reader
        session = reader.get(session_id)
        if known is not None:
            learn(reader, session, known)
        if session.is_too_long:  # nothing of it is readable: not brought back, not planned
            return None
        # a parked session comes back (perhaps at another row) before its rows are planned, not inside
        # read_step after the plan was made
        reader.ensure_resident(session)
        if self.may_share is not None and session.committed == 0:  # another agent's head, where one begins so
            reader.start_from_donor(session, session.readable_end, self.may_share)
        known = len(session.ids)
        est_ms = self.estimator.estimate_ms(session.committed)
        plan = plan_read(window, session_id=session_id, turn_id=turn_id, committed_rows=session.committed,
                         prompt_tokens=known if prompt_tokens is None else prompt_tokens, known_tokens=known,
                         grid=reader.grid, budget_ms=budget_ms, first_chunk_est_ms=est_ms,
                         lookahead=self.lookahead, launch_lead_ms=self.launch_lead_ms, group=self.idle_group)
        if plan is None:
            return None
        if plan.sync_first:
            reader.engine.synchronize()  # nothing of the reader starts beside the served model's work
        gate = QuestionGate(decision, plan.start_row, plan.grid, question_rows)
        reports: list[ChunkReport] = []

        result = self.driver.run(plan, gate, _SessionPipe(reader, session_id, reports, host),
                                 request_waiting=request_waiting)
        host.left = time.perf_counter()
        return ReadOutcome(plan, result, reports, gate.is_at_question, host)


class _SessionPipe:
    """The driver's chunks of one session: launched by the reader (chunk groups too), read back in order into
    `reports`."""

    can_group = True
    reads_at_launch = False

    def __init__(self, reader: ShadowReader, session_id: str, reports: list[ChunkReport],
                 host: HostTimes | None = None):
        self.reader = reader
        self.session_id = session_id
        self.reports = reports
        self.host = host

    def launch(self, row: int, chunks: int) -> tuple[PendingChunk, int]:
        """Up to `chunks` chunks from `row` in one launch (the reader's chunk group); (handle, chunks read)."""
        if self.host is not None and self.host.first_launch is None:
            self.host.first_launch = time.perf_counter()
        pending = self.reader.launch_step(self.session_id, chunks)
        if pending is None or pending.start != row:
            got = None if pending is None else pending.start
            if pending is not None:
                self.reader.finish_step(pending)  # launched: it must be read back before anything else
            raise RuntimeError(f"session {self.session_id!r}: planned a chunk at row {row}, the reader read {got}")
        return pending, pending.chunks

    def finish(self, pending: PendingChunk) -> float:
        report = self.reader.finish_step(pending)
        self.reports.append(report)
        if self.host is not None:
            self.host.last_finish = time.perf_counter()
        return report.gpu_ms
