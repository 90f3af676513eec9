"""The MTP head served on the GPU (QSE_SPECULATE=mtp): the conductor's rounds, verifies and the head's drafts
replayed from CUDA graphs on the row-invariant kernels (QSE_KERNELS=invariant: a verify's rows, and a tail read
with the final-hidden taps, get the bits of plain decoding's rows) emit plain greedy decoding's ids token for
token, for turns across grid lines that start while others decode, beside a sampled turn; drafts are kept and
refused. A tiny Qwen3.5 with an MTP head that agrees with it often (tests/engine/mtp_rig.py), in bf16.

Run on a device from the repository root:
    python -m pytest -q -p no:cacheprovider tests/runtime/test_mtp_served_gpu.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.sampling import SamplingParams
from qse.models import resolve
from qse.policy import Policy
from qse.runtime.conductor import Conductor, GenerateRequest, ShadowOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mtp_rig import agreeing_engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GRID = 64  # a page: the attention kernels' key block divides it
PROMPTS = {"a": [100 + (i * 37) % 300 for i in range(300)], "b": [7 + (i * 11) % 400 for i in range(700)],
           "c": [300 + i % 150 for i in range(90)]}
SAMPLED = "d"  # a sampled turn beside the greedy ones (its own law: compared for validity, not with plain)


def _resolved(cache_dir):
    chat = resolve("", torch.device("cpu"), torch.float32, cache_dir).chat  # the embedded model's tokenizer
    return agreeing_engine(chat, torch.bfloat16, "cuda", linear_key_head_dim=32, linear_value_head_dim=32).resolved


def _run(resolved, tmp_path, speculate: str) -> tuple[dict[str, list[int]], list, Conductor]:
    engine = Engine(resolved, kernels="invariant")
    policy = Policy(speculate=speculate, spec_draft=3, max_running=4, served_grid=GRID, round_token_budget=GRID,
                    served_kv_gb=0.25, journal_dir=tmp_path / speculate)
    records: list = []
    conductor = Conductor(engine, None, ShadowOptions(mode="off"), policy, on_turn=records.append)
    assert conductor.serving.rounds.capture  # the served rounds replay CUDA graphs
    if conductor.spec_planner is not None:
        conductor.spec_planner.margin = -1.0  # verify wherever a turn drafted

    async def go():
        async def one(sid, prompt, sampling):
            req = GenerateRequest(prompt_ids=prompt, max_tokens=48, session_id=sid, sampling=sampling)
            return [t async for t in conductor.generate(req)]

        jobs = [one(sid, p, SamplingParams()) for sid, p in PROMPTS.items()]
        jobs.append(one(SAMPLED, PROMPTS["c"][::-1], SamplingParams(temperature=0.8, top_k=40, seed=3)))
        outs = await asyncio.gather(*jobs)
        await conductor.stop()
        return dict(zip([*PROMPTS, SAMPLED], outs))

    return asyncio.run(go()), records, conductor


def test_served_mtp_under_graphs_emits_plain_greedy_ids(cache_dir, tmp_path):
    torch.manual_seed(0)
    resolved = _resolved(cache_dir)
    plain, _, _ = _run(resolved, tmp_path, "off")
    spec, records, conductor = _run(resolved, tmp_path, "mtp")
    assert {sid: spec[sid] for sid in PROMPTS} == {sid: plain[sid] for sid in PROMPTS}
    assert len(spec[SAMPLED]) == 48 and all(0 <= t < resolved.model.cfg.vocab_size for t in spec[SAMPLED])
    greedy = [r for r in records if r.session_id in PROMPTS]
    kept, drafted = sum(r.accepted_draft_tokens for r in greedy), sum(r.draft_tokens for r in greedy)
    assert 0 < kept < drafted  # drafts were kept and refused: both of a verify's paths ran
    assert next(r for r in records if r.session_id == SAMPLED).draft_tokens > 0
    rounds = conductor.serving.rounds
    assert rounds.mtp is not None and any(len(key) == 3 for key in rounds._entries)  # the head's draft graphs
