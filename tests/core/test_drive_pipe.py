"""PlanDriver with chunks launched ahead of being read back (ReaderPlan.lookahead), on a virtual device:
the host launches, the device runs the launches in order, and reading one back waits for it."""

import math

import pytest

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, ReadEach, Stop
from qse.core.idle import IdleWindow
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import Window, plan_read
from qse.core.ration import RationSlice

GRID = 512
CHUNK_MS = 5.0
HOST_MS = 0.4  # the host's launch of one chunk (what the device waited for between chunks, one at a time)


class VirtualDevice:
    """A host clock and a device timeline; also the ChunkPipe the driver launches on (one chunk a launch)."""

    can_group = False
    reads_at_launch = False

    def __init__(self, t: float, chunk_ms=lambda row: CHUNK_MS, host_ms: float = HOST_MS):
        self.t = t
        self.free_at = t  # when the device has run every chunk launched so far
        self.chunk_ms = chunk_ms
        self.host_ms = host_ms
        self.log: list[tuple[str, int]] = []
        self.busy_ms = 0.0

    def clock(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def launch(self, row: int, chunks: int):
        self.t += self.host_ms / 1000
        ms = self.chunk_ms(row)
        end = max(self.t, self.free_at) + ms / 1000
        self.free_at = end
        self.busy_ms += ms
        self.log.append(("launch", row))
        return (row, end, ms), 1

    def finish(self, handle) -> float:
        row, end, ms = handle
        self.t = max(self.t, end)
        self.log.append(("finish", row))
        return ms

    def read_chunk(self, row: int) -> float:  # one at a time: launch and wait
        return self.finish(self.launch(row, 1)[0])


def _plan(window, chunks, lookahead, lead_ms=0.0, est_ms=CHUNK_MS, budget_ms=1e6):
    return plan_read(window, session_id="s", turn_id=None, committed_rows=0, prompt_tokens=chunks * GRID,
                     known_tokens=chunks * GRID, grid=GRID, budget_ms=budget_ms, first_chunk_est_ms=est_ms,
                     lookahead=lookahead, launch_lead_ms=lead_ms)


def _drive(plan, decision, dev, prior_ms=CHUNK_MS, pipe=True, waiting=lambda: False):
    ledger = GpuLedger()
    driver = PlanDriver(estimator=ChunkCostEstimator(prior_ms), ledger=ledger, clock=dev.clock,
                        sleep_until=dev.sleep_until if pipe else None)
    res = driver.run(plan, decision, dev if pipe else ReadEach(dev.read_chunk), request_waiting=waiting)
    return res, ledger


def test_the_next_chunk_is_launched_before_the_one_before_is_read_back():
    dev = VirtualDevice(10.0)
    res, ledger = _drive(_plan(Window.RATION, 4, lookahead=1), RationSlice(10.0, 10**9), dev)
    rows = [i * GRID for i in range(4)]
    assert dev.log == [("launch", rows[0]), ("launch", rows[1]), ("finish", rows[0]), ("launch", rows[2]),
                       ("finish", rows[1]), ("launch", rows[3]), ("finish", rows[2]), ("finish", rows[3])]
    assert (res.num_chunks, res.end_row, res.stop) == (4, 4 * GRID, Stop.BACKLOG)
    assert ledger.spent_us(Role.READER_RATION) == res.gpu_us == 4 * 5000
    # the device never waited for the host after the first launch: 4 chunks and one launch of wall time
    assert (dev.t - 10.0) * 1000 == pytest.approx(HOST_MS + 4 * CHUNK_MS)
    one = VirtualDevice(10.0)
    seq, _ = _drive(_plan(Window.RATION, 4, lookahead=1), RationSlice(10.0, 10**9), one, pipe=False)
    assert seq == res
    assert (one.t - 10.0) * 1000 == pytest.approx(4 * (HOST_MS + CHUNK_MS))


def test_a_pessimistic_estimate_reads_back_and_reads_as_much_as_one_at_a_time():
    """The prior says 20 ms, a chunk costs 10, the slice holds 20: launched ahead at 20 + 20 the second
    chunk would not fit; read back first (10 spent), it does, as it does one at a time."""
    results = []
    for pipe in (True, False):
        dev = VirtualDevice(0.0, chunk_ms=lambda row: 10.0)
        res, ledger = _drive(_plan(Window.RATION, 5, lookahead=1, est_ms=20.0), RationSlice(0.0, 20_000), dev,
                             prior_ms=20.0, pipe=pipe)
        results.append((res, ledger.spent_us(Role.READER_RATION), dev.log))
    assert results[0][:2] == results[1][:2]
    assert results[0][0].num_chunks == 2 and results[0][0].stop is Stop.BUDGET
    assert results[0][2] == [("launch", 0), ("finish", 0), ("launch", GRID), ("finish", GRID)]


def test_chunks_in_flight_count_against_the_budget_at_their_estimates():
    """With exact estimates a slice of 3.5 chunks reads 3, never launching a fourth on a budget the
    three in flight would spend."""
    dev = VirtualDevice(0.0)
    slice_ = RationSlice(0.0, int(3.5 * CHUNK_MS * 1000))
    res, ledger = _drive(_plan(Window.RATION, 8, lookahead=2), slice_, dev)
    assert (res.num_chunks, res.stop) == (3, Stop.BUDGET)
    assert ledger.spent_us(Role.READER_RATION) == 3 * 5000 <= slice_.budget_us
    assert dev.log.count(("launch", 3 * GRID)) == 0


@pytest.mark.parametrize("arrival_ms", [0.3, 2.0, 4.2, 4.9, 5.0, 7.7, 9.35, 9.99, 12.5, 40.1])
def test_idle_launch_lead_keeps_an_arriving_request_within_one_chunk(arrival_ms):
    """Idle window, lead 1 ms: the next chunk goes 1 ms before the one in flight should end, after asking
    whether a request waits. A request waits for at most one chunk plus the lead and a launch, and with
    no request the device runs the chunks back to back."""
    lead = 1.0
    dev = VirtualDevice(100.0)
    arrival = 100.0 + arrival_ms / 1000
    burst = IdleWindow(0.2, 2.0).open(100.0)
    res, _ = _drive(_plan(Window.IDLE, 50, lookahead=1, lead_ms=lead), burst, dev,
                    waiting=lambda: dev.t >= arrival)
    assert res.stop is Stop.WAITING
    served_starts = max(arrival, dev.t, dev.free_at)
    assert (served_starts - arrival) * 1000 <= CHUNK_MS + lead + HOST_MS + 1e-9
    assert dev.log[-1][0] == "finish" and dev.log.count(("launch", 0)) == 1
    # every chunk launched ran back to back: the device's busy time is the wall time less the first launch
    assert (dev.free_at - 100.0) * 1000 == pytest.approx(HOST_MS + dev.busy_ms)


def test_idle_without_a_lead_would_let_a_request_wait_two_chunks():
    """What the lead prevents: launched as soon as allowed, a request arriving just after a launch waits
    for the chunk running and the one queued behind it."""
    dev = VirtualDevice(100.0)
    arrival = 100.0 + 0.5 / 1000  # just after the second launch
    burst = IdleWindow(0.2, 2.0).open(100.0)
    _drive(_plan(Window.IDLE, 50, lookahead=1, lead_ms=0.0), burst, dev, waiting=lambda: dev.t >= arrival)
    assert (dev.free_at - arrival) * 1000 > 1.5 * CHUNK_MS


def test_a_refused_measurement_stops_the_loop_and_every_launched_chunk_is_read_back():
    dev = VirtualDevice(0.0, chunk_ms=lambda row: math.nan if row == GRID else CHUNK_MS)
    res, ledger = _drive(_plan(Window.RATION, 6, lookahead=1), RationSlice(0.0, 10**9), dev)
    assert res.stop is Stop.REFUSED
    launched = [r for kind, r in dev.log if kind == "launch"]
    assert launched == [r for kind, r in dev.log if kind == "finish"] == [0, GRID, 2 * GRID]
    assert res.num_chunks == 3 and res.end_row == 3 * GRID  # the state advanced by every launch
    assert ledger.spent_us(Role.READER_RATION) == res.gpu_us == 2 * 5000  # the NaN chunk is not charged


def test_a_failed_launch_reads_back_the_chunk_in_flight_before_the_error_propagates():
    dev = VirtualDevice(0.0)
    launch = dev.launch

    def failing(row, chunks):
        if row == 2 * GRID:
            raise MemoryError("no room")
        return launch(row, chunks)

    dev.launch = failing
    with pytest.raises(MemoryError, match="no room"):
        _drive(_plan(Window.RATION, 6, lookahead=1), RationSlice(0.0, 10**9), dev)
    assert dev.log == [("launch", 0), ("launch", GRID), ("finish", 0), ("finish", GRID)]


def test_a_pipe_that_reads_at_launch_runs_nothing_ahead():
    """The pipe declares it measures each launch at once: the plan's lookahead is not used, every chunk is read
    back before the next launch (the decisions see measurements, not estimates)."""
    dev = VirtualDevice(0.0)
    dev.reads_at_launch = True
    res, _ = _drive(_plan(Window.RATION, 3, lookahead=2), RationSlice(0.0, 10**9), dev)
    assert dev.log == [("launch", 0), ("finish", 0), ("launch", GRID), ("finish", GRID), ("launch", 2 * GRID),
                       ("finish", 2 * GRID)]
    assert (res.num_chunks, res.stop) == (3, Stop.BACKLOG)


@pytest.mark.parametrize("kw,match", [(dict(lookahead=-1), "lookahead must be a whole number of chunks >= 0, got -1"),
                                      (dict(lookahead=1.5), "got 1.5"),
                                      (dict(launch_lead_ms=-0.5), "launch lead must be a finite number of ms >= 0, got -0.5"),
                                      (dict(launch_lead_ms=math.inf), "got inf")])
def test_a_bad_lookahead_or_lead_is_a_value_error_naming_it(kw, match):
    args = dict(session_id="s", turn_id=None, committed_rows=0, prompt_tokens=GRID, known_tokens=GRID, grid=GRID,
                budget_ms=10.0, first_chunk_est_ms=1.0)
    with pytest.raises(ValueError, match=match):
        plan_read(Window.IDLE, **args, **kw)


def test_the_lead_is_only_for_windows_that_ask_whether_a_request_waits():
    assert _plan(Window.IDLE, 2, lookahead=1, lead_ms=1.0).launch_lead_ms == 1.0
    assert _plan(Window.RATION, 2, lookahead=1, lead_ms=1.0).launch_lead_ms == 0.0


# ---- chunk groups (ReaderPlan.group, a pipe that can group) ----------------------------------------------
GROUP_SHARE = 0.85  # a chunk's device time inside a group, against alone


class GroupDevice(VirtualDevice):
    """The virtual device with the reader's chunk groups: a launch reads the largest power of two of chunks
    up to what was asked, each at GROUP_SHARE of its time alone."""

    can_group = True

    def launch(self, row: int, chunks: int):
        if chunks == 1:
            return super().launch(row, 1)
        count = 1 << (chunks.bit_length() - 1)
        self.t += self.host_ms / 1000
        ms = sum(self.chunk_ms(row + i * GRID) for i in range(count)) * (GROUP_SHARE if count > 1 else 1.0)
        end = max(self.t, self.free_at) + ms / 1000
        self.free_at = end
        self.busy_ms += ms
        self.log.append(("group", row, count))
        return (row, end, ms), count


def _group_plan(window, chunks, group, lookahead=1):
    return plan_read(window, session_id="s", turn_id=None, committed_rows=0, prompt_tokens=chunks * GRID,
                     known_tokens=chunks * GRID, grid=GRID, budget_ms=1e6, first_chunk_est_ms=CHUNK_MS,
                     lookahead=lookahead, launch_lead_ms=1.0, group=group)


def test_an_idle_plan_reads_in_groups_each_read_back_before_the_next():
    """10 chunks in groups of up to 4: launches of 4, 4 and 2, each finished before the next launch; one ledger
    record a launch; every chunk counted; the estimator learns nothing from a group."""
    dev = GroupDevice(10.0)
    estimator = ChunkCostEstimator(CHUNK_MS)
    ledger = GpuLedger()
    driver = PlanDriver(estimator=estimator, ledger=ledger, clock=dev.clock, sleep_until=dev.sleep_until)
    res = driver.run(_group_plan(Window.IDLE, 10, 4), IdleWindow(0.2, 60.0).open(10.0), dev,
                     request_waiting=lambda: False)
    assert [e for e in dev.log if e[0] == "group"] == [("group", 0, 4), ("group", 4 * GRID, 4), ("group", 8 * GRID, 2)]
    assert [e[0] for e in dev.log] == ["group", "finish", "group", "finish", "group", "finish"]
    assert (res.num_chunks, res.end_row, res.stop) == (10, 10 * GRID, Stop.BACKLOG)
    assert ledger.spent_us(Role.READER_IDLE) == res.gpu_us == round(10 * CHUNK_MS * GROUP_SHARE * 1000)
    assert estimator.num_buckets == 0  # no bucket holds a measurement


def test_a_request_arriving_mid_read_waits_for_one_group_at_most():
    dev = GroupDevice(10.0)
    waiting = lambda: len([e for e in dev.log if e[0] == "group"]) >= 1  # noqa: E731 - arrives during the first
    res, _ = _drive(_group_plan(Window.IDLE, 10, 4), IdleWindow(0.2, 60.0).open(10.0), dev, waiting=waiting)
    assert [e for e in dev.log if e[0] == "group"] == [("group", 0, 4)]
    assert dev.log[-1] == ("finish", 0)  # read back before the loop stopped
    assert (res.num_chunks, res.stop) == (4, Stop.WAITING)


def test_groups_only_where_the_plan_and_the_pipe_allow_them():
    """A ration slice plans one chunk a launch whatever was asked; a pipe that cannot group reads one
    chunk a launch under an idle plan of groups; a bad group size is named."""
    assert _group_plan(Window.RATION, 6, 4).group == 1
    assert _group_plan(Window.IDLE, 6, 4).group == 4
    plain = VirtualDevice(10.0)
    res, _ = _drive(_group_plan(Window.IDLE, 3, 4), IdleWindow(0.2, 60.0).open(10.0), plain)
    assert [e[0] for e in plain.log].count("launch") == 3 and res.num_chunks == 3
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="group must be a whole number of chunks >= 1"):
            _group_plan(Window.IDLE, 3, bad)


