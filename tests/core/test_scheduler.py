"""The scheduler on a scripted clock: events in, actions out."""

import dataclasses
import math

import pytest

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, ReadEach, Stop
from qse.core.idle import IdleBurst, SessionBacklog
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import Window, plan_read
from qse.core.ration import RationSlice
from qse.core.rounds import Prompt, Running
from qse.core.scheduler import (Arrived, Busy, IdleOpened, IdlePoll, Nothing, OpenIdle, OpenTurn, ReadEnded,
                                ReadPlan, RoundDue, RoundEnded, RunRound, Scheduler, SliceView, TurnEnded)
from qse.policy import Policy

GRID = 512
CHUNK_MS = 40.0
POLICY = Policy(grid=GRID, served_grid=GRID, max_running=2, round_token_budget=GRID, ration=0.02,
                ration_after_s=0.0, slice_ms=150.0, idle_poll_s=0.2, idle_burst_s=2.0)


def scheduler(policy=POLICY, **kw) -> Scheduler:
    return Scheduler(policy, ChunkCostEstimator(CHUNK_MS), GpuLedger(), **kw)


def backlog(**chunks) -> dict[str, SessionBacklog]:
    return {sid: SessionBacklog(since, n) for sid, (since, n) in chunks.items()}


@pytest.mark.parametrize("busy", [Busy(request_running=True), Busy(request_waiting=True), Busy(hold_on=True),
                                  Busy(box_locked=True)], ids=["running", "waiting", "hold", "box"])
def test_the_idle_window_never_opens_while_a_sequence_runs_or_waits(busy):
    s = scheduler()
    assert s.on(IdlePoll(10.0, busy, has_work=True)) == Nothing(pytest.approx(10.2))  # the next look, poll_s later
    assert s.on(IdlePoll(10.2, Busy(), has_work=False)) == Nothing(pytest.approx(10.4))  # quiet, but nothing to read
    assert s.on(IdlePoll(10.4, Busy(), has_work=True)) == OpenIdle(10.4)


def test_an_idle_burst_reads_the_shortest_backlog_first_then_the_next_then_closes():
    s = scheduler()
    first = s.on(IdleOpened(10.0, backlog(b=(3.0, 2), a=(5.0, 1), c=(1.0, 0))))  # "a": the younger, shorter
    assert isinstance(first, ReadPlan) and (first.window, first.session_id, first.turn_id) == (Window.IDLE, "a", None)
    assert isinstance(first.decision, IdleBurst) and first.budget_ms(10.0) == 2000.0
    second = s.on(ReadEnded(10.1, Stop.BACKLOG, backlog(b=(3.0, 2))))
    assert second.session_id == "b" and second.decision is first.decision  # the same burst goes on
    assert second.budget_ms(10.1) == pytest.approx(1900.0)
    assert s.on(ReadEnded(10.5, Stop.BACKLOG, {})) == Nothing(10.7)  # nothing left: the next look, poll_s on
    assert s.burst is None


def test_an_arriving_request_waits_at_most_one_chunk():
    """A request arrives while the burst's second chunk runs: that chunk ends, no other starts, the burst closes,
    and the window stays shut while the request waits."""
    s = scheduler()
    t = [10.0]
    read = s.on(IdleOpened(t[0], backlog(a=(0.0, 10))))
    arrival = 10.0 + 1.5 * CHUNK_MS / 1000  # inside the second chunk

    def read_chunk(row):
        t[0] += CHUNK_MS / 1000
        return CHUNK_MS

    plan = plan_read(Window.IDLE, session_id="a", turn_id=None, committed_rows=0, prompt_tokens=10 * GRID,
                     known_tokens=10 * GRID, grid=GRID, budget_ms=read.budget_ms(t[0]), first_chunk_est_ms=CHUNK_MS)
    res = PlanDriver(estimator=s.estimator, ledger=s.ledger, clock=lambda: t[0]).run(
        plan, read.decision, ReadEach(read_chunk), request_waiting=lambda: t[0] >= arrival)
    assert (res.num_chunks, res.stop) == (2, Stop.WAITING)
    assert t[0] - arrival == pytest.approx(0.5 * CHUNK_MS / 1000)  # it waited for the rest of one chunk
    assert s.on(ReadEnded(t[0], res.stop, backlog(a=(0.0, 8)))) == Nothing(pytest.approx(t[0] + 0.2))
    assert s.on(IdlePoll(t[0] + 0.2, Busy(request_waiting=True), has_work=True)) == Nothing(pytest.approx(t[0] + 0.4))


