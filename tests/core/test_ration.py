"""The ration inside a turn, on a scripted clock: exact decisions, exact ledger balances."""

import pytest

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, ReadEach, Stop
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import Window, plan_read
from qse.core.ration import TurnRation
from qse.core.share import ShareBudget
from qse.policy import Policy
from qse.settings import EngineSettings

CHUNK_MS = 44.544  # the seed's 87 ms per 1000 tokens, one 512 chunk


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_share_counts_from_first_token_not_turn_start():
    ration = TurnRation(0.02, 150.0)
    arrival_s, first_token_s = 0.0, 17.0  # a 17 s prefill earns nothing
    assert ration.allowance_us(17.0, first_token_s, 0) == 0
    assert ration.allowance_us(26.6, first_token_s, 0) == 192_000  # 2 % of 9.6 s
    # counted from the turn's start it would have earned 532 ms: the seed's first build, -5.3 % decode
    assert ration.allowance_us(26.6, arrival_s, 0) == 532_000
    assert ration.allowance_us(26.6, first_token_s, 150_000) == 42_000
    assert ration.allowance_us(26.6, first_token_s, 500_000) == 0  # overspent: nothing, never negative
    assert ration.allowance_us(16.0, first_token_s, 0) == 0  # before the first token


def test_share_arithmetic_is_exact():
    share = ShareBudget(0.29)  # 0.29 * 100 is 28.999999999999996 in floats
    assert share.earned_us(100e-6, 0.0) == 29
    assert share.earliest_s(0.0, 0, 29) == 100e-6
    assert ShareBudget(0.02).earliest_s(5.0, 0, 44_544) == 5.0 + 2.2272
    assert ShareBudget(0.0).earliest_s(0.0, 0, 1) is None
    with pytest.raises(ValueError, match="1.5"):
        ShareBudget(1.5)


def test_a_chunk_whose_estimate_exceeds_what_is_left_is_not_started():
    ration = TurnRation(0.02, 150.0)
    # 2 s after the first token: 40 ms earned, a 44.544 ms chunk does not fit
    assert ration.open_slice(12.0, 10.0, 0, CHUNK_MS) is None
    when = ration.earliest_s(10.0, 0, CHUNK_MS)
    assert when == 10.0 + 2.2272
    assert ration.open_slice(when, 10.0, 0, CHUNK_MS) is not None
    assert ration.open_slice(when - 1e-6, 10.0, 0, CHUNK_MS) is None
    # a chunk dearer than a whole slice waits for a whole slice (the probe, tests/core/test_slow_chunk.py)
    assert ration.earliest_s(10.0, 0, 150.001) == 10.0 + 7.5
    assert ration.open_slice(17.5 - 1e-6, 10.0, 0, 150.001) is None
    assert ration.open_slice(17.5, 10.0, 0, 150.001).budget_us == 150_000


def test_slices_never_exceed_slice_ms_nor_split_a_chunk():
    ration = TurnRation(0.02, 150.0)
    ledger = GpuLedger()
    ledger.open_turn("t")
    est = ChunkCostEstimator(prior_ms=CHUNK_MS)
    clock = Clock(30.0)  # 20 s after the first token: 400 ms earned, a slice holds 150
    sl = ration.open_slice(clock(), 10.0, 0, CHUNK_MS)
    assert sl.budget_us == 150_000
    plan = plan_read(Window.RATION, session_id="s", turn_id="t", committed_rows=0, prompt_tokens=51200,
                     known_tokens=51200, grid=512, budget_ms=sl.budget_us / 1000, first_chunk_est_ms=CHUNK_MS)

    def read_chunk(row):
        clock.t += CHUNK_MS / 1000
        return CHUNK_MS

    res = PlanDriver(estimator=est, ledger=ledger, clock=clock).run(plan, sl, ReadEach(read_chunk),
                                                                    request_waiting=lambda: False)
    assert (res.num_chunks, res.end_row, res.stop) == (3, 1536, Stop.BUDGET)  # a 4th would make 178.176 ms
    assert res.gpu_us == 133_632
    assert ledger.spent_us(Role.READER_RATION, "t") == 133_632
    balance = ledger.close_turn("t")
    assert balance.gpu_us == {Role.READER_RATION: 133_632}
    assert balance.est_us == {Role.READER_RATION: 133_632}

    # the next slice at 30.2 s: 404 ms earned - 133.632 spent = 270.368 left, capped at 150 again
    assert ration.open_slice(30.2, 10.0, 133_632, CHUNK_MS).budget_us == 150_000
    # at 16.7 s: 134 ms earned, 0.368 left: nothing
    assert ration.open_slice(16.7, 10.0, 133_632, CHUNK_MS) is None


