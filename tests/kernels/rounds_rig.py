"""What the round-model tests share: a small engine on qse's kernels, a KV pool, rounds of prompts and the
single-sequence path (two test files, so that two CI workers take their interpreted forwards)."""

from __future__ import annotations

import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds
from qse.models import resolve

PAGE_ROWS = 64  # the attention kernels' key block divides a page
PROMPTS = [list(range(100, 110)), list(range(200, 263)), [31, 32, 33] * 9]  # the second crosses a page line
ROUNDS = 2


def make_engine(kernels: str, model_dir, cache_dir) -> Engine:
    """conftest's small model (four layers, each kind twice; a 1,000-token vocabulary: the interpreted head and
    the one-row projections stay cheap)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine(resolve(str(model_dir), torch.device(device), dtype, cache_dir), kernels=kernels)
    assert engine.kernels == kernels
    return engine


def make_pool(engine) -> KVPool:
    cfg = engine.cfg
    return KVPool(16, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)


def prefill(engine, prompts) -> list[tuple]:
    """Each prompt read once (interpreted prefills are most of these tests' time): its state and greedy next
    token, which every run below starts from (a copy: Engine.restore_cache into that run's pool)."""
    starts = []
    for prompt in prompts:
        cache = engine.new_cache(kv=PagedKV(make_pool(engine)))
        logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
        starts.append((engine.cache_state(cache), int(logits[-1].argmax())))
    return starts


def decode_rounds(engine, starts, max_running: int) -> list[list[torch.Tensor]]:
    """Each prefilled sequence's logits rows over ROUNDS rounds of all of them together (greedy tokens)."""
    pool = make_pool(engine)
    rounds = DecodeRounds(engine, pool, max_running=max_running, graphs="static")
    slots, tokens, rows = [], [], [[] for _ in starts]
    for state, token in starts:
        slots.append(rounds.admit(engine.restore_cache(state, PagedKV(pool))))
        tokens.append(token)
    for _ in range(ROUNDS):
        logits = rounds.run(slots, tokens)
        for i in range(len(starts)):
            rows[i].append(logits[i].clone())
        tokens = logits.argmax(-1).tolist()
    return rows


def decode_single(engine, start) -> list[torch.Tensor]:
    """The same through Engine.forward one token at a time (a paged cache: the same attention kernel)."""
    state, token = start
    cache = engine.restore_cache(state, PagedKV(make_pool(engine)))
    rows = []
    for _ in range(ROUNDS):
        logits, _ = engine.forward(cache, engine.ids_tensor([token]), "last")
        rows.append(logits[-1].clone())
        token = int(logits[-1].argmax())
    return rows
