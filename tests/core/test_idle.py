"""The idle window on a scripted clock: bursts stop at 2 s, and before the next chunk once a request waits."""

import pytest

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, ReadEach, Stop
from qse.core.idle import READ_OVERDUE_S, IdleWindow, SessionBacklog, idle_read_order, pick_idle_session
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import Window, plan_read

CHUNK_MS = 44.544


class VirtualReader:
    """A clock and a chunk reader that costs CHUNK_MS per chunk."""

    def __init__(self, t: float):
        self.t = t
        self.starts: list[float] = []

    def clock(self) -> float:
        return self.t

    def read_chunk(self, row: int) -> float:
        self.starts.append(self.t)
        self.t += CHUNK_MS / 1000
        return CHUNK_MS


def _burst(opened_s: float, arrival_s: float | None, known_tokens: int):
    window = IdleWindow(0.2, 2.0)
    ledger = GpuLedger()
    reader = VirtualReader(opened_s)
    burst = window.open(opened_s)
    plan = plan_read(Window.IDLE, session_id="s", turn_id=None, committed_rows=0, prompt_tokens=known_tokens,
                     known_tokens=known_tokens, grid=512, budget_ms=2000.0, first_chunk_est_ms=CHUNK_MS)
    driver = PlanDriver(estimator=ChunkCostEstimator(CHUNK_MS), ledger=ledger, clock=reader.clock)
    res = driver.run(plan, burst, ReadEach(reader.read_chunk),
                     request_waiting=lambda: arrival_s is not None and reader.t >= arrival_s)
    return res, ledger, reader


def test_burst_stops_at_two_seconds_whole_chunks():
    res, ledger, reader = _burst(10.0, None, 100 * 512)
    # 44 chunks take 1959.936 ms; the 45th would end at 2004.48 ms, past the burst
    assert (res.num_chunks, res.end_row, res.stop) == (44, 44 * 512, Stop.BUDGET)
    assert ledger.spent_us(Role.READER_IDLE) == 1_959_936
    assert ledger.balance().gpu_us == {Role.READER_IDLE: 1_959_936}


def test_burst_stops_before_the_next_chunk_once_a_request_waits():
    res, ledger, reader = _burst(10.0, 10.5, 100 * 512)
    # chunk 12 starts at 10.489984 (before the arrival) and ends at 10.534528; the 13th is not started
    assert (res.num_chunks, res.stop) == (12, Stop.WAITING)
    assert ledger.spent_us(Role.READER_IDLE) == 12 * 44_544
    wait_ms = (reader.t - 10.5) * 1000
    assert wait_ms == pytest.approx(34.528)
    assert wait_ms <= CHUNK_MS  # a request that arrives waits at most one chunk


def test_burst_ends_with_the_backlog():
    res, ledger, _ = _burst(0.0, None, 5 * 512 + 300)
    assert (res.num_chunks, res.end_row, res.stop) == (5, 2560, Stop.BACKLOG)
    assert ledger.spent_us(Role.READER_IDLE) == 222_720


def test_may_read_next_decisions():
    burst = IdleWindow(0.2, 2.0).open(5.0)
    assert not burst.may_read_next(5.0, True, 1.0)  # a request waits
    assert not burst.may_read_next(5.0, False, float("nan"))
    assert burst.may_read_next(5.0, False, 2000.0)
    assert not burst.may_read_next(5.0, False, 2000.001)  # past the burst, and not its first chunk
    assert burst.may_read_next(6.9, False, 100.0)
    assert not burst.may_read_next(6.9, False, 100.001)
    assert not burst.may_read_next(7.5, False, 0.001)
    # a burst's first chunk estimated above a whole burst is admitted (the probe), alone
    fresh = IdleWindow(0.2, 2.0).open(5.0)
    assert not fresh.may_read_next(5.0, True, 2000.001)  # never while a request waits
    assert fresh.may_read_next(5.0, False, 2000.001)
    assert not fresh.may_read_next(5.0, False, 2000.001)