def test_measured_overrun_shrinks_the_rest_of_the_slice_and_teaches_the_estimator():
    ration = TurnRation(0.02, 150.0)
    ledger = GpuLedger()
    est = ChunkCostEstimator(prior_ms=40.0)
    clock = Clock(100.0)
    sl = ration.open_slice(clock(), 0.0, 0, est.estimate_ms(0))
    plan = plan_read(Window.RATION, session_id="s", turn_id=None, committed_rows=0, prompt_tokens=10_000,
                     known_tokens=10_000, grid=512, budget_ms=150.0, first_chunk_est_ms=40.0)
    measured = iter([70.0, 70.0, 70.0])

    def read_chunk(row):
        ms = next(measured)
        clock.t += ms / 1000
        return ms

    res = PlanDriver(estimator=est, ledger=ledger, clock=clock).run(plan, sl, ReadEach(read_chunk),
                                                                    request_waiting=lambda: False)
    # first chunk admitted on 40 (prior), measured 70; the second's estimate is 70: 140 <= 150, admitted;
    # a third would make 210
    assert (res.num_chunks, res.gpu_us, res.stop) == (2, 140_000, Stop.BUDGET)
    assert ledger.balance().estimate_error_us(Role.READER_RATION) == 140_000 - 110_000
    assert est.estimate_ms(1024) == 70.0


def test_narrator_share_the_same_way_from_settings():
    settings = Policy.from_settings(EngineSettings({}))
    narrator = TurnRation.narrator(settings)
    reader = TurnRation.reader(settings)
    assert (narrator.share, narrator.window) == (0.03, Window.NARRATOR)
    assert (reader.share, reader.slice_ms, reader.window) == (0.02, 150.0, Window.RATION)
    assert (reader.after_s, narrator.after_s) == (5.0, 0.0)  # the reader's ration waits 5 s, the narrator's not
    assert narrator.allowance_us(20.0, 10.0, 0) == 300_000
    assert narrator.open_slice(20.0, 10.0, 0, 15.0).budget_us == 150_000
    # a narrator's fork decode token of 15 ms needs 0.5 s of the served model's decode
    assert narrator.earliest_s(10.0, 0, 15.0) == 10.5


# ---- the ration's delay: the share counts from first token + after_s ---------------------------------

def test_no_slice_before_first_token_plus_after_s():
    ration = TurnRation(0.02, 150.0, after_s=2.5)
    first_token_s = 10.0  # the share counts from 12.5
    for now in (10.0, 11.0, 12.0, 12.5):
        assert ration.allowance_us(now, first_token_s, 0) == 0
        assert ration.open_slice(now, first_token_s, 0, 0.001) is None  # not even a 1 us chunk
    assert ration.allowance_us(12.5 + 50e-6, first_token_s, 0) == 1  # 2 % of 50 us
    assert ration.open_slice(1e6, first_token_s, 0, 0.001) is not None  # the delay is once per turn


def test_after_the_delay_the_allowance_is_the_share_of_the_time_since_it_less_what_was_spent():
    ration = TurnRation(0.02, 150.0, after_s=2.5)
    first_token_s = 10.0
    assert ration.allowance_us(22.5, first_token_s, 0) == 200_000  # 2 % of the 10 s since 12.5
    assert ration.allowance_us(22.5, first_token_s, 150_000) == 50_000
    assert ration.allowance_us(22.5, first_token_s, 250_000) == 0  # overspent: nothing, never negative
    assert ration.allowance_us(14.6, first_token_s, 0) == 42_000  # 2 % of 2.1 s
    # the slice is capped as before and holds what is left
    assert ration.open_slice(22.5, first_token_s, 0, CHUNK_MS).budget_us == 150_000
    assert ration.open_slice(22.5, first_token_s, 150_000, CHUNK_MS).budget_us == 50_000
    assert ration.open_slice(22.5, first_token_s, 160_000, CHUNK_MS) is None  # 40 ms left, 44.544 asked


def test_earliest_s_shifts_by_after_s():
    delayed = TurnRation(0.02, 150.0, after_s=2.5)
    now = TurnRation(0.02, 150.0)
    assert delayed.earliest_s(10.0, 0, CHUNK_MS) == 12.5 + 2.2272
    assert delayed.earliest_s(10.0, 0, CHUNK_MS) == now.earliest_s(12.5, 0, CHUNK_MS)
    assert delayed.earliest_s(10.0, 133_632, CHUNK_MS) == 12.5 + 8.9088  # (133.632 + 44.544) ms / 2 %
    when = delayed.earliest_s(10.0, 0, CHUNK_MS)
    assert delayed.open_slice(when, 10.0, 0, CHUNK_MS) is not None
    assert delayed.open_slice(when - 1e-6, 10.0, 0, CHUNK_MS) is None
    assert delayed.earliest_s(10.0, 0, 150.001) == 12.5 + 7.5  # dearer than a slice: a whole slice after the delay


