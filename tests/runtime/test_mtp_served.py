"""The MTP head served (QSE_SPECULATE=mtp): turns draft with the checkpoint's MTP head on the device after every
round, verified in batched rounds through the conductor, and emit what plain decoding emits (greedy: the same ids,
token for token), across grid lines, in rounds where other turns still read their prompts, beside a sampled turn;
a session stored and restored (the head's rows then stale) stays exact; a model without a head is refused.

The model: a tiny Qwen3.5 with an MTP head (presets.tiny_mtp_config_dict), made nearly a bigram model with a head
that agrees with it often (tests/engine/mtp_rig.py), so drafts are kept and refused. In float64, as
tests/runtime/test_speculative_rounds.py says why (a verify's rows and a plain round's go through matmuls of other
shapes on the CPU)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from qse.engine.engine import Engine
from qse.engine.rounds import mtp_kv_slot, pool_slots_for
from qse.engine.sampling import SamplingParams
from qse.policy import Policy
from qse.runtime.conductor import GenerateRequest
from qse.store import ShadowStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mtp_rig import agreeing_engine  # noqa: E402

GRID = 16
# every prompt crosses grid lines (read in whole chunks, one a round: the others decode meanwhile) and its output
# crosses more; ids under the tiny model's vocabulary of 512
PROMPTS = {"a": [100 + (i * 37) % 300 for i in range(45)], "b": [7 + (i * 11) % 400 for i in range(100)],
           "c": [300 + i % 150 for i in range(20)]}
CONFIG = dict(max_running=4, served_grid=GRID, round_token_budget=GRID, spec_draft=3, served_kv_gb=0.05)


@pytest.fixture(scope="module")
def mtp_engine(tiny_engine) -> Engine:
    return agreeing_engine(tiny_engine.resolved.chat)  # the embedded model's chat: its stop and turn-end ids


def _rig(make_rig, engine, speculate: str = "off", **config):
    rig = make_rig(engine=engine, speculate=speculate, **{**CONFIG, **config})
    if rig.conductor.spec_planner is not None:
        rig.conductor.spec_planner.margin = -1.0  # verify wherever a turn drafted: every path runs
    return rig


async def _together(rig, max_tokens: int, sampling: dict[str, SamplingParams] | None = None) -> dict[str, list[int]]:
    async def one(sid, prompt):
        req = GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, session_id=sid,
                              sampling=(sampling or {}).get(sid, SamplingParams()))
        return [t async for t in rig.conductor.generate(req)]

    outs = await asyncio.gather(*(one(sid, p) for sid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, outs))


def _order(serving) -> list[str]:
    """The served calls in order, by name: a prompt's grid chunks, a round launched ahead, a verify."""
    order: list[str] = []
    for name in ("read_chunks", "launch_round", "verify_round"):
        real = getattr(serving, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            order.append(_name)
            return _real(*args, **kwargs)

        setattr(serving, name, wrapped)
    return order


async def _plain(make_rig, engine, max_tokens: int) -> dict[str, list[int]]:
    return await _together(_rig(make_rig, engine), max_tokens)


async def test_mtp_greedy_turns_emit_plain_greedys_ids_beside_prompt_reads(make_rig, mtp_engine):
    plain = await _plain(make_rig, mtp_engine, 40)
    rig = _rig(make_rig, mtp_engine, "mtp")
    serving = rig.conductor.serving
    assert serving.mtp and serving.rounds.verify_width == 4
    pool = serving.book.pool
    assert pool.num_slots == pool_slots_for(mtp_engine.cfg, mtp=True) == mtp_kv_slot(mtp_engine.cfg) + 1
    order = _order(serving)
    spec = await _together(rig, 40)
    assert spec == plain
    assert all(len(out) == 40 for out in spec.values())
    drafted = sum(r.draft_tokens for r in rig.records)
    kept = sum(r.accepted_draft_tokens for r in rig.records)
    assert 0 < kept < drafted  # drafts kept and refused: both of a verify's paths ran
    # rounds verified while a prompt was still being read a chunk a round
    assert "verify_round" in order and "read_chunks" in order[order.index("verify_round"):]
    assert serving.rounds.num_free == 4  # every slot back


async def test_rounds_launched_ahead_keep_the_head_drafting(make_rig, mtp_engine):
    """Where no verify pays (the planner's first picks here) the turns go quiet and their rounds are launched
    ahead, the head following each on the device's ids; when a verify pays again its drafts are current, and the
    ids are plain decoding's. (One turn: a batch's rounds are launched ahead only while none of its turns looks.)"""
    plain = await _rig(make_rig, mtp_engine).turn(PROMPTS["b"], 40, session="b")
    rig = _rig(make_rig, mtp_engine, "mtp")
    planner = rig.conductor.spec_planner
    planner.quiet_after, planner.recheck_every = 2, 4
    real, picks = planner.choose, []

    def choose(bucket, drafts):
        picks.append(bucket)
        return 1 if len(picks) <= 3 else real(bucket, drafts)  # no verify pays, three times: the turn goes quiet

    planner.choose = choose
    order = _order(rig.conductor.serving)
    assert await rig.turn(PROMPTS["b"], 40, session="b") == plain
    assert "launch_round" in order and "verify_round" in order[order.index("launch_round"):]
    assert rig.records[-1].accepted_draft_tokens > 0


async def test_a_sampled_turn_verifies_beside_greedy_ones(make_rig, mtp_engine):
    plain = await _plain(make_rig, mtp_engine, 30)
    rig = _rig(make_rig, mtp_engine, "mtp")
    sampled = SamplingParams(temperature=0.7, top_k=50, seed=7)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)  # cannot verify: one id a round
    spec = await _together(rig, 30, {"a": sampled, "c": penalised})
    assert spec["b"] == plain["b"]
    assert [len(out) for out in spec.values()] == [30, 30, 30]
    assert all(0 <= t < mtp_engine.cfg.vocab_size for out in spec.values() for t in out)
    by_session = {r.session_id: r for r in rig.records}
    assert by_session["a"].draft_tokens > 0 and by_session["c"].draft_tokens == 0
    alone = _rig(make_rig, mtp_engine)  # the penalised turn's ids are what it gets decoding alone
    req = GenerateRequest(prompt_ids=PROMPTS["c"], max_tokens=30, session_id="c", sampling=penalised)
    assert spec["c"] == [t async for t in alone.conductor.generate(req)]


