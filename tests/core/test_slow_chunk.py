"""The reader never stalls: one slow chunk (read under load) must not shut a window at its context for good.

The estimator remembers a context's last measured chunk and nothing else measures that context again, so a
chunk estimated above a whole window is read alone as the first chunk of a whole window (the probe): its
measurement replaces the estimate. Scripted clocks, exact decisions and ledger balances.
"""

import pytest

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, ReadEach, Stop
from qse.core.idle import IdleWindow
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import Window, plan_read
from qse.core.ration import TurnRation

GRID = 512
CHUNK_MS = 44.544


class ScriptedReader:
    """A clock and a reader whose chunks cost what `costs_ms` says, in order (then CHUNK_MS). It is also a
    pipe that launches ahead: a launch costs nothing on the host, reading back moves the clock."""

    can_group = False
    reads_at_launch = False

    def __init__(self, t: float, costs_ms=()):
        self.t = t
        self.costs_ms = list(costs_ms)
        self.log: list[tuple[str, int]] = []

    def clock(self) -> float:
        return self.t

    def _cost(self) -> float:
        return self.costs_ms.pop(0) if self.costs_ms else CHUNK_MS

    def read_chunk(self, row: int) -> float:
        return self.finish(self.launch(row, 1)[0])

    def launch(self, row: int, chunks: int):
        self.log.append(("launch", row))
        return (row, self._cost()), 1

    def finish(self, handle) -> float:
        row, ms = handle
        self.t += ms / 1000
        self.log.append(("finish", row))
        return ms


def _plan(window, committed, chunks, budget_ms, est_ms, turn_id=None, lookahead=0):
    known = committed + chunks * GRID
    return plan_read(window, session_id="s", turn_id=turn_id, committed_rows=committed, prompt_tokens=known,
                     known_tokens=known, grid=GRID, budget_ms=budget_ms, first_chunk_est_ms=est_ms,
                     lookahead=lookahead)


def _idle_burst(reader, estimator, ledger, committed, chunks=100):
    burst = IdleWindow(0.2, 2.0).open(reader.clock())
    plan = _plan(Window.IDLE, committed, chunks, 2000.0, estimator.estimate_ms(committed))
    return PlanDriver(estimator=estimator, ledger=ledger, clock=reader.clock).run(
        plan, burst, ReadEach(reader.read_chunk), request_waiting=lambda: False)


def test_one_slow_chunk_does_not_shut_the_idle_window():
    estimator = ChunkCostEstimator(CHUNK_MS)
    ledger = GpuLedger()
    reader = ScriptedReader(10.0, costs_ms=[2500.0])  # the first chunk is read while the host is loaded
    first = _idle_burst(reader, estimator, ledger, 0)
    assert (first.num_chunks, first.stop) == (1, Stop.BUDGET)
    assert estimator.estimate_ms(GRID) == 2500.0  # the next chunk's estimate is larger than a whole burst

    reader.t = IdleWindow(0.2, 2.0).next_poll_s(reader.t)
    second = _idle_burst(reader, estimator, ledger, first.end_row)
    # the probe reads the next chunk at its 2.5 s estimate, measures 44.544 ms, and the burst goes on as
    # usual: 44 chunks make 1959.936 ms, the 45th would end past 2 s
    assert (second.num_chunks, second.end_row, second.stop) == (44, 45 * GRID, Stop.BUDGET)
    assert estimator.estimate_ms(second.end_row) == CHUNK_MS
    assert ledger.spent_us(Role.READER_IDLE) == 2_500_000 + 44 * 44_544


def test_a_probe_is_never_read_while_a_request_waits():
    estimator = ChunkCostEstimator(CHUNK_MS)
    estimator.observe(0, 2500.0)
    reader = ScriptedReader(10.0)
    burst = IdleWindow(0.2, 2.0).open(10.0)
    res = PlanDriver(estimator=estimator, ledger=GpuLedger(), clock=reader.clock).run(
        _plan(Window.IDLE, 0, 10, 2000.0, 2500.0), burst, ReadEach(reader.read_chunk), request_waiting=lambda: True)
    assert (res.num_chunks, res.stop) == (0, Stop.WAITING) and reader.log == []


