"""The MoE family's MTP head served (issue 31, item 3): with a tiny Qwen3.5-MoE served and QSE_SPECULATE=mtp, turns
draft with the checkpoint's head (its decoder layer's MLP the sparse block of its own router, experts and shared
expert) through the conductor's batched verify rounds, beside prompt reads, and greedy turns emit plain greedy
decoding's ids token for token.

The model: qwen3_5_moe presets.tiny_config_dict made nearly a bigram model with a head that agrees with it often
(tests/engine/mtp_rig.py agreeing_moe_engine), so drafts are kept and refused. In float64, as test_mtp_served.py
says why (a verify's rows and a plain round's go through matmuls of other shapes on the CPU)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import ResolvedModel
from qse.models.qwen3_5_moe import Qwen35MoeModel, parse_config
from qse.models.qwen3_5_moe.presets import random_weights, tiny_config_dict
from qse.runtime.conductor import GenerateRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mtp_rig import agreeing_moe_engine  # noqa: E402

GRID = 16
# every prompt crosses grid lines and its output more; ids under the tiny MoE's vocabulary of 328
PROMPTS = {"a": [100 + (i * 37) % 200 for i in range(45)], "b": [7 + (i * 11) % 300 for i in range(70)],
           "c": [200 + i % 100 for i in range(20)]}
CONFIG = dict(max_running=4, served_grid=GRID, round_token_budget=GRID, spec_draft=3, served_kv_gb=0.05)
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def moe_mtp_engine(tiny_engine) -> Engine:
    engine = agreeing_moe_engine(tiny_engine.resolved.chat)  # the embedded model's chat: its stop and turn-end ids
    assert engine.resolved.family == "qwen3_5_moe" and engine.cfg.mtp_num_hidden_layers == 1
    return engine


def _rig(make_rig, engine, speculate: str = "off"):
    rig = make_rig(engine=engine, speculate=speculate, **CONFIG)
    if rig.conductor.spec_planner is not None:
        rig.conductor.spec_planner.margin = -1.0  # verify wherever a turn drafted: every path runs
    return rig


async def _together(rig) -> dict[str, list[int]]:
    async def one(sid, prompt):
        req = GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, session_id=sid)
        return [t async for t in rig.conductor.generate(req)]

    outs = await asyncio.gather(*(one(sid, p) for sid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, outs))


async def test_moe_mtp_greedy_turns_emit_plain_greedys_ids(make_rig, moe_mtp_engine):
    plain = await _together(_rig(make_rig, moe_mtp_engine))
    rig = _rig(make_rig, moe_mtp_engine, "mtp")
    serving = rig.conductor.serving
    assert serving.mtp and serving.rounds.mtp is moe_mtp_engine.model.mtp_head()
    blocks = []
    real = moe_mtp_engine.model.moe_block

    def watched(h, router_w, *rest):
        blocks.append(router_w)
        return real(h, router_w, *rest)

    moe_mtp_engine.model.moe_block = watched
    try:
        spec = await _together(rig)
    finally:
        moe_mtp_engine.model.moe_block = real
    assert spec == plain
    assert all(len(out) == MAX_TOKENS for out in spec.values())
    drafted = sum(r.draft_tokens for r in rig.records)
    kept = sum(r.accepted_draft_tokens for r in rig.records)
    assert 0 < kept < drafted  # drafts kept and refused: both of a verify's paths ran
    head_router = moe_mtp_engine.model.w["mtp.layers.0.mlp.gate.weight"]
    assert any(w is head_router for w in blocks)  # the head's drafts ran its own sparse block
    assert serving.rounds.num_free == 4  # every slot back


def test_a_moe_model_without_its_head_is_refused(make_rig, tiny_engine):
    cfg = parse_config(tiny_config_dict(mtp_num_hidden_layers=0))
    model = Qwen35MoeModel(cfg, random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    headless = Engine(ResolvedModel(model, tiny_engine.resolved.chat, "tiny-moe", "random", model.family, "tiny-moe"))
    with pytest.raises(ValueError, match=r"the served model 'tiny-moe' has none \(its config has "
                                         r"mtp_num_hidden_layers=0\)"):
        make_rig(engine=headless, speculate="mtp")