class _Capped:
    """An idle decision with a gate: no launch may cover the chunk that starts at `stop_row`."""

    def __init__(self, inner, stop_row):
        self.inner, self.stop_row, self.row = inner, stop_row, 0
        self.noted = []

    def may_read_next(self, now, request_waiting, next_chunk_est_ms):
        return self.row != self.stop_row and self.inner.may_read_next(now, request_waiting, next_chunk_est_ms)

    def note_chunk(self, gpu_ms):
        self.inner.note_chunk(gpu_ms)

    def chunks_allowed(self, chunks):
        return next((i for i in range(1, chunks) if self.row + i * GRID == self.stop_row), chunks)

    def note_launch(self, chunks):
        self.noted.append(chunks)
        self.row += chunks * GRID


def test_a_group_is_cut_short_before_a_gated_row():
    """A gate at chunk 3: the first launch may cover 3 chunks (the pipe reads 2), the next 1, then it stops."""
    dev = GroupDevice(10.0)
    gate = _Capped(IdleWindow(0.2, 60.0).open(10.0), 3 * GRID)
    res, _ = _drive(_group_plan(Window.IDLE, 8, 4), gate, dev)
    assert [e for e in dev.log if e[0] in ("group", "launch")] == [("group", 0, 2), ("launch", 2 * GRID)]
    assert gate.noted == [2, 1] and res.num_chunks == 3 and res.end_row == 3 * GRID