async def test_drafts_past_the_tokenizer_s_vocabulary_are_cut(make_rig, mtp_engine):
    """A head's argmax may pick a padding row of the model's vocabulary (ids the tokenizer does not have): the
    draft is cut there, so a sampled turn's verify never indexes its law past it and greedy ids stay plain's."""
    plain = await _plain(make_rig, mtp_engine, 20)
    rig = _rig(make_rig, mtp_engine, "mtp")
    serving = rig.conductor.serving
    limit = rig.conductor.served.chat.tokenizer.vocab_size
    real = serving.head_drafts

    def head_drafts(turns):
        return [d[:1] + [limit + 3] + d[2:] if d else d for d in real(turns)]  # the second id past the tokenizer's

    serving.head_drafts = head_drafts
    spec = await _together(rig, 20, {"c": SamplingParams(temperature=0.7, seed=1)})
    assert {sid: spec[sid] for sid in "ab"} == {sid: plain[sid] for sid in "ab"}
    assert len(spec["c"]) == 20
    assert all(r.accepted_draft_tokens <= r.draft_tokens for r in rig.records)


async def test_a_restored_session_with_stale_head_rows_stays_exact(make_rig, mtp_engine, tmp_path):
    """A session parked on disk and read back carries the target's rows only: its pages come back with whatever
    the head's slot held (here another session's head rows, written meanwhile), and the next turn's ids are
    still plain decoding's."""
    store = ShadowStore(1 << 40, tmp_path / "served")
    rig = _rig(make_rig, mtp_engine, "mtp", served_residency=store)
    book = rig.conductor.serving.book
    first = PROMPTS["b"][:70]
    out1 = await rig.turn(first, 12, session="a")
    assert await rig.conductor.served_exec.run(store.park, book, book.get("a"))
    await rig.turn(PROMPTS["a"], 20, session="b")  # its head rows land in the pages a gave back
    nxt = first + out1 + PROMPTS["c"]
    out2 = await rig.turn(nxt, 30, session="a")
    record = rig.records[-1]
    assert record.cache_tier in ("host", "disk") and record.cached_tokens > 0
    assert record.draft_tokens > 0
    cold = _rig(make_rig, mtp_engine)
    assert out1 == await cold.turn(first, 12, session="a")
    assert out2 == await cold.turn(nxt, 30, session="a2")