@pytest.mark.parametrize("running,waiting,hold,box,ok", [
    (False, False, False, False, True),
    (True, False, False, False, False),
    (False, True, False, False, False),
    (False, False, True, False, False),
    (False, False, False, True, False),
], ids=["idle", "running", "waiting", "hold", "box"])
def test_may_open(running, waiting, hold, box, ok):
    assert IdleWindow.may_open(request_running=running, request_waiting=waiting, hold_on=hold, box_locked=box) is ok


def test_polls():
    window = IdleWindow(0.2, 2.0)
    assert window.next_poll_s(3.0) == 3.2
    assert window.first_poll_at_or_after(0.0, 1.0) == 1.0
    assert window.first_poll_at_or_after(0.0, 1.01) == pytest.approx(1.2)
    assert window.first_poll_at_or_after(5.0, 4.0) == 5.0
    assert window.first_poll_at_or_after(0.1, 0.7) == pytest.approx(0.7)
    # never before t, even where the float phase lands an ulp below it (a poll as a turn ends)
    window = IdleWindow(0.1, 2.0)
    assert window.first_poll_at_or_after(4.6000000000000005, 8.400000000000002) == 8.400000000000002


def test_the_window_of_a_policy():
    from qse.policy import Policy
    from qse.settings import EngineSettings

    window = IdleWindow.of(Policy.from_settings(EngineSettings({"QSE_SHADOW_IDLE_BURST_S": "1.5"})))
    assert (window.poll_s, window.burst_s) == (0.2, 1.5)


def test_pick_idle_session_shortest_backlog_first_ties_oldest_then_by_id():
    assert pick_idle_session({}, 5.0) is None
    assert pick_idle_session({"a": SessionBacklog(5.0, 0)}, 5.0) is None
    # "c" has nothing whole to read; "d" is the oldest but the longest
    backlogs = {"b": SessionBacklog(3.0, 2), "a": SessionBacklog(4.0, 1), "c": SessionBacklog(1.0, 0),
                "d": SessionBacklog(2.0, 9)}
    assert pick_idle_session(backlogs, 5.0) == "a"
    assert pick_idle_session({k: v for k, v in backlogs.items() if k != "a"}, 5.0) == "b"
    assert pick_idle_session({"y": SessionBacklog(3.0, 2), "x": SessionBacklog(3.0, 2)}, 5.0) == "x"
    assert pick_idle_session({"y": SessionBacklog(2.0, 2), "x": SessionBacklog(3.0, 2)}, 5.0) == "y"


def test_the_oldest_order_reads_the_oldest_unread_chunk_first_whatever_its_length():
    backlogs = {"long": SessionBacklog(1.0, 40), "short": SessionBacklog(2.0, 1)}
    assert pick_idle_session(backlogs, 3.0, "oldest") == "long"
    assert pick_idle_session(backlogs, 3.0) == "short"


def test_a_bad_read_order_is_named():
    from qse.policy import Policy

    with pytest.raises(ValueError, match=r"QSE_SHADOW_READ_ORDER='newest' is not one of \('shortest', 'oldest'\)"):
        Policy(read_order="newest")


def test_a_backlog_waiting_past_the_overdue_bound_goes_first_oldest_first():
    """Short backlogs that keep coming never starve a long one: once its oldest unread chunk has waited
    READ_OVERDUE_S it is read before every backlog that has not, however short."""
    long_one, short = SessionBacklog(0.0, 40), SessionBacklog(9.0, 1)
    just_before = READ_OVERDUE_S - 1e-6
    assert pick_idle_session({"long": long_one, "short": short}, just_before) == "short"
    assert pick_idle_session({"long": long_one, "short": short}, READ_OVERDUE_S) == "long"
    older = SessionBacklog(-1.0, 80)  # two overdue: the oldest first, whatever their lengths
    assert pick_idle_session({"long": long_one, "older": older, "short": short}, READ_OVERDUE_S) == "older"
    assert idle_read_order(short, READ_OVERDUE_S) > idle_read_order(long_one, READ_OVERDUE_S)
