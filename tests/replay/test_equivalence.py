"""The simulator takes the same decisions as qse/core driven directly, step by step.

The reference below drives the core's decision objects with a scripted clock in the plainest way:
it looks at EVERY decode round boundary (the simulator jumps to the first one the core could accept)
and reads chunk by chunk with `may_read_next` (the simulator goes through `PlanDriver`). Sessions
keep their whole previous prompt and output, so no rollback is involved.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qse.core import ChunkCostEstimator, GpuLedger, IdleWindow, Role, Stop, TurnRation, Window
from qse.replay.read_model import ReadModel
from qse.replay.simulator import SimOptions, simulate
from qse.replay.usage import UsageRecord


def reference(recs, model: ReadModel, opt: SimOptions):
    grid = opt.grid
    est = ChunkCostEstimator(model.ms_per_chunk(0, grid), opt.estimator_bucket_tokens)
    idle = IdleWindow(opt.policy.idle_poll_s, opt.policy.idle_burst_s)
    ration = TurnRation(opt.policy.ration, opt.policy.slice_ms, after_s=opt.policy.ration_after_s,
                        min_slice_ms=opt.policy.min_slice_ms)
    ledger = GpuLedger()
    trace = []
    st_ = {"committed": 0, "known": 0}

    def read(turn, window, decision, t, turn_id, waiting_at):
        start, n, stop, opened = st_["committed"], 0, Stop.BACKLOG, t
        while st_["committed"] + grid <= st_["known"]:
            e = est.estimate_ms(st_["committed"])
            waiting = waiting_at is not None and t >= waiting_at
            if not decision.may_read_next(t, waiting, e):
                stop = Stop.WAITING if waiting else Stop.BUDGET
                break
            ms = model.ms_per_chunk(st_["committed"], grid)
            t += ms / 1000
            decision.note_chunk(ms)
            est.observe(st_["committed"], ms)
            ledger.record(Role.READER_IDLE if window is Window.IDLE else Role.READER_RATION, ms, turn_id=turn_id)
            st_["committed"] += grid
            n += 1
        trace.append((turn, window, start, n, stop, opened))
        return t

    def idle_between(turn, free, arrival, next_poll):
        # the idle window looks the moment the turn ends (QSE_SHADOW_IDLE_WAKE), else at its lattice's next look
        t = free if opt.policy.idle_wake else idle.first_poll_at_or_after(next_poll, free)
        start = arrival
        while t < arrival and st_["committed"] + grid <= st_["known"]:
            t_end = read(turn, Window.IDLE, idle.open(t), t, None, arrival)
            start = max(start, t_end)
            # a spent burst: the next one opens at once; otherwise the window looks a poll later
            t = t_end if trace[-1][4] is Stop.BUDGET else idle.next_poll_s(t_end)
        return start, t

    shift, free, next_poll = 0.0, None, recs[0].arrival_s
    for k, rec in enumerate(recs):
        arrival = rec.arrival_s + shift
        if free is not None:
            start, next_poll = idle_between(k, free, arrival, next_poll)
            shift += start - arrival
            arrival = start
        turn_id = f"t{k}"
        ledger.open_turn(turn_id)
        st_["known"] = rec.prompt_tokens
        first_token = arrival + (rec.first_token_s - rec.arrival_s)
        decode_s = rec.end_s - rec.first_token_s
        reader_s = 0.0
        if rec.output_tokens >= 2 and decode_s > 0:
            round_s = decode_s / rec.output_tokens
            for i in range(1, rec.output_tokens):  # every boundary between two decode rounds
                st_["known"] = rec.prompt_tokens + i
                if st_["committed"] + grid > st_["known"]:
                    continue
                t_i = first_token + i * round_s + reader_s
                sl = ration.open_slice(t_i, first_token, ledger.spent_us(Role.READER_RATION, turn_id),
                                       est.estimate_ms(st_["committed"]))
                if sl is None:
                    continue
                reader_s += read(k, Window.RATION, sl, t_i, turn_id, None) - t_i
        shift += reader_s
        free = first_token + decode_s + reader_s
        st_["known"] = rec.prompt_tokens + rec.output_tokens
    idle_between(len(recs), free, float("inf"), next_poll)
    return trace, ledger


def _compare(recs, model, opt):
    res = simulate(recs, model, opt, record_decisions=True)
    got = [(d.turn, d.window, d.start_row, d.num_chunks, d.stop, d.opened_s) for d in res.decisions if d.num_chunks > 0]
    want, ledger = reference(recs, model, opt)
    want = [w for w in want if w[3] > 0]
    assert [g[:5] for g in got] == [w[:5] for w in want]
    assert [g[5] for g in got] == pytest.approx([w[5] for w in want], abs=1e-9)
    for role in (Role.READER_IDLE, Role.READER_RATION):
        assert res.ledger.spent_us(role) == ledger.spent_us(role)
    return got


def _session(turns, prefill_s):
    """turns: (new ids, output ids, decode tok/s, gap s) per turn; every turn keeps all before it."""
    recs, t, prompt = [], 0.0, 0
    prev_total = 0
    for new, out, rate, gap in turns:
        prompt = prev_total + new
        first = t + prefill_s
        end = first + out / rate
        recs.append(UsageRecord(session="s", arrival_s=t, first_token_s=first, end_s=end, prompt_tokens=prompt,
                                shared_prefix_tokens=prev_total - (recs[-1].output_tokens if recs else 0),
                                output_tokens=out))
        prev_total = prompt + out
        t = end + gap
    return recs


@pytest.mark.parametrize("wake", [True, False], ids=["wake", "lattice"])
@pytest.mark.parametrize("after_s", [0.0, 5.0, 30.0], ids=["undelayed", "after-5s", "after-30s"])
def test_same_decisions_on_a_long_decoding_turn(after_s, wake):
    # decodes of 83, 22 and 100 s: a 30 s delay leaves the middle turn no ration, the others some
    recs = _session([(30_000, 3000, 36.0, 1.0), (2000, 800, 36.0, 0.3), (700, 5000, 50.0, 0.0)], prefill_s=2.0)
    got = _compare(recs, ReadModel.flat(87.0), SimOptions.of(ration_after_s=after_s, idle_wake=wake))
    assert any(w[1] is Window.RATION for w in got) and any(w[1] is Window.IDLE for w in got)
    ration_turns = {w[0] for w in got if w[1] is Window.RATION}
    assert ration_turns == ({0, 2} if after_s == 30.0 else {0, 1, 2})
    assert all(w[5] >= 2.0 + after_s for w in got if w[1] is Window.RATION and w[0] == 0)


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(st.tuples(st.integers(0, 6000), st.integers(1, 700), st.sampled_from([20.0, 36.0, 80.0]),
                             st.sampled_from([0.0, 0.15, 0.5, 1.7, 4.0])), min_size=1, max_size=4),
    prefill_s=st.sampled_from([0.0, 0.3, 2.0]),
    ration=st.sampled_from([0.02, 0.05, 0.2]),
    after_s=st.sampled_from([0.0, 0.25, 1.0, 3.0]),
    slice_ms=st.sampled_from([50.0, 150.0]),
    poll_s=st.sampled_from([0.1, 0.2]),
    burst_s=st.sampled_from([0.5, 2.0]),
    grid=st.sampled_from([256, 512]),
    wake=st.booleans(),
    model=st.sampled_from([ReadModel.flat(87.0), ReadModel.flat(8.0), ReadModel(((0, 20.0), (8192, 60.0)))]),
)
def test_same_decisions_as_the_core_step_by_step(turns, prefill_s, ration, after_s, slice_ms, poll_s, burst_s,
                                                 grid, wake, model):
    recs = _session(turns, prefill_s)
    opt = SimOptions.of(ration=ration, ration_after_s=after_s, slice_ms=slice_ms, idle_poll_s=poll_s,
                     idle_burst_s=burst_s, grid=grid, idle_wake=wake, estimator_bucket_tokens=1024)
    _compare(recs, model, opt)