@pytest.mark.parametrize("first_token_s", [0.0, 0.1, 17.0, 1234.567891, 86_399.999_999])
def test_after_s_zero_is_the_undelayed_rule_bit_for_bit(first_token_s):
    zero = TurnRation(0.02, 150.0, Window.RATION, after_s=0.0)
    plain = TurnRation(0.02, 150.0)
    share = ShareBudget(0.02)
    assert plain.after_s == 0.0
    for dt in (0.0, 1e-6, 0.3, 2.2272, 9.6, 123.456789):
        now = first_token_s + dt
        for spent_us in (0, 44_544, 133_632):
            want = share.allowance_us(now, first_token_s, spent_us)
            assert zero.allowance_us(now, first_token_s, spent_us) == plain.allowance_us(now, first_token_s, spent_us) == want
            for est_ms in (1.0, CHUNK_MS, 150.0):
                a = zero.open_slice(now, first_token_s, spent_us, est_ms)
                b = plain.open_slice(now, first_token_s, spent_us, est_ms)
                assert (a is None) == (b is None) and (a is None or a.budget_us == b.budget_us)
                want_s = share.earliest_s(first_token_s, spent_us, round(est_ms * 1000))
                assert zero.earliest_s(first_token_s, spent_us, est_ms) == want_s
                assert plain.earliest_s(first_token_s, spent_us, est_ms) == want_s


@pytest.mark.parametrize("after_s", [-1.0, -1e-9, float("nan"), float("inf")], ids=["minus-1", "tiny-negative", "nan", "inf"])
def test_a_bad_delay_is_a_value_error_naming_it(after_s):
    with pytest.raises(ValueError, match=r"delay after the first token .* got " + repr(after_s).replace(".", r"\.")):
        TurnRation(0.02, 150.0, after_s=after_s)


def test_the_delay_from_settings_is_the_reader_s_only():
    settings = Policy.from_settings(EngineSettings({"QSE_SHADOW_RATION_AFTER_S": "2.5"}))
    assert TurnRation.reader(settings).after_s == 2.5
    assert TurnRation.narrator(settings).after_s == 0.0  # the narrator's share is not delayed
    assert TurnRation.narrator(settings).allowance_us(20.0, 10.0, 0) == 300_000


def test_a_slice_opens_once_the_shortest_slice_is_earned():
    """Cheap chunks (1.2 ms) with a 10 ms shortest slice: no slice a chunk, one slice once 10 ms are earned,
    and it reads chunks until its budget is spent; a chunk dearer than the shortest slice needs its own cost."""
    ration = TurnRation(0.02, 150.0, min_slice_ms=10.0)
    first_token_s = 10.0
    assert ration.need_us(1.2) == 10_000 and ration.need_us(44.544) == 44_544 and ration.need_us(151.0) == 150_000
    when = ration.earliest_s(first_token_s, 0, 1.2)
    assert when == first_token_s + 0.5  # 2 % of 0.5 s is 10 ms
    assert ration.open_slice(when - 1e-6, first_token_s, 0, 1.2) is None
    sl = ration.open_slice(when, first_token_s, 0, 1.2)
    assert sl is not None and sl.budget_us == 10_000
    reads = 0
    while sl.may_read_next(when, False, 1.2):
        sl.note_chunk(1.2)
        reads += 1
    assert reads == 8  # 8 x 1.2 ms fit in 10 ms
    unlimited = TurnRation(0.02, 150.0)
    assert unlimited.earliest_s(first_token_s, 0, 1.2) == first_token_s + 0.06  # a slice as soon as a chunk is earned


@pytest.mark.parametrize("min_ms", [-1.0, 150.5, float("nan")], ids=["negative", "above-the-longest", "nan"])
def test_a_bad_shortest_slice_is_a_value_error_naming_it(min_ms):
    with pytest.raises(ValueError, match=r"shortest slice .* got " + repr(min_ms).replace(".", r"\.")):
        TurnRation(0.02, 150.0, min_slice_ms=min_ms)


def test_the_shortest_slice_from_settings_is_the_reader_s_and_the_narrator_s():
    policy = Policy.from_settings(EngineSettings({"QSE_SHADOW_MIN_SLICE_MS": "20"}))
    assert TurnRation.reader(policy).min_slice_us == TurnRation.narrator(policy).min_slice_us == 20_000
    assert TurnRation.reader(Policy.from_settings(EngineSettings({}))).min_slice_us == 10_000  # the default
