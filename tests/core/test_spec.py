"""The speculative rounds' planner: tokens a verify earns, widths chosen from measured costs and acceptance."""

from __future__ import annotations

import pytest

from qse.core.spec import SpecPlanner, expected_tokens


def test_expected_tokens_is_the_next_token_plus_a_geometric_series():
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_no_verify_before_the_plain_round_is_measured_or_without_drafts():
    planner = SpecPlanner((4,))
    assert planner.choose(8, [(3, 0.9)] * 8) == 1  # nothing measured: no price for a verify
    planner.observe_round(8, 1, 6.0)
    assert planner.choose(8, [(0, 0.9)] * 8) == 1  # nobody drafted
    assert planner.choose(8, [(3, 0.9)] * 8) == 4


def test_a_verify_that_costs_more_than_its_drafts_earn_is_not_run():
    planner = SpecPlanner((4,))
    planner.observe_round(1, 1, 4.0)
    planner.observe_round(1, 4, 4.0 * 1.45)  # measured: 1.45x a plain round
    assert planner.choose(1, [(3, 0.2)]) == 1  # 1.25 tokens for 1.45x the cost
    assert planner.choose(1, [(3, 0.7)]) == 4  # 2.53 tokens for 1.45x
    # the measured cost wins over the prior: the same drafts at a verify priced 3x
    for _ in range(30):
        planner.observe_round(1, 4, 12.0)
    assert planner.cost_ms(1, 4) == pytest.approx(12.0, rel=0.01)
    assert planner.choose(1, [(3, 0.7)]) == 1


def test_the_widest_paying_width_wins_and_short_drafts_count_as_what_they_are():
    planner = SpecPlanner((2, 4), prior_row_cost=0.1)
    planner.observe_round(1, 1, 5.0)
    assert planner.choose(1, [(1, 0.9)]) == 2  # one draft: a 4-row verify reads two rows it cannot use
    assert planner.choose(1, [(3, 0.9)]) == 4


def test_a_turns_rate_follows_its_drafts_and_drifts_back_when_it_stops_drafting():
    planner = SpecPlanner((4,), prior_alpha=0.5)
    turn = planner.new_turn()
    for _ in range(10):
        planner.observe_turn(turn, 3, 0)
    assert turn.alpha < 0.01
    for _ in range(10):
        planner.observe_turn(turn, 3, 3)
    assert turn.alpha > 0.75
    low = planner.new_turn()
    planner.observe_turn(low, 3, 0)
    before = low.alpha
    for _ in range(20):
        planner.observe_turn(low, 0, 0)  # rounds it did not draft in
    assert before < low.alpha < planner.prior_alpha


def test_a_turn_that_sent_a_prediction_starts_and_drifts_back_at_the_prediction_s_rate():
    """A request's prediction is text the answer is expected to repeat: its turn is priced at prediction_alpha,
    so a verify is tried where a turn at the plain prior would not pay for one (here: a 4-row verify at 2.2x a
    round, as on a CPU); its misses still pull it down, and idle rounds back to its own prior."""
    planner = SpecPlanner((4,), prior_alpha=0.5, prediction_alpha=0.9)
    planner.observe_round(1, 1, 1.0)
    planner.observe_round(1, 4, 2.2)
    plain, predicted = planner.new_turn(), planner.new_turn(predicted=True)
    assert (plain.alpha, predicted.alpha) == (0.5, 0.9)
    assert not planner.looks(plain, 1) and planner.looks(predicted, 1)
    planner.observe_turn(predicted, 3, 0)
    low = predicted.alpha
    for _ in range(40):
        planner.observe_turn(predicted, 0, 0)
    assert low < predicted.alpha < 0.9 and predicted.alpha > planner.prior_alpha
    with pytest.raises(ValueError, match="prediction_alpha must lie in"):
        SpecPlanner((4,), prediction_alpha=1.5)


@pytest.mark.parametrize("widths", [(), (1,), (0, 4)])
def test_bad_widths_are_refused_by_value(widths):
    with pytest.raises(ValueError, match="widths"):
        SpecPlanner(widths)


def test_a_turn_that_finds_no_draft_looks_again_only_now_and_then():
    planner = SpecPlanner((4,), quiet_after=2, recheck_every=3)
    turn = planner.new_turn()
    looked = []
    for _ in range(10):
        looked.append(planner.looks(turn))
        planner.observe_turn(turn, 0, 0)  # nothing found (or not looked)
    assert looked == [True, True, True, False, False, True, False, False, True, False]
    planner.observe_turn(turn, 3, 2)  # a draft found: it looks every round again
    assert turn.quiet_rounds == 0 and planner.looks(turn)


def test_a_turn_whose_verifies_keep_nothing_stops_looking_and_backs_off():
    planner = SpecPlanner((2, 4))
    planner.observe_round(1, 1, 5.0)
    planner.observe_round(1, 2, 5.4)
    planner.observe_round(1, 4, 5.7)
    turn = planner.new_turn()
    assert planner.looks(turn, 1)  # the prior rate pays
    tries = []
    for step in range(1000):
        if planner.looks(turn, 1):  # (looking: a full draft at its rate pays)
            tries.append(step)
            planner.observe_turn(turn, 3, 0)  # refused
        else:
            planner.observe_turn(turn, 0, 0)  # a plain round
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert 3 <= len(tries) <= 12  # (every ~4 rounds, ~250 tries, without the back-off)
    assert gaps == sorted(gaps) and gaps[-1] > 8 * max(gaps[0], 1)  # ever more rarely
    kept = planner.new_turn()
    for _ in range(20):
        assert planner.looks(kept, 1)
        planner.observe_turn(kept, 3, 2)  # drafts kept: it looks every round
    assert kept.misses == 0


def test_a_turn_looks_while_the_plain_round_is_unmeasured():
    planner = SpecPlanner((4,))
    turn = planner.new_turn()
    for _ in range(3):
        planner.observe_turn(turn, 3, 0)
    assert planner.looks(turn, 8)  # bucket 8 unmeasured: a verify measures it
    planner.observe_round(8, 1, 6.0)
    assert not planner.looks(turn, 8) and planner.looks(turn)  # no bucket: the quiet rule alone