def test_a_ration_slice_is_spent_between_rounds_only():
    s = scheduler()
    turn = SliceView("k", "t1", "a", first_token_s=10.0, committed_rows=0, known_tokens=4 * GRID)
    # a round of a running turn, then the slice between it and the next
    due = s.on(RoundDue(11.0, (), (), (Running("k", 5),)))
    assert isinstance(due, RunRound) and due.plan.decode == ("k",)
    # 2 % of 1 s since the first token is 20 ms: a 40 ms chunk is not earned until 12.0 s
    assert s.on(RoundEnded(11.0, (turn,))) == Nothing(12.0)
    assert s.on(RoundEnded(11.5, (turn,))) == Nothing(12.0)  # (skipped without asking the ration again)
    got = s.on(RoundEnded(12.0, (turn,)))
    assert isinstance(got, ReadPlan) and (got.window, got.session_id, got.turn_id, got.key) == (
        Window.RATION, "a", "t1", "k")
    assert isinstance(got.decision, RationSlice) and got.decision.budget_us == 40_000
    s.ledger.open_turn("t1")
    s.ledger.record(Role.READER_RATION, CHUNK_MS, turn_id="t1")
    assert s.on(ReadEnded(12.04, Stop.BUDGET)) == Nothing()  # a slice's end: the round loop goes on
    # what it spent is paid back before the next slice (20 ms earned per second)
    assert s.on(RoundEnded(12.05, (turn._replace(committed_rows=GRID),))) == Nothing(pytest.approx(14.0))


def test_no_slice_without_a_whole_chunk_a_first_token_or_a_resident_session():
    s = scheduler()
    turn = SliceView("k", "t1", "a", first_token_s=0.0, committed_rows=GRID, known_tokens=2 * GRID - 1)
    assert s.on(RoundEnded(100.0, (turn,))) == Nothing()
    assert s.on(RoundEnded(100.0, (turn._replace(known_tokens=2 * GRID, resident=False),))) == Nothing()
    assert s.on(RoundEnded(100.0, (turn._replace(known_tokens=2 * GRID, first_token_s=None),))) == Nothing()
    assert isinstance(s.on(RoundEnded(100.0, (turn._replace(known_tokens=2 * GRID),))), ReadPlan)


def test_the_slice_goes_to_the_turn_that_got_its_first_token_first():
    s = scheduler()
    late = SliceView("late", "t2", "b", 50.0, 0, GRID)
    early = SliceView("early", "t1", "a", 10.0, 0, GRID)
    assert s.on(RoundEnded(100.0, (late, early))).key == "early"


def test_a_share_of_zero_never_opens_a_slice():
    s = scheduler(Policy(grid=GRID, ration=0.0))
    assert s.on(RoundEnded(1e6, (SliceView("k", "t", "a", 0.0, 0, GRID),))) == Nothing(math.inf)


def test_a_turn_end_drops_its_skip_and_the_idle_window_looks_at_once_or_on_its_lattice():
    s = scheduler(dataclasses.replace(POLICY, idle_wake=False))
    assert s.on(Arrived(10.0)) == Nothing(10.0)  # the lattice starts with the first request
    turn = SliceView("k", "t1", "a", 10.0, 0, 4 * GRID)
    assert s.on(RoundEnded(10.5, (turn,))) == Nothing(12.0)
    assert s.on(TurnEnded(10.75, "t1")) == Nothing(pytest.approx(10.8))  # the first look at or after 10.75
    assert s._not_before == {}
    woken = scheduler()  # the default: QSE_SHADOW_IDLE_WAKE on
    assert woken.on(Arrived(10.0)) == Nothing(10.0)
    assert woken.on(TurnEnded(10.75, "t1")) == Nothing(10.75)


def test_rounds_open_admitted_turns_one_at_a_time_then_run_and_end():
    s = scheduler()
    a, b, c = (Prompt(k, no, n) for k, no, n in (("a", 0, 3 * GRID), ("b", 1, 10), ("c", 2, 20)))
    assert s.on(RoundDue(0.0, (a, b, c), (), ())) == OpenTurn("b")  # the shortest prompt first
    assert s.on(RoundDue(0.0, (a, c), (b._replace(chunks_left=0),), ())) == OpenTurn("c")
    # two slots taken: a waits; the round reads one piece (round_token_budget is one grid)
    got = s.on(RoundDue(0.0, (a,), (b._replace(chunks_left=0), c._replace(chunks_left=0)), ()))
    assert isinstance(got, RunRound) and [(r.key, r.chunks, r.tail) for r in got.plan.reads] == [("b", 0, True)]
    assert s.on(RoundDue(0.0, (), (), (Running("b", 0),))) == RunRound(got.plan._replace(decode=(), reads=()))
    assert s.on(RoundDue(0.0, (), (), (), in_flight=True)) == RunRound(got.plan._replace(decode=(), reads=()))
    assert s.on(RoundDue(0.0, (), (), ())) == Nothing()


def test_an_unknown_event_is_refused_by_name():
    with pytest.raises(TypeError, match="no event 'x'"):
        scheduler().on("x")


