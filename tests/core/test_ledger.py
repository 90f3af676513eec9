"""The GPU-time ledger: exact balances in microseconds, refusals instead of exceptions."""

import math

import pytest

from qse.core.ledger import GpuLedger, Role, ms_to_us


def test_balances_are_exact_per_turn_and_in_total():
    ledger = GpuLedger()
    assert ledger.open_turn("t1")
    assert ledger.record(Role.SERVED_PREFILL, 17460.0, turn_id="t1") == 17_460_000
    for _ in range(10):
        assert ledger.record(Role.READER_RATION, 0.1, turn_id="t1", est_ms=0.1) == 100
    assert ledger.record(Role.READER_RATION, 44.544, turn_id="t1", est_ms=40.0) == 44_544
    assert ledger.record(Role.READER_IDLE, 1959.936) == 1_959_936  # idle: totals only

    assert ledger.spent_us(Role.READER_RATION, "t1") == 45_544
    assert ledger.spent_ms(Role.READER_RATION, "t1") == 45.544
    assert ledger.spent_us(Role.READER_IDLE, "t1") == 0
    assert ledger.spent_us(Role.READER_IDLE) == 1_959_936

    turn = ledger.close_turn("t1")
    assert turn.gpu_us == {Role.SERVED_PREFILL: 17_460_000, Role.READER_RATION: 45_544}
    assert turn.num_entries[Role.READER_RATION] == 11
    assert turn.estimate_error_us(Role.READER_RATION) == 4_544
    assert turn.reader_us == 45_544
    assert turn.total_us == 17_505_544

    total = ledger.balance()
    assert total.gpu_us[Role.READER_IDLE] == 1_959_936
    assert total.reader_us == 45_544 + 1_959_936
    assert total.gpu_ms(Role.NARRATOR) == 0.0


def test_closed_turn_is_forgotten_totals_stay():
    ledger = GpuLedger()
    ledger.open_turn("a")
    ledger.record(Role.NARRATOR, 12.5, turn_id="a")
    assert ledger.close_turn("a").gpu_us[Role.NARRATOR] == 12_500
    assert ledger.close_turn("a") is None
    assert ledger.balance("a") is None
    assert ledger.spent_us(Role.NARRATOR, "a") is None
    assert ledger.spent_us(Role.NARRATOR) == 12_500
    assert ledger.num_open_turns == 0


@pytest.mark.parametrize("gpu_ms", [-1.0, math.nan, math.inf, True, "3"], ids=["negative", "nan", "inf", "bool", "str"])
def test_bad_time_is_refused_and_nothing_is_recorded(gpu_ms):
    ledger = GpuLedger()
    ledger.open_turn("t")
    assert ledger.record(Role.READER_RATION, gpu_ms, turn_id="t") is None
    assert ledger.balance().total_us == 0
    assert ledger.balance("t").total_us == 0


def test_refusals():
    ledger = GpuLedger()
    assert ledger.open_turn("t")
    assert not ledger.open_turn("t")  # already open
    assert ledger.record(Role.READER_RATION, 1.0, turn_id="nope") is None  # no such turn
    assert ledger.record("reader_ration", 1.0) is None  # not a Role
    assert ledger.record(Role.READER_RATION, 1.0, est_ms=-2.0) is None  # bad estimate
    assert ledger.balance().total_us == 0


def test_ms_to_us():
    assert ms_to_us(44.544) == 44_544
    assert ms_to_us(0.0005) == 0  # half a microsecond rounds to even
    assert ms_to_us(0.0015) == 2
    assert ms_to_us(-0.001) is None
