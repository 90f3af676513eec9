"""What the round-model tests share: a small engine on qse's kernels, a KV pool, rounds of prompts and the
single-sequence path (two test files, so that two CI workers take their interpreted forwards)."""

from __future__ import annotations

import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds
from qse.models import ResolvedModel, resolve
from qse.models.qwen3_5 import Qwen35Model, parse_config
from qse.models.qwen3_5.presets import random_weights, tiny_mtp_config_dict
from qse.models.qwen3_5_moe import Qwen35MoeModel
from qse.models.qwen3_5_moe import parse_config as parse_moe_config
from qse.models.qwen3_5_moe import presets as moe_presets
from qse.models.state import ModelState

PAGE_ROWS = 64  # the attention kernels' key block divides a page
# two lengths; the second fills its first page, so its round's row crosses the page line (a page taken in the round)
PROMPTS = [list(range(100, 110)), list(range(200, 200 + PAGE_ROWS))]
# One round, then every sequence's whole state compared bit for bit (its GDN state and every KV row, the round's
# own included): what a second round would read, checked directly at no interpreted forward's cost.
ROUNDS = 1


def make_engine(kernels: str, model_dir, cache_dir) -> Engine:
    """conftest's small model (four layers, each kind twice; a 328-token vocabulary: the interpreted head and
    the one-row projections stay cheap)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine(resolve(str(model_dir), torch.device(device), dtype, cache_dir), kernels=kernels)
    assert engine.kernels == kernels
    return engine


def tiny_mtp_engine(kernels: str, family: str = "dense") -> Engine:
    """A tiny random Qwen3.5 with an MTP head (presets.tiny_mtp_config_dict, the embedded model's GDN head dims),
    or a tiny Qwen3.5-MoE with its MoE head (family "moe"), in bf16 on the GPU."""
    if family == "moe":
        cfg = parse_moe_config(moe_presets.tiny_config_dict())
        model = Qwen35MoeModel(cfg, moe_presets.random_weights(cfg, 0, "cuda", torch.bfloat16), "cuda", torch.bfloat16)
    else:
        cfg = parse_config(tiny_mtp_config_dict(linear_key_head_dim=32, linear_value_head_dim=32))
        model = Qwen35Model(cfg, random_weights(cfg, 0, "cuda", torch.bfloat16), "cuda", torch.bfloat16)
    return Engine(ResolvedModel(model, None, f"tiny-mtp-{family}", "random", model.family, "tiny-mtp-gpu"),
                  kernels=kernels)


def make_pool(engine) -> KVPool:
    cfg = engine.cfg
    return KVPool(16, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)


def prefill(model_dir, cache_dir, prompts) -> list[tuple]:
    """Each prompt read once, on the torch twins (QSE_KERNELS=naive: the runs below, not the prompts, are what
    these tests compare, and an interpreted prefill cost more than a round): its state and greedy next token,
    which every run below starts from (a copy: Engine.restore_cache into that run's pool, on the engine under
    test; the model is the same, so is its state's manifest)."""
    engine = make_engine("naive", model_dir, cache_dir)
    starts = []
    for prompt in prompts:
        cache = engine.new_cache(kv=PagedKV(make_pool(engine)))
        logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
        starts.append((engine.cache_state(cache), int(logits[-1].argmax())))
    return starts


def decode_rounds(engine, starts, max_running: int,
                  buckets=None) -> tuple[list[list[torch.Tensor]], list[ModelState], int]:
    """Each prefilled sequence's logits rows over ROUNDS rounds of all of them together (greedy tokens), its
    state after them (Engine.cache_state of the cache its slot is released into), and the bucket the rounds ran
    (rows past len(starts) are padding)."""
    pool = make_pool(engine)
    rounds = DecodeRounds(engine, pool, max_running=max_running, graphs="static", buckets=buckets)
    slots, tokens, rows = [], [], [[] for _ in starts]
    for state, token in starts:
        slots.append(rounds.admit(engine.restore_cache(state, PagedKV(pool))))
        tokens.append(token)
    for _ in range(ROUNDS):
        logits = rounds.run(slots, tokens)
        for i in range(len(starts)):
            rows[i].append(logits[i].clone())
        tokens = logits.argmax(-1).tolist()
    return rows, [engine.cache_state(rounds.release(slot)) for slot in slots], rounds.bucket(len(slots))


def decode_single(engine, start) -> tuple[list[torch.Tensor], ModelState]:
    """The same through Engine.forward one token at a time (a paged cache: the same attention kernel)."""
    state, token = start
    cache = engine.restore_cache(state, PagedKV(make_pool(engine)))
    rows = []
    for _ in range(ROUNDS):
        logits, _ = engine.forward(cache, engine.ids_tensor([token]), "last")
        rows.append(logits[-1].clone())
        token = int(logits[-1].argmax())
    return rows, engine.cache_state(cache)


def same_state(a: ModelState, b: ModelState) -> bool:
    """Bit equality of two ModelStates: the length, every section (GDN conv and recurrent state) and every view
    (the KV rows [0, length))."""
    return (a.length == b.length and a.sections.keys() == b.sections.keys() and a.views.keys() == b.views.keys()
            and all(torch.equal(a.sections[k], b.sections[k]) for k in a.sections)
            and all(torch.equal(a.views[k], b.views[k]) for k in a.views))
