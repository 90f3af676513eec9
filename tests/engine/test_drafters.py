"""Prompt lookup (qse/engine/drafters.py) against its naive twin, and on the cases that name its rule."""

from __future__ import annotations

import random

import pytest

from qse.engine.drafters import PromptLookup


def naive_propose(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule spelled out: for n from max_n down, the latest i < len - n with ids[i:i+n] == ids[-n:]."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for i in range(len(ids) - n - 1, -1, -1):
            if ids[i : i + n] == ids[-n:]:
                return ids[i + n : i + n + k]
    return []


def test_the_longest_n_gram_and_its_latest_occurrence_win():
    #        0  1  2  3  4  5  6  7  8  9 10
    ids = [7, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    # "1 2 3" (n = 3) occurred at 1: what followed it (9, 2, 3, 8); "2 3" alone would say 8 (latest, at 5)
    assert PromptLookup(ids, k=4).propose() == [9, 2, 3, 8]
    assert PromptLookup(ids, k=4, max_n=2).propose() == [8, 1, 2, 3]
    assert PromptLookup([1, 2, 3, 4], k=2).propose() == []  # nothing repeats
    assert PromptLookup([5, 6, 5], k=3).propose() == [6, 5]  # the proposal stops at the context's end
    assert PromptLookup([], k=2).propose() == [] and PromptLookup([4], k=2).propose() == []


def test_append_and_rollback_move_the_context():
    d = PromptLookup([1, 2, 3], k=2)
    d.append([9, 1, 2])
    assert len(d) == 6 and d.propose() == [3, 9]
    d.rollback_to(4)  # [1, 2, 3, 9]: 9 never came before
    assert d.propose() == []
    d.append(range(10, 5004))  # growth past the first buffer (no "1 2" among them)
    d.append([1, 2])
    assert d.propose() == [3, 9] and len(d) == 5000
    with pytest.raises(ValueError, match="cannot roll back to 9000 ids: the context holds 5000"):
        d.rollback_to(9000)


def test_the_search_window_bounds_how_far_back_it_looks():
    ids = [1, 2, 3, 4] + [0] * 50 + [1, 2]
    assert PromptLookup(ids, k=2).propose() == [3, 4]
    assert PromptLookup(ids, k=2, window=20).propose() == []  # the old "1 2" is outside the newest 20 ids


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="k .* must be an integer >= 1, got 0"):
        PromptLookup(k=0)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n, got min_n=3, max_n=2"):
        PromptLookup(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="window must be None or an integer above max_n"):
        PromptLookup(window=2)


@pytest.mark.parametrize("seed", range(5))
def test_it_proposes_what_its_naive_twin_proposes(seed):
    rng = random.Random(seed)
    ids: list[int] = []
    d = PromptLookup(k=5, max_n=4, min_n=1)
    for _ in range(300):
        step = [rng.randrange(12) for _ in range(rng.randrange(1, 6))]
        ids += step
        d.append(step)
        if rng.random() < 0.1 and len(ids) > 3:
            cut = rng.randrange(len(ids))
            ids = ids[:cut]
            d.rollback_to(cut)
        assert d.propose() == naive_propose(ids, 5, 4, 1), len(ids)
