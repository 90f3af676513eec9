"""Speculative rounds through the conductor on the GPU: the served sessions' verify graphs (captured per bucket
and width) with row-invariant kernels (QSE_KERNELS=invariant: a verify's rows get a one-row round's bits)
emit plain greedy decoding's ids, for turns drafting from an edited prediction beside one that drafts from its
prompt only, and the verifies really ran (drafts kept and refused)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.policy import Policy
from qse.runtime.conductor import Conductor, GenerateRequest, ShadowOptions

PROMPTS = {"a": [3000 + (i * 37) % 900 for i in range(300)], "b": [9000 + (i * 11) % 500 for i in range(700)],
           "c": [15000 + i for i in range(90)]}


def _run(resolved, tmp_path, speculate: str, predictions=None) -> tuple[dict[str, list[int]], list]:
    engine = Engine(resolved, kernels="invariant")
    policy = Policy(speculate=speculate, spec_draft=3, max_running=4, journal_dir=tmp_path / speculate)
    records: list = []
    conductor = Conductor(engine, None, ShadowOptions(mode="off"), policy, on_turn=records.append)
    assert conductor.serving.rounds.capture  # the served rounds replay CUDA graphs
    if conductor.spec_planner is not None:
        conductor.spec_planner.margin = -1.0  # verify wherever a turn drafted

    async def go():
        async def one(sid):
            req = GenerateRequest(prompt_ids=PROMPTS[sid], max_tokens=48, session_id=sid,
                                  prediction_ids=(predictions or {}).get(sid, ()))
            return [t async for t in conductor.generate(req)]

        outs = await asyncio.gather(*(one(s) for s in PROMPTS))
        await conductor.stop()
        return dict(zip(PROMPTS, outs))

    return asyncio.run(go()), records


@pytest.mark.gpu
def test_served_speculation_under_graphs_emits_plain_greedy_ids(cache_dir, tmp_path):
    torch.manual_seed(0)
    resolved = resolve("", torch.device("cuda"), torch.bfloat16, cache_dir)
    plain, _ = _run(resolved, tmp_path, "off")
    edited = {sid: tuple(t if i % 7 != 6 else (t + 1) % 40_000 for i, t in enumerate(out))
              for sid, out in plain.items() if sid != "c"}
    spec, records = _run(resolved, tmp_path, "ngram", edited)
    assert spec == plain
    kept = sum(r.accepted_draft_tokens for r in records)
    assert 0 < kept < sum(r.draft_tokens for r in records)