def test_a_summary_is_earned_by_the_narrators_share_and_spent_from_it():
    """The narrator's summary opens once its share of the time since the first token covers the summary's
    estimate, and what the narrator already spent on the turn counts against it."""
    s = scheduler(Policy(**{**POLICY.__dict__, "narrator_share": 0.03}))
    turn = SliceView("k", "t1", "a", first_token_s=10.0, committed_rows=0, known_tokens=0)
    s.ledger.open_turn("t1")
    assert not s.summary_earned(11.0, turn, est_ms=60.0)  # 3 % of 1 s: 30 ms
    assert s.summary_earned(13.0, turn, est_ms=60.0)  # 3 % of 3 s: 90 ms
    assert s.ledger.record(Role.NARRATOR, 50.0, turn_id="t1") == 50_000
    assert not s.summary_earned(13.0, turn, est_ms=60.0)  # 90 - 50 left
    assert not s.summary_earned(99.0, turn._replace(first_token_s=None), est_ms=1.0)  # no first token, no summary


def test_the_busy_share_reads_the_shortest_backlog_between_rounds_whatever_turns_run():
    """Under many short turns no turn's ration opens: the busy share earns 1 % of all served device time and
    spends it between rounds on the session the reader's order puts first (no turn is charged)."""
    s = scheduler(Policy(**{**POLICY.__dict__, "busy_share": 0.01, "ration_after_s": 60.0}))
    turn = SliceView("k", "t1", "running", first_token_s=10.0, committed_rows=0, known_tokens=4 * GRID)
    waiting = {"a": SessionBacklog(2.0, 3, 0), "b": SessionBacklog(5.0, 1, GRID), "c": SessionBacklog(1.0, 0, 0)}
    s.ledger.record(Role.SERVED_PREFILL, 1500.0)
    s.ledger.record(Role.SERVED_DECODE, 1500.0)  # 3 s served: 30 ms earned, a 40 ms chunk is not
    assert s.busy_may_open()  # a shortest slice (10 ms) is earned, so the caller gathers the backlogs
    # the turn's ration says when it may open (60 s past its first token, then 2 s for a 40 ms chunk)
    assert s.on(RoundEnded(11.0, (turn,), waiting)) == Nothing(72.0)
    s.ledger.record(Role.SERVED_DECODE, 1000.0)  # 4 s: 40 ms earned
    assert s.busy_may_open()
    got = s.on(RoundEnded(11.1, (turn,), waiting))
    # "b" has the fewest chunks of those with a whole one ("c" has none; "a" is older, but neither overdue nor
    # shorter); the turn's ration (60 s off) is not open
    assert isinstance(got, ReadPlan) and (got.window, got.session_id, got.turn_id, got.key) == (
        Window.RATION, "b", None, None)
    assert isinstance(got.decision, RationSlice) and got.decision.budget_us == 40_000
    s.ledger.record(Role.READER_RATION, CHUNK_MS)  # spent: nothing left until the served model earns more
    assert not s.busy_may_open() and s.on(RoundEnded(11.2, (turn,), waiting)) == Nothing(72.0)
    s.ledger.record(Role.SERVED_DECODE, 10_000.0)
    assert s.on(RoundEnded(11.3, (), {})) == Nothing()  # earned, but nothing unread: nothing to read
    # 100 ms earned (10 s more served): still one chunk's slice, never a whole one (every decoder waits for it)
    got = s.on(RoundEnded(11.4, (), waiting))
    assert isinstance(got, ReadPlan) and got.decision.budget_us == 40_000


def test_a_turn_ration_goes_first_and_counts_against_the_busy_share():
    s = scheduler(Policy(**{**POLICY.__dict__, "busy_share": 0.01, "ration_after_s": 0.0}))
    turn = SliceView("k", "t1", "running", first_token_s=10.0, committed_rows=0, known_tokens=4 * GRID)
    s.ledger.record(Role.SERVED_DECODE, 8000.0)  # the busy share has earned 80 ms
    got = s.on(RoundEnded(12.0, (turn,), {"a": SessionBacklog(1.0, 2, 0)}))  # the turn's 2 % of 2 s: 40 ms
    assert isinstance(got, ReadPlan) and (got.session_id, got.turn_id) == ("running", "t1")
    s.ledger.open_turn("t1")
    s.ledger.record(Role.READER_RATION, 80.0, turn_id="t1")  # the turn's slices spent what the share earned
    assert not s.busy_may_open()


def test_a_busy_share_of_zero_never_reads():
    s = scheduler(Policy(**{**POLICY.__dict__, "busy_share": 0.0, "ration_after_s": 60.0}))
    s.ledger.record(Role.SERVED_DECODE, 1e6)
    assert not s.busy_may_open()
    assert s.on(RoundEnded(1.0, (), {"a": SessionBacklog(0.0, 4, 0)})) == Nothing()


def test_the_idle_window_may_be_looked_at_only_when_quiet_and_no_burst_is_open():
    s = scheduler()
    assert s.idle_may_look(Busy()) and not s.idle_may_look(Busy(request_running=True))
    assert s.on(IdlePoll(1.0, Busy(), has_work=True)) == OpenIdle(1.0)
    s.on(IdleOpened(1.0, backlog(a=(0.0, 2))))
    assert not s.idle_may_look(Busy())  # a burst is open: nobody looks again until it closes
