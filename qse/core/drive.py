"""The executor's loop over one plan: ask, read a chunk, account, learn; the same for runtime and replay.

The runtime runs it on the engine's executor thread with a chunk reader that times the device with
events; the replay runs it on a virtual clock with a read-rate model. Same loop, same decisions.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, NamedTuple, Protocol

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.ledger import GpuLedger
from qse.core.plan import ReaderPlan


class ChunkDecision(Protocol):
    def may_read_next(self, now: float, request_waiting: bool, next_chunk_est_ms: float) -> bool: ...

    def note_chunk(self, gpu_ms: float) -> None: ...


class Stop(str, Enum):
    BACKLOG = "backlog"  # every whole chunk of the plan was read
    WAITING = "waiting"  # a request waits (idle window)
    BUDGET = "budget"  # the next chunk's estimate does not fit what is left
    REFUSED = "refused"  # the ledger refused the chunk's measurement (bad value): the chunk counts, the loop stops


class DriveResult(NamedTuple):
    num_chunks: int
    gpu_us: int  # measured, as the ledger recorded it
    end_row: int  # the committed row after the last chunk
    stop: Stop


def drive_plan(plan: ReaderPlan, decision: ChunkDecision, *, estimator: ChunkCostEstimator,
               ledger: GpuLedger, read_chunk: Callable[[int], float], clock: Callable[[], float],
               request_waiting: Callable[[], bool]) -> DriveResult:
    """Read whole chunks of `plan` while `decision` allows; `read_chunk(start_row)` returns measured ms."""
    row = plan.start_row
    gpu_us = 0
    num_chunks = 0
    stop = Stop.BACKLOG
    for _ in range(plan.max_chunks):
        est_ms = estimator.estimate_ms(row)
        waiting = plan.stop_when_waiting and request_waiting()
        if not decision.may_read_next(clock(), waiting, est_ms):
            stop = Stop.WAITING if waiting else Stop.BUDGET
            break
        gpu_ms = read_chunk(row)
        recorded = ledger.record(plan.role, gpu_ms, turn_id=plan.turn_id, est_ms=est_ms)
        num_chunks += 1  # the state advanced whatever the ledger says
        row += plan.grid
        if recorded is None:
            stop = Stop.REFUSED
            break
        decision.note_chunk(gpu_ms)
        estimator.observe(row - plan.grid, gpu_ms)
        gpu_us += recorded
    return DriveResult(num_chunks, gpu_us, row, stop)
