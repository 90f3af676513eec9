"""Speculative decoding in the round loop (QSE_SPECULATE=ngram): turns drafting from their predicted output
(OpenAI's `prediction`: here the plain output with a few ids edited, so drafts are kept and refused) and their
own prompt and output, verified in batched rounds beside turns that do not draft, emit what plain decoding
emits (greedy: the same ids, a stop or max_tokens inside a verify's ids included), and count what they drafted
and kept.

The model runs in float64 here: a verify's rows and a plain round's one row go through matmuls of other shapes,
whose roundings differ by ~1e-16 there (~1e-7 in float32, enough to flip a near-tie of the random tiny model on
some CPU); on the row-invariant kernels the two are equal bit for bit (tests/engine/test_verify.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.sampling import SamplingParams
from qse.models import resolve
from qse.runtime.conductor import GenerateRequest

PROMPTS = {"a": [3000 + (i % 7) * 11 for i in range(90)], "b": [9000 + (i % 5) * 13 for i in range(150)],
           "c": [15000 + i for i in range(40)]}


@pytest.fixture(scope="module")
def fp64_engine(cache_dir):
    return Engine(resolve("", torch.device("cpu"), torch.float64, cache_dir))


def _edited(out: list[int]) -> tuple[int, ...]:
    """A prediction of `out` with an edit every 7 ids: drafts from it are kept up to the edit, then refused (7,
    not a multiple of a full verify's 4 ids, so an edit falls among a verify's drafts, not only on its own pick)."""
    return tuple(t if i % 7 != 6 else (t + 1) % 40_000 for i, t in enumerate(out))


async def _together(rig, max_tokens, stop_ids=(), sampling=None, predictions=None):
    async def one(sid, prompt):
        req = GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, session_id=sid, stop_ids=stop_ids,
                              sampling=sampling or SamplingParams(),
                              prediction_ids=(predictions or {}).get(sid, ()))
        return [t async for t in rig.conductor.generate(req)]

    outs = await asyncio.gather(*(one(sid, p) for sid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, outs))


def _speculating(make_rig, engine):
    rig = make_rig(engine=engine, max_running=4, speculate="ngram", spec_draft=3)
    assert rig.conductor.serving.rounds.verify_width == 4
    rig.conductor.spec_planner.margin = -1.0  # verify wherever a turn drafted: every path runs, whatever it costs
    return rig


async def test_greedy_turns_emit_plain_greedys_ids_and_count_their_drafts(make_rig, fp64_engine):
    plain = await _together(make_rig(engine=fp64_engine, max_running=4), 40)
    rig = _speculating(make_rig, fp64_engine)
    # "c" has no prediction: it drafts from its prompt and output only (it may find none), beside the others
    spec = await _together(rig, 40, predictions={"a": _edited(plain["a"]), "b": _edited(plain["b"])})
    assert spec == plain
    assert all(len(out) == 40 for out in spec.values())
    drafted = sum(r.draft_tokens for r in rig.records)
    kept = sum(r.accepted_draft_tokens for r in rig.records)
    assert 0 < kept < drafted  # drafts were kept and refused: both of a verify's paths ran
    assert all(r.accepted_draft_tokens <= r.draft_tokens for r in rig.records)
    assert rig.conductor.serving.rounds.num_free == 4  # every slot back, nothing left verifying


async def test_a_stop_or_the_last_token_inside_a_verify_ends_the_turn_there(make_rig, fp64_engine):
    plain = await _together(make_rig(engine=fp64_engine, max_running=4), 30)
    out = plain["a"]
    at = next(i for i in range(5, len(out)) if out.index(out[i]) == i)  # an id first emitted at `at`
    stop = (out[at],)
    predictions = {sid: tuple(o) for sid, o in plain.items()}  # right all along: whole verifies are kept
    plain_stopped = await _together(make_rig(engine=fp64_engine, max_running=4), 30, stop_ids=stop)
    rig = _speculating(make_rig, fp64_engine)
    spec_stopped = await _together(rig, 30, stop_ids=stop, predictions=predictions)
    assert spec_stopped == plain_stopped and spec_stopped["a"] == out[:at]
    assert sum(r.accepted_draft_tokens for r in rig.records) > 0
    short = await _together(_speculating(make_rig, fp64_engine), 7, predictions=predictions)  # max_tokens inside
    assert short == {sid: o[:7] for sid, o in plain.items()}


async def test_sampled_and_penalised_turns_run_beside_the_drafting_ones(make_rig, fp64_engine):
    rig = _speculating(make_rig, fp64_engine)
    # sampled, but so cold that the greedy prediction fits it (the tiny model's logits are close together)
    sampled = SamplingParams(temperature=1e-4, top_k=50, seed=7)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)  # cannot verify: one id a round
    assert rig.conductor.serving.rounds.verify_width == 4

    plain = await _together(make_rig(engine=fp64_engine, max_running=4), 25)

    async def one(sid, sampling):
        req = GenerateRequest(prompt_ids=PROMPTS[sid], max_tokens=25, session_id=sid, sampling=sampling,
                              prediction_ids=tuple(plain[sid]))
        return [t async for t in rig.conductor.generate(req)]

    outs = await asyncio.gather(one("a", sampled), one("b", penalised), one("c", SamplingParams()))
    assert [len(o) for o in outs] == [25, 25, 25]
    vocab = rig.conductor.served.chat.tokenizer.vocab_size
    assert all(0 <= t < vocab for o in outs for t in o)
    by_session = {r.session_id: r for r in rig.records}
    assert by_session["b"].draft_tokens == 0  # a penalised turn never drafts
    assert by_session["a"].accepted_draft_tokens > 0 and by_session["c"].accepted_draft_tokens > 0
    # the penalised turn's ids are what it gets decoding alone, one id a round
    alone = make_rig(engine=fp64_engine, max_running=4)
    req = GenerateRequest(prompt_ids=PROMPTS["b"], max_tokens=25, session_id="b", sampling=penalised)
    assert outs[2] == plain["c"]
    assert outs[1] == [t async for t in alone.conductor.generate(req)]


async def test_a_verify_with_no_pages_for_its_rows_falls_back_to_a_plain_round(make_rig, fp64_engine):
    plain = await _together(make_rig(engine=fp64_engine, max_running=4), 20)
    rig = _speculating(make_rig, fp64_engine)
    serving, real = rig.conductor.serving, rig.conductor.serving.verify_round
    refused = []

    def verify_round(turns, rows):
        if len(refused) < 3:  # the pool cannot hold the drafts' rows, three times
            refused.append(len(rows))
            raise MemoryError("the served model's KV pool cannot hold a fork")
        return real(turns, rows)

    serving.verify_round = verify_round
    spec = await _together(rig, 20, predictions={sid: tuple(o) for sid, o in plain.items()})
    assert spec == plain and len(refused) == 3
    assert sum(r.accepted_draft_tokens for r in rig.records) > 0  # later rounds verified
    assert all(r.finish_reason == "length" for r in rig.records)


async def test_turns_with_nothing_to_draft_go_back_to_rounds_launched_ahead(make_rig, fp64_engine):
    """Prompts whose lookups find nothing: after quiet_after rounds the batch's rounds are launched ahead again,
    a round in recheck_every looks once more, and the ids are plain decoding's."""
    plain = await _together(make_rig(engine=fp64_engine, max_running=4), 30)
    rig = _speculating(make_rig, fp64_engine)
    planner = rig.conductor.spec_planner
    planner.quiet_after, planner.recheck_every = 2, 5
    serving, counts = rig.conductor.serving, {"ahead": 0, "verify": 0}
    real_launch, real_verify = serving.launch_round, serving.verify_round

    def launch_round(*args, **kwargs):
        counts["ahead"] += 1
        return real_launch(*args, **kwargs)

    def verify_round(*args, **kwargs):
        counts["verify"] += 1
        return real_verify(*args, **kwargs)

    serving.launch_round, serving.verify_round = launch_round, verify_round
    spec = await _together(rig, 30, predictions={"a": (7,) * 30})  # a prediction that never fits
    assert spec == plain
    assert sum(r.draft_tokens for r in rig.records) == 0 and counts["verify"] == 0
    rounds = len(rig.probe.of("decode"))
    # every round but the first two (looking) and one in five after them (looking again, after the round in flight
    # has drained) is launched ahead
    assert rig.conductor.policy.launch_ahead and rounds // 2 < counts["ahead"] < rounds
