"""The sampler on the logits' device: each knob's effect on a known row, seeded draws repeat, logprobs are the
model's own, and a grammar's mask holds the choice."""

from __future__ import annotations

import math

import pytest
import torch

from qse.engine.sampling import Sampler, SampleRecord, SamplingParams

V = 16


def row(values: dict[int, float], base: float = 0.0) -> torch.Tensor:
    x = torch.full((V,), base)
    for i, v in values.items():
        x[i] = v
    return x


def test_plain_greedy_is_the_argmax_and_leaves_the_row():
    x = row({3: 2.0, 5: 2.0})
    before = x.clone()
    assert Sampler(SamplingParams())(x) == 3  # first maximum on ties
    assert torch.equal(x, before)


def test_vocab_limit_cuts_padding_rows():
    assert Sampler(SamplingParams(), vocab_limit=8)(row({12: 9.0, 2: 1.0})) == 2


def test_logit_bias_moves_the_argmax_and_leaves_the_row():
    x = row({3: 2.0, 5: 1.0})
    before = x.clone()
    assert Sampler(SamplingParams(logit_bias=((5, 5.0),)))(x) == 5
    assert Sampler(SamplingParams(logit_bias=((3, -100.0),)))(x) == 5
    assert torch.equal(x, before)


def test_penalties_count_what_was_sampled():
    # greedy, penalty 1.5: id 3 (2.0) wins, drops to 0.5; id 5 (1.0) wins, drops to -0.5; 3 wins again;
    # then a frequency penalty takes 3 to -1.0 (the zeros win) while a presence penalty charged it once
    x = row({3: 2.0, 5: 1.0})
    s = Sampler(SamplingParams(frequency_penalty=1.5))
    assert [s(x) for _ in range(4)] == [3, 5, 3, 0]
    s = Sampler(SamplingParams(presence_penalty=1.5))
    assert [s(x) for _ in range(4)] == [3, 5, 3, 3]


def test_repetition_penalty_counts_the_prompt():
    x = row({3: 2.0, 5: 1.5})
    assert Sampler(SamplingParams(repetition_penalty=2.0))(x) == 3
    assert Sampler(SamplingParams(repetition_penalty=2.0, prompt_ids=(3,)))(x) == 5  # 2.0 / 2 < 1.5
    neg = row({3: -1.0, 5: -1.5}, base=-9.0)
    assert Sampler(SamplingParams(repetition_penalty=2.0, prompt_ids=(3,)))(neg) == 5  # -1.0 * 2 < -1.5


def draws(params: SamplingParams, x: torch.Tensor, n: int = 400) -> list[int]:
    s = Sampler(params)
    return [s(x) for _ in range(n)]


def test_seeded_draws_repeat_and_follow_the_distribution():
    x = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3)))
    a = draws(SamplingParams(temperature=1.0, seed=3), x)
    assert a == draws(SamplingParams(temperature=1.0, seed=3), x)
    assert a != draws(SamplingParams(temperature=1.0, seed=4), x)
    share = a.count(0) / len(a)
    assert 0.4 < share < 0.6 and set(a) <= {0, 1, 2}


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0, top_k=2, seed=1), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.6, seed=1), {0, 1}),  # 0.5 then 0.3 reaches 0.6
    (SamplingParams(temperature=1.0, min_p=0.5, seed=1), {0, 1}),  # p >= 0.25
], ids=["top_k", "top_p", "min_p"])
def test_filters_keep_only_their_ids(params, allowed):
    x = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3)))
    got = set(draws(params, x))
    assert got == allowed


def test_logprobs_are_the_models_own_row():
    x = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3)))
    record = SampleRecord()
    s = Sampler(SamplingParams(temperature=0.0, top_logprobs=2, record=record, logit_bias=((1, 10.0),)))
    assert s(x) == 1  # the bias chose it; its logprob is the model's
    entry = record.logprobs[0]
    assert entry.token == 1 and math.isclose(entry.logprob, math.log(0.3), rel_tol=1e-5)
    assert [t for t, _ in entry.top] == [0, 1]
    assert math.isclose(entry.top[0][1], math.log(0.5), rel_tol=1e-5)


def test_bad_knobs_are_refused():
    for kwargs in ({"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"top_logprobs": 21}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3),
    SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                   prompt_ids=(1, 2, 3), logit_bias=((7, 2.0),)),
], ids=["greedy", "seeded-draw", "penalties-bias"])
def test_on_device_picks_what_the_host_path_picks(params):
    """A sampler that needs no host (no grammar, no log-probabilities) gives the same ids on the device,
    draws and penalty counts included, as the one that reads each id back."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(300, generator=gen) for _ in range(8)]
    host, device = Sampler(params, vocab_limit=280), Sampler(params, vocab_limit=280)
    assert device.is_on_device
    got = [device.on_device(r) for r in rows]
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in got)
    assert [int(t) for t in got] == [host(r) for r in rows]


def test_host_samplers_refuse_the_device_path():
    logprobs = Sampler(SamplingParams(top_logprobs=2, record=SampleRecord()))
    assert not logprobs.is_on_device
    with pytest.raises(ValueError, match="host"):
        logprobs.on_device(torch.zeros(10))


def test_a_sampled_verify_emits_ids_with_the_turns_own_law():
    """Rejection sampling through the sampler's own law (temperature, top-k): the first id's frequencies are row
    0's law, and the second id's, where the first draft was kept, row 1's (seeded draws: no flake)."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, generator=gen) * 2
    params = SamplingParams(temperature=0.7, top_k=4)
    law = Sampler(params)._law(logits.float())
    law = law / law.sum(-1, keepdim=True)
    drafts = [int(law[0].argmax()), int(law[1].argmin())]  # a likely first draft, an impossible second one
    assert float(law[1, drafts[1]]) == 0.0  # (outside the top 4)
    first, second, trials = torch.zeros(6), torch.zeros(6), 4000
    for seed in range(trials):
        ids = Sampler(replace(params, seed=seed)).verify(logits, drafts)
        assert 1 <= len(ids) <= 2 and (len(ids) == 1 or ids[0] == drafts[0])  # the second draft is never kept
        first[ids[0]] += 1
        if len(ids) == 2:
            second[ids[1]] += 1
    assert (first / trials - law[0]).abs().max() < 0.03
    assert (second / second.sum() - law[1]).abs().max() < 0.04


def test_a_greedy_verify_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    sampler = Sampler(SamplingParams())
    assert sampler.verifies == "greedy"
    assert sampler.verify(logits, [1, 0, 2]) == [1, 0, 2, 0]  # every draft kept, then the bonus id
    assert sampler.verify(logits, [1, 2, 2]) == [1, 0]  # refused at the second: the argmax there instead
    assert Sampler(SamplingParams(repetition_penalty=1.2)).verifies is None
    with pytest.raises(ValueError, match="cannot verify"):
        Sampler(SamplingParams(repetition_penalty=1.2)).verify(logits, [1])
