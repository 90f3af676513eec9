"""Verification of a drafter's tokens (qse/engine/speculative.py): greedy keeps exactly the greedy ids,
rejection sampling emits the served model's law. The laws are checked on many rows drawn at a fixed seed: the
figures are the same on every run, so the bounds hold or fail for good, never by chance."""

from __future__ import annotations

import pytest
import torch

from qse.engine.speculative import accept_greedy, accept_sampled


def test_greedy_keeps_the_longest_agreeing_prefix_then_the_targets_pick():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 7, 9],   # all three kept: the bonus pick after them
                           [5, 6, 8, 9],   # the third refused: the target's 8 instead
                           [4, 6, 7, 9],   # the first refused, the later agreement does not count
                           [1, 2, 3, 3]])
    accepted, nxt = accept_greedy(drafts, target)
    assert accepted.tolist() == [3, 2, 0, 3] and nxt.tolist() == [9, 8, 4, 3]


def test_greedy_emits_the_plain_greedy_ids_whatever_the_drafts():
    """The ids greedy verification emits (kept drafts, then the next) are the target's own picks, in order."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, 4, (500, 5), generator=gen)
    drafts = torch.where(torch.rand(500, 4, generator=gen) < 0.7, target[:, :4], torch.randint(0, 4, (500, 4), generator=gen))
    accepted, nxt = accept_greedy(drafts, target)
    for row in range(500):
        a = int(accepted[row])
        emitted = drafts[row, :a].tolist() + [int(nxt[row])]
        assert emitted == target[row, : a + 1].tolist()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"k \+ 1 = 3 rows for each of the 2 turns"):
        accept_greedy(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"draft_probs must be \[batch, k, vocab\]"):
        accept_sampled(torch.zeros(2, 2, dtype=torch.long), torch.full((2, 3, 4), 0.25), torch.full((2, 1, 4), 0.25))


def _laws(rows: int, steps: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    base = torch.rand(steps, vocab, generator=gen) ** 2
    return (base / base.sum(-1, keepdim=True)).expand(rows, steps, vocab).contiguous()


@pytest.mark.parametrize("one_hot", [False, True], ids=["drawn-from-q", "one-hot-drafter"])
def test_rejection_sampling_emits_the_targets_law(one_hot):
    """Every emitted id is distributed as the served model's law at its row: the first as p0 whatever the
    drafter's law, and the second, among rows that kept the first draft, as p1."""
    rows, k, vocab = 200_000, 2, 6
    gen = torch.Generator().manual_seed(1234)
    p = _laws(rows, k + 1, vocab, gen)
    q = _laws(rows, k, vocab, gen)
    # drafts drawn from q; a one-hot drafter declares no law (each draft is certain to it), whatever chose it
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, k)
    accepted, nxt = accept_sampled(drafts, p, None if one_hot else q, gen)
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=vocab).double() / rows
    assert torch.allclose(freq, p[0, 0].double(), atol=0.005), (freq, p[0, 0])  # 5 sigma at 200k rows
    if not one_hot:
        kept = accepted >= 1
        second = torch.where(accepted[kept] >= 2, drafts[kept, 1], nxt[kept])
        freq2 = torch.bincount(second, minlength=vocab).double() / int(kept.sum())
        assert torch.allclose(freq2, p[0, 1].double(), atol=0.01), (freq2, p[0, 1])


def test_a_draft_the_target_never_picks_is_never_kept_and_certainty_always_is():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]).expand(1000, 2, 3).contiguous()
    gen = torch.Generator().manual_seed(3)
    accepted, nxt = accept_sampled(torch.zeros(1000, 1, dtype=torch.long), p, None, gen)
    assert accepted.eq(0).all() and nxt.eq(1).all()  # refused, and the residual is the target's own pick
    accepted, nxt = accept_sampled(torch.ones(1000, 1, dtype=torch.long), p, None, gen)
    assert accepted.eq(1).all() and nxt.eq(2).all()  # kept, then the bonus from the next row


def test_at_temperature_zero_sampling_verifies_as_greedy_does():
    """One-hot target laws (greedy): rejection sampling keeps and emits exactly what greedy verification does."""
    gen = torch.Generator().manual_seed(5)
    picks = torch.randint(0, 8, (300, 4), generator=gen)
    p = torch.nn.functional.one_hot(picks, 8).float()
    drafts = torch.where(torch.rand(300, 3, generator=gen) < 0.6, picks[:, :3], torch.randint(0, 8, (300, 3), generator=gen))
    assert all(torch.equal(a, b) for a, b in zip(accept_sampled(drafts, p, None, gen), accept_greedy(drafts, picks)))
