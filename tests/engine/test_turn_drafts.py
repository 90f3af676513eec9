"""A served turn's drafts: the predicted output's ids where the output follows it, prompt lookup elsewhere."""

from __future__ import annotations

from qse.engine.turn_drafts import PredictedOutput, TurnDrafts


def test_the_prediction_is_followed_from_its_start_through_an_edit():
    pred = PredictedOutput([10, 11, 12, 13, 14, 15, 16, 17], k=3)
    assert pred.propose([]) == [10, 11, 12]
    assert pred.propose([10]) == [11, 12, 13]
    assert pred.propose([10, 11, 12]) == [13, 14, 15]
    # an edit: the output leaves the prediction (nothing to propose), then comes back to it further on
    assert pred.propose([10, 11, 12, 99]) == []
    assert pred.propose([10, 11, 12, 99, 15]) == [16, 17]
    assert pred.propose([10, 11, 12, 99, 15, 16, 17]) == []  # its end: nothing after it


def test_a_repeated_id_is_taken_at_the_place_after_the_last_match():
    pred = PredictedOutput([5, 1, 2, 5, 3, 4, 5, 6], k=2)
    assert pred.propose([5]) == [1, 2]  # the first 5
    assert pred.propose([5, 1, 2, 5]) == [3, 4]  # the longest tail (1, 2, 5) finds the second
    assert pred.propose([5, 1, 2, 5, 3, 4, 5]) == [6]


def test_turn_drafts_fall_back_to_the_prompt_where_the_prediction_has_nothing():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    drafts = TurnDrafts(prompt, k=3, prediction_ids=[40, 41, 42, 43])
    drafts.append([40])
    assert drafts.propose() == [41, 42, 43]
    drafts.append([41, 3])  # off the prediction: 3 is in the prompt, followed by 4 5 6
    assert drafts.propose() == [4, 5, 6]
    plain = TurnDrafts(prompt, k=2)
    plain.append([7])
    assert plain.propose() == [8, 9] and plain.output == [7]
