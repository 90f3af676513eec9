"""The executor's loop over one plan: ask, read a chunk, account, learn; the same for runtime and replay.

The runtime runs it on the engine's executor thread with a pipe of chunks that times the device with
events, launching the next chunk while the device still works on the one before (`ReaderPlan.lookahead`);
the replay runs it on a virtual clock with a read-rate model, one chunk at a time. Same loop, same
decisions wherever a chunk's measured time equals its estimate.

`PlanDriver` holds what lasts across plans (the estimator, the ledger, the clock); `run` carries out one
plan through a `ChunkPipe` under a `ChunkDecision`. Both protocols are whole: a pipe declares what it can
do (`can_group`, `reads_at_launch`) and every decision answers every question, so the loop never probes.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any, Callable, NamedTuple, Protocol

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.ledger import GpuLedger, ms_to_us
from qse.core.plan import ReaderPlan


class ChunkDecision(Protocol):
    """A window's decision. The driver launches whatever it admits: a True from `may_read_next` is a launch
    (a decision may count on that, as the windows' probe of a chunk dearer than a whole window does)."""

    def may_read_next(self, now: float, request_waiting: bool, next_chunk_est_ms: float) -> bool: ...

    def chunks_allowed(self, chunks: int) -> int:
        """How many of the next `chunks` (> 1) one launch may read: from 1 to `chunks` (a pending question's
        row cuts a chunk group short)."""
        ...

    def note_launch(self, chunks: int) -> None:
        """A launch read `chunks` chunks (heard at the launch, before it is read back)."""
        ...

    def note_chunk(self, gpu_ms: float) -> None:
        """A launch (a chunk, or a chunk group) was read back and measured `gpu_ms`."""
        ...


class SpendDecision:
    """What the windows' decisions (IdleBurst, RationSlice) share: they count what their launches spent and
    admit a chunk whose estimate fits what is left, or the probe; they never cap a group."""

    def __init__(self) -> None:
        self.spent_us = 0
        self.num_chunks = 0  # launches read back
        self.num_admitted = 0  # chunks admitted (the driver launches each chunk a decision admits)

    def admit(self, next_chunk_est_ms: float, left_us: int, probe_over_us: int | None) -> bool:
        """Admit the next chunk if its estimate fits `left_us`, or, as the first admitted, if it is estimated
        above `probe_over_us` (the probe; None: no probe). An estimate that is not a number of ms: no."""
        est_us = ms_to_us(next_chunk_est_ms)
        if est_us is None:
            return False
        is_probe = self.num_admitted == 0 and probe_over_us is not None and est_us > probe_over_us
        if est_us <= left_us or is_probe:
            self.num_admitted += 1
            return True
        return False

    def chunks_allowed(self, chunks: int) -> int:
        return chunks

    def note_launch(self, chunks: int) -> None:
        pass

    def note_chunk(self, gpu_ms: float) -> None:
        self.spent_us += ms_to_us(gpu_ms) or 0
        self.num_chunks += 1


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
    """Chunks launched ahead of being read back: `launch(start_row, chunks)` starts at most `chunks` and at
    least one from `start_row` and returns (a handle, how many it started); `finish(handle)` waits for them
    and returns their measured ms. Handles are finished in launch order."""

    can_group: bool  # one launch may read several chunks (the reader's chunk groups); if not, `chunks` is 1
    reads_at_launch: bool  # each launch is read and measured at once: nothing is gained by running ahead

    def launch(self, start_row: int, chunks: int) -> tuple[Any, int]: ...

    def finish(self, handle: Any) -> float: ...


class ReadEach:
    """A pipe over `read_chunk(start_row) -> measured ms`: one chunk a launch, read at its launch."""

    can_group = False
    reads_at_launch = True

    def __init__(self, read_chunk: Callable[[int], float]):
        self.read_chunk = read_chunk

    def launch(self, start_row: int, chunks: int) -> tuple[float, int]:
        return self.read_chunk(start_row), 1

    def finish(self, handle: float) -> float:
        return handle


class PlanDriver:
    """Carries out plans: whole chunks while a decision allows, each accounted in `ledger` and taught to
    `estimator`. `clock()` is the host's clock; `sleep_until(t)` waits until it reads t (seconds on
    `clock`'s scale; None: never wait, the launch lead is not kept)."""

    def __init__(self, *, estimator: ChunkCostEstimator, ledger: GpuLedger, clock: Callable[[], float],
                 sleep_until: Callable[[float], None] | None = None):
        self.estimator = estimator
        self.ledger = ledger
        self.clock = clock
        self.sleep_until = sleep_until

    def run(self, plan: ReaderPlan, decision: ChunkDecision, pipe: ChunkPipe, *,
            request_waiting: Callable[[], bool]) -> DriveResult:
        """Read whole chunks of `plan` through `pipe` while `decision` allows.

        Up to `plan.lookahead` chunks run beyond the oldest one not read back (none where the pipe reads
        at launch). The decision on a new chunk then counts those in flight at their estimates (a budget
        is never overrun by what the decision could not see yet); where they leave no room, they are read
        back and the decision asked again with what they measured. Each is accounted (ledger, decision,
        estimator) as it is read back, in order. With `plan.launch_lead_ms` and `sleep_until`, the
        decision on the next chunk waits until that long before the chunk in flight is expected to end,
        so a request arriving meanwhile is seen before the next launch. Chunks launched are always read
        back and accounted, whatever stops the loop.

        Groups (`plan.group` > 1, a pipe that `can_group`): a launch may read up to that many chunks,
        admitted at the sum of their estimates, capped by the decision's `chunks_allowed` (a pending
        question's row), and read back before the next launch (a request then waits for at most one
        group). A group is one ledger record; its time teaches the estimator nothing (the estimator's
        unit is a chunk launched alone). The decision hears how many chunks each launch read (`note_launch`)."""
        estimator, ledger, clock, sleep_until = self.estimator, self.ledger, self.clock, self.sleep_until
        lookahead = 0 if pipe.reads_at_launch else plan.lookahead
        grouping = plan.group > 1 and pipe.can_group
        row = plan.start_row
        gpu_us = 0
        num_chunks = 0
        stop = Stop.BACKLOG
        refused = False
        # (start row, estimate, handle, chunks), oldest first
        in_flight: deque[tuple[int, float, Any, int]] = deque()
        settled_at = clock()  # when the device last came free of our chunks, as far as the host knows

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
                if want > 1:
                    want = max(1, min(want, decision.chunks_allowed(want)))
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
                handle, count = pipe.launch(row, want)
                if count != want:
                    est_ms = estimate(row, count)
                in_flight.append((row, est_ms, handle, count))
                decision.note_launch(count)
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
