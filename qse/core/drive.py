"""The executor's loop over one plan: ask, read a chunk, account, learn; the same for runtime and replay.

The runtime runs it on the engine's executor thread with a pipe of chunks that times the device with
events, launching the next chunk while the device still works on the one before (`ReaderPlan.lookahead`);
the replay runs it on a virtual clock with a read-rate model, one chunk at a time. Same loop, same
decisions wherever a chunk's measured time equals its estimate.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any, Callable, NamedTuple, Protocol

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.ledger import GpuLedger
from qse.core.plan import ReaderPlan


class ChunkDecision(Protocol):
    """A window's decision. drive_plan launches whatever it admits: a True from `may_read_next` is a launch
    (a decision may count on that, as the windows' probe of a chunk dearer than a whole window does)."""

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


class ChunkPipe(Protocol):
    """Chunks launched ahead of being read back: `launch(start_row)` starts one and returns a handle,
    `finish(handle)` waits for it and returns its measured ms. Handles are finished in launch order.

    A pipe that can read several chunks in one launch (the reader's chunk groups) also offers
    `launch_group(start_row, chunks) -> (handle, chunks launched)`, at most `chunks` and at least one;
    drive_plan uses it where the plan allows groups (`ReaderPlan.group`)."""

    def launch(self, start_row: int) -> Any: ...

    def finish(self, handle: Any) -> float: ...


class _Sequential:
    """A pipe over `read_chunk`: each chunk is read (and measured) at launch."""

    def __init__(self, read_chunk: Callable[[int], float]):
        self.read_chunk = read_chunk

    def launch(self, start_row: int) -> float:
        return self.read_chunk(start_row)

    def finish(self, handle: float) -> float:
        return handle


def drive_plan(plan: ReaderPlan, decision: ChunkDecision, *, estimator: ChunkCostEstimator,
               ledger: GpuLedger, read_chunk: Callable[[int], float] | None = None, clock: Callable[[], float],
               request_waiting: Callable[[], bool], pipe: ChunkPipe | None = None,
               sleep_until: Callable[[float], None] | None = None) -> DriveResult:
    """Read whole chunks of `plan` while `decision` allows: `read_chunk(start_row)` reads one and returns
    its measured ms, or `pipe` launches chunks ahead of reading them back.

    With a pipe, up to `plan.lookahead` chunks run beyond the oldest one not read back. The decision on a
    new chunk then counts those in flight at their estimates (a budget is never overrun by what the
    decision could not see yet); where they leave no room, they are read back and the decision asked
    again with what they measured. Each is accounted (ledger, decision, estimator) as it is read back, in
    order. With `plan.launch_lead_ms` and `sleep_until(t)` (seconds on `clock`'s scale), the decision on
    the next chunk waits until that long before the chunk in flight is expected to end, so a request
    arriving meanwhile is seen before the next launch. Chunks launched are always read back and
    accounted, whatever stops the loop.

    Groups (`plan.group` > 1, a pipe with `launch_group`): a launch may read up to that many chunks,
    admitted at the sum of their estimates, capped by the decision's `chunks_allowed(n)` where it has one
    (a pending question's row), and read back before the next launch (a request then waits for at most one
    group). A group is one ledger record; its time teaches the estimator nothing (the estimator's unit is a
    chunk launched alone). A decision with `note_launch(chunks)` hears how many chunks each launch read."""
    if (read_chunk is None) == (pipe is None):
        raise TypeError("drive_plan takes exactly one of read_chunk and pipe")
    lookahead = plan.lookahead if pipe is not None else 0
    pipe = pipe if pipe is not None else _Sequential(read_chunk)  # type: ignore[arg-type]
    row = plan.start_row
    gpu_us = 0
    num_chunks = 0
    stop = Stop.BACKLOG
    refused = False
    # (start row, estimate, handle, chunks), oldest first
    in_flight: deque[tuple[int, float, Any, int]] = deque()
    settled_at = clock()  # when the device last came free of our chunks, as far as the host knows
    grouping = plan.group > 1 and hasattr(pipe, "launch_group")
    allowed = getattr(decision, "chunks_allowed", None)
    note_launch = getattr(decision, "note_launch", None)

    def estimate(start_row: int, chunks: int) -> float:
        return sum(estimator.estimate_ms(start_row + i * plan.grid) for i in range(chunks))

    def settle() -> None:
        nonlocal gpu_us, refused, settled_at
        start_row, est_ms, handle, chunks = in_flight.popleft()
        gpu_ms = pipe.finish(handle)
        settled_at = clock()
        recorded = ledger.record(plan.role, gpu_ms, turn_id=plan.turn_id, est_ms=est_ms)
        if recorded is None:  # the chunk counts (the state advanced); nothing more starts
            refused = True
            return
        decision.note_chunk(gpu_ms)
        if chunks == 1:
            estimator.observe(start_row, gpu_ms)
        gpu_us += recorded

    try:
        while num_chunks < plan.max_chunks:
            if refused:
                break
            want = min(plan.group, plan.max_chunks - num_chunks) if grouping else 1
            if want > 1 and allowed is not None:
                want = max(1, min(want, allowed(want)))
            est_ms = estimate(row, want)
            while True:
                ahead_ms = sum(e for _, e, _, _ in in_flight)
                if in_flight and plan.launch_lead_ms > 0 and sleep_until is not None:
                    sleep_until(settled_at + (ahead_ms - plan.launch_lead_ms) / 1000)
                waiting = plan.stop_when_waiting and request_waiting()
                if decision.may_read_next(clock(), waiting, ahead_ms + est_ms):
                    break
                if waiting or not in_flight:
                    stop = Stop.WAITING if waiting else Stop.BUDGET
                    break
                # the chunks in flight at their estimates leave no room: read them back and ask again
                # with what they measured (a pessimistic estimate, the prior's, must not shrink a slice)
                while in_flight and not refused:
                    settle()
                if refused:
                    break
                est_ms = estimate(row, want)
            if refused or stop is not Stop.BACKLOG:
                break
            launched_on_idle = not in_flight
            if want > 1:
                handle, count = pipe.launch_group(row, want)  # type: ignore[attr-defined]
                est_ms = estimate(row, count)
            else:
                handle, count = pipe.launch(row), 1
            in_flight.append((row, est_ms, handle, count))
            if note_launch is not None:
                note_launch(count)
            if launched_on_idle:
                settled_at = clock()  # the device starts it now
            num_chunks += count
            row += count * plan.grid
            keep = 0 if count > 1 else lookahead  # a group is read back before anything else is launched
            while len(in_flight) > keep and not refused:
                settle()
    finally:
        while in_flight:
            settle()
    if refused:
        stop = Stop.REFUSED
    return DriveResult(num_chunks, gpu_us, row, stop)