def test_qse_serve_refuses_mtp_on_a_model_without_a_head(cache_dir, tmp_path):
    """At start, before the served pool is made: the embedded default model ships no MTP head."""
    from qse.server.cli import build_service
    from qse.settings import EngineSettings

    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_MODEL": "",
                               "QSE_LEDGER": str(tmp_path / "usage.jsonl"), "QSE_SPECULATE": "mtp"})
    with pytest.raises(ValueError, match=r"QSE_SPECULATE=mtp .* 'qse-tiny-qwen3.5-v1' has none"):
        build_service(profile="default", device="cpu", dtype="float32", settings=settings)


def test_a_model_without_an_mtp_head_is_refused(make_rig):
    with pytest.raises(ValueError, match=r"QSE_SPECULATE=mtp drafts with the served checkpoint's MTP head, and the "
                                         r"served model 'qse-tiny-qwen3.5-v1' has none \(its config has "
                                         r"mtp_num_hidden_layers=0\): serve a checkpoint that ships one"):
        make_rig(speculate="mtp")
    with pytest.raises(ValueError, match=r"QSE_SPECULATE='eagle' is not one of \('off', 'ngram', 'mtp'\)"):
        Policy(speculate="eagle")


async def test_a_turn_whose_drafts_are_refused_stops_verifying_and_tries_again_rarely(make_rig, mtp_engine):
    """A head whose drafts are all refused (here: each id shifted off the head's pick) would make every round a
    verify that keeps nothing and cost the rounds their launch ahead. After a few misses the turn stops looking:
    its rounds are launched ahead, the head reading their rows and drafting nothing (k = 0) except before a round
    where it will look, and it tries again, with that one id, ever more rarely; its ids stay plain decoding's."""
    plain = await _rig(make_rig, mtp_engine).turn(PROMPTS["b"], 60, session="b")
    rig = make_rig(engine=mtp_engine, speculate="mtp", **CONFIG)
    planner = rig.conductor.spec_planner
    planner.cost_ms = lambda bucket, width: 1.0 + 0.15 * (width - 1)  # the prior's prices, never the CPU's clock
    serving = rig.conductor.serving
    limit = rig.conductor.served.chat.tokenizer.vocab_size
    real_drafts, real_verify = serving.head_drafts, serving.verify_round
    widths: list[int] = []

    def head_drafts(turns):
        return [[(t + 1) % limit for t in d] for d in real_drafts(turns)]

    def verify_round(turns, rows):
        widths.append(len(rows[0]))
        return real_verify(turns, rows)

    follow_ks: list[int | None] = []
    real_follow = serving.follow_round

    def follow_round(turns, next_ids, accepted=None, k=None):
        follow_ks.append(k)
        return real_follow(turns, next_ids, accepted, k=k)

    serving.head_drafts, serving.verify_round, serving.follow_round = head_drafts, verify_round, follow_round
    order = _order(serving)
    assert await rig.turn(PROMPTS["b"], 60, session="b") == plain
    record = rig.records[-1]
    assert record.accepted_draft_tokens == 0 and record.draft_tokens > 0
    assert order.count("launch_round") >= 40  # most of its 60 rounds launched ahead
    assert 2 <= len(widths) <= 5  # a verify every round or two without the back-off
    first_launch = order.index("launch_round")
    assert "verify_round" in order[first_launch:]  # it tried again, after rounds launched ahead,
    assert widths[-1] == 2  # with the one id the head drafted after a plain round
    assert follow_ks.count(0) >= 30  # most rounds: the head's rows alone, no output head
    assert 1 <= follow_ks.count(1) <= len(widths) + 1  # one id drafted only before a round that looks
