"""The MoE family served unchanged (issue 31): a tiny Qwen3.5-MoE checkpoint, as transformers writes it, through
the served turns across every tier (`qse cache-check`: bit-equal with a cold prefill), and through the
conductor with the reader beside it: turns decoded together get the ids each gets alone."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.sessions.check import run_cache_check

transformers = pytest.importorskip("transformers")

GRID = 32
VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=48, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory, cache_dir):
    torch.manual_seed(5)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**SHAPE)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:  # logits O(1), routing spread
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    out = tmp_path_factory.mktemp("moe") / "tiny-moe"
    hf.save_pretrained(out)
    engine = Engine(resolve(str(out), torch.device("cpu"), torch.float32, cache_dir))
    assert engine.resolved.family == "qwen3_5_moe"
    return engine


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cache_check_is_bit_equal_with_the_moe_served(moe_engine, tmp_path):
    prompt, lines = _ids(2 * GRID + 9, 1), []
    for n in range(5):
        if n:
            prompt = prompt + _ids(17 + 5 * n, 10 + n)
        if n == 3:  # a re-rendered earlier turn: a rollback
            prompt = prompt[:GRID + 3] + [11, 12, 13] + prompt[GRID + 6:]
        lines.append(json.dumps({"prompt_ids": prompt}))
    path = tmp_path / "session.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = run_cache_check(moe_engine, path, GRID, decode_tokens=3, edit_every=0)
    assert report["bit_equal"] is True and report["rollbacks"] == 1
    assert report["hits"] == {"device": 1, "host": 2, "disk": 1}
    assert 0 < report["cached_tokens"] < report["prompt_tokens"]


async def test_moe_turns_together_get_their_solo_ids_with_the_reader_beside(make_rig, moe_engine):
    prompts = {"a": _ids(GRID + 9, 2), "b": _ids(2 * GRID + 3, 3), "c": _ids(17, 4)}
    alone = {}
    for sid, prompt in prompts.items():
        alone[sid] = await make_rig(engine=moe_engine, max_running=4).turn(prompt, 6, session=sid)
    rig = make_rig(engine=moe_engine, max_running=4)
    together = await asyncio.gather(*(rig.turn(p, 6, session=s) for s, p in prompts.items()))
    assert dict(zip(prompts, together)) == alone
    assert max(c.num_ids for c in rig.probe.of("decode")) == 3  # they shared rounds
    assert rig.reader.engine.model is moe_engine.model  # the reader reads the same MoE weights
