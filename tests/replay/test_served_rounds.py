"""The replay's served rounds on a virtual clock: two overlapping requests, exact times from the cost models."""

import pytest

from qse.core.rounds import RoundPlanner
from qse.replay.read_model import ReadModel
from qse.replay.rounds import DecodeCost, simulate_rounds
from qse.replay.usage import UsageRecord

GRID = 10


def rec(session, arrival_s, prompt_tokens, output_tokens):
    return UsageRecord(session=session, arrival_s=arrival_s, first_token_s=None, end_s=arrival_s,
                       prompt_tokens=prompt_tokens, shared_prefix_tokens=0, output_tokens=output_tokens)


def test_two_overlapping_requests_share_rounds():
    """A chunk costs 10 ms (1 ms an id of a tail), a decode round 5 ms, one piece a round. x (2 chunks and a
    1-id tail) is read in rounds 1-3; y arrives in round 2, opens before round 3 but waits (x has 1 id left,
    y 5); round 4 decodes x and reads y's tail; round 5 decodes both, and both end."""
    read_model = ReadModel.flat(1000.0, grid=GRID)
    sim = simulate_rounds([rec("y", 0.015, 5, 2), rec("x", 0.0, 2 * GRID + 1, 3)],
                          RoundPlanner(max_running=2, token_budget=GRID, grid=GRID), read_model, DecodeCost(5.0))
    x, y = sim.turns  # in arrival order
    assert (x.record.session, y.record.session) == ("x", "y")
    assert [round(t, 6) for t, _ in sim.plans] == [0.0, 0.01, 0.02, 0.021, 0.031]
    assert x.ttft_s == pytest.approx(0.021) and y.ttft_s == pytest.approx(0.016)
    assert x.end_s == pytest.approx(0.036) and y.end_s == pytest.approx(0.036)
    assert x.tokens_per_s == pytest.approx(3 / 0.036) and y.tokens_per_s == pytest.approx(2 / 0.021)
    report = sim.report()
    assert report["num_rounds"] == 5 and [t["output_tokens"] for t in report["turns"]] == [3, 2]


def test_a_sessions_next_turn_waits_for_the_one_before():
    sim = simulate_rounds([rec("s", 0.0, 5, 2), rec("s", 0.001, 5, 1)], RoundPlanner(2, GRID, GRID),
                          ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0))
    first, second = sim.turns
    assert second.first_token_s > first.end_s  # it joined the queue when the first turn ended


def test_launched_ahead_a_turn_holds_its_slot_one_round_longer():
    args = ([rec("a", 0.0, 5, 2), rec("b", 0.0, 6, 1)], RoundPlanner(1, GRID, GRID),
            ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0))
    plain, ahead = simulate_rounds(*args), simulate_rounds(*args, launch_ahead=True)
    assert len([p for _, p in ahead.plans]) == len(plain.plans) + 1  # the round that brings a's last id back
    assert ahead.turns[1].first_token_s == plain.turns[1].first_token_s  # (that round costs no device time)