@pytest.mark.parametrize("lookahead", [0, 1], ids=["one-at-a-time", "launch-ahead"])
def test_one_slow_chunk_does_not_shut_the_ration(lookahead):
    """The reader measured 400 ms at this context (over a 150 ms slice). The ration waits for a whole
    slice, reads the next chunk alone, learns it costs 44.544 ms, and fills the slice as usual."""
    ration = TurnRation(0.02, 150.0)
    estimator = ChunkCostEstimator(CHUNK_MS)
    estimator.observe(0, 400.0)
    first_token_s = 10.0
    est = estimator.estimate_ms(0)
    assert ration.open_slice(17.5 - 1e-6, first_token_s, 0, est) is None  # 149.99998 ms earned
    assert ration.earliest_s(first_token_s, 0, est) == 17.5  # a whole slice earned
    reader = ScriptedReader(17.5)
    sl = ration.open_slice(reader.clock(), first_token_s, 0, est)
    assert sl.budget_us == 150_000
    ledger = GpuLedger()
    ledger.open_turn("t")
    res = PlanDriver(estimator=estimator, ledger=ledger, clock=reader.clock).run(
        _plan(Window.RATION, 0, 10, 150.0, est, "t", lookahead), sl,
        reader if lookahead else ReadEach(reader.read_chunk), request_waiting=lambda: False)
    # the probe, then two more at their measured cost: 133.632 ms; a fourth would make 178.176
    assert (res.num_chunks, res.stop) == (3, Stop.BUDGET)
    assert ledger.spent_us(Role.READER_RATION, "t") == 3 * 44_544
    # launched ahead, the second chunk still waited for the probe's measurement (never two probes at once)
    assert reader.log[:3] == [("launch", 0), ("finish", 0), ("launch", GRID)]


def test_a_chunk_that_really_is_dear_is_read_now_and_then_and_the_overrun_paid_back():
    """Every chunk costs 400 ms: one a whole slice, and the next slice waits until the share has earned the
    400 ms spent and a whole slice more."""
    ration = TurnRation(0.02, 150.0)
    estimator = ChunkCostEstimator(400.0)
    ledger = GpuLedger()
    ledger.open_turn("t")
    first_token_s = 10.0
    reader = ScriptedReader(0.0, costs_ms=[400.0] * 10)
    row = 0
    opened = []
    for _ in range(3):
        spent_us = ledger.spent_us(Role.READER_RATION, "t")
        est = estimator.estimate_ms(row)
        when = ration.earliest_s(first_token_s, spent_us, est)
        assert ration.open_slice(when - 1e-6, first_token_s, spent_us, est) is None
        reader.t = when
        sl = ration.open_slice(when, first_token_s, spent_us, est)
        res = PlanDriver(estimator=estimator, ledger=ledger, clock=reader.clock).run(
            _plan(Window.RATION, row, 10, 150.0, est, "t"), sl, ReadEach(reader.read_chunk),
            request_waiting=lambda: False)
        assert (res.num_chunks, res.gpu_us, res.stop) == (1, 400_000, Stop.BUDGET)
        opened.append(when)
        row = res.end_row
    # each slice opens when the share has earned what was spent and a whole slice more: (spent + 150 ms) / 2 %
    assert opened == [first_token_s + 7.5, first_token_s + 27.5, first_token_s + 47.5]
    assert ledger.spent_us(Role.READER_RATION, "t") == 1_200_000


def test_a_slice_that_is_not_whole_never_probes():
    """A slice opened on less than a whole slice (the share had earned less) reads only what fits it."""
    ration = TurnRation(0.02, 150.0)
    sl = ration.open_slice(12.0, 10.0, 0, 30.0)  # 40 ms earned
    assert sl.budget_us == 40_000
    assert not sl.may_read_next(12.0, False, 400.0)
