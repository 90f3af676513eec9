"""The reader's read loop on the engine's executor thread: plan, synchronise, drive, account.

The event loop decides that a window opens (an `IdleBurst` or a `RationSlice`, from qse/core) and hands
the decision here; `ChunkRunner.run` runs on the reader's executor thread, where the session's state is
stable, and carries it out with core's `plan_read` and `drive_plan`:

    session known ids (prompt, then output so far) --plan_read--> ReaderPlan
    sync the device (ration, narrator) --drive_plan--> whole chunks while the decision allows
    each chunk: reader.read_step (measured ms) --> GpuLedger (role of the window, the turn) + estimator

A pending router question stops the plan before the chunk that would pass its position
(`QuestionGate`), so the conductor asks it exactly where the turn inserted it and then goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..core.chunk_cost import ChunkCostEstimator
from ..core.drive import ChunkDecision, DriveResult, drive_plan
from ..core.ledger import GpuLedger
from ..core.plan import ReaderPlan, Window, plan_read
from ..shadow.reader import ChunkReport, ShadowReader


class QuestionGate:
    """Wraps a window's decision: no chunk starts at a row where a pending question must be asked first."""

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

    def note_chunk(self, gpu_ms: float) -> None:
        self.row += self.grid
        self.decision.note_chunk(gpu_ms)


@dataclass
class ReadOutcome:
    plan: ReaderPlan
    result: DriveResult
    reports: list[ChunkReport] = field(default_factory=list)  # one a chunk read, in order
    is_at_question: bool = False  # stopped before the chunk that passes a pending question


class ChunkRunner:
    """Carries out one window's decision over one session. Call `run` on the reader's executor thread only."""

    def __init__(self, reader: ShadowReader, estimator: ChunkCostEstimator, ledger: GpuLedger,
                 clock: Callable[[], float]):
        self.reader = reader
        self.estimator = estimator
        self.ledger = ledger
        self.clock = clock

    def run(self, window: Window, session_id: str, turn_id: str | None, decision: ChunkDecision, *,
            budget_ms: float, prompt_tokens: int | None = None, known_ids: list[int] | None = None,
            question_rows: frozenset[int] = frozenset(),
            request_waiting: Callable[[], bool] = lambda: False) -> ReadOutcome | None:
        """Whole chunks of `session_id` while `decision` allows; None when there is no whole chunk to read.

        `known_ids`, when longer than what the session holds (the served output so far), is fed first.
        `prompt_tokens` marks where the prompt ends (prompt chunks first, then output; logs only).
        """
        reader = self.reader
        session = reader.get(session_id)
        if known_ids is not None and len(known_ids) > len(session.ids):
            held = len(session.ids)
            if known_ids[:held] == session.ids:  # the usual case: the output grew; check only what is new
                reader.append(session_id, known_ids[held:])
            else:
                reader.feed(session_id, list(known_ids))
        # a parked session comes back (perhaps at another row) before its rows are planned, not inside
        # read_step after the plan was made
        reader.ensure_resident(session)
        known = len(session.ids)
        est_ms = self.estimator.estimate_ms(session.committed)
        plan = plan_read(window, session_id=session_id, turn_id=turn_id, committed_rows=session.committed,
                         prompt_tokens=known if prompt_tokens is None else prompt_tokens, known_tokens=known,
                         grid=reader.grid, budget_ms=budget_ms, first_chunk_est_ms=est_ms)
        if plan is None:
            return None
        if plan.sync_first:
            reader.engine.synchronize()  # nothing of the reader starts beside the served model's work
        gate = QuestionGate(decision, plan.start_row, plan.grid, question_rows)
        reports: list[ChunkReport] = []

        def read_chunk(row: int) -> float:
            report = reader.read_step(session_id)
            if report is None or report.context != row:
                got = None if report is None else report.context
                raise RuntimeError(f"session {session_id!r}: planned a chunk at row {row}, the reader read {got}")
            reports.append(report)
            return report.gpu_ms

        result = drive_plan(plan, gate, estimator=self.estimator, ledger=self.ledger, read_chunk=read_chunk,
                            clock=self.clock, request_waiting=request_waiting)
        return ReadOutcome(plan, result, reports, gate.is_at_question)
