"""A prompt's tail in its class's graph (ForwardGraphs.run_tail: padded to a multiple of TAIL_CLASS rows,
Step.valid) on qse's row-invariant kernels (QSE_KERNELS=invariant): the last id's logits, the state after the
tail and its KV rows are the bits of an eager read of the tail's ids alone. Interpreted on the CPU (the graph
path's static form, one tail); on CUDA with the graphs captured, tails across the classes and a page line."""

from __future__ import annotations

import pytest
import torch

from qse.engine.graphs import TAIL_CLASS, ForwardGraphs
from qse.engine.kv import KVPool, PagedKV
from rounds_rig import PAGE_ROWS, PROMPTS, make_engine, prefill, same_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("few_programs")]


def _compare(engine, start, tails: list[int], capture: bool) -> None:
    state, _ = start
    cfg = engine.cfg
    # room for the graphs' scratch pages and two copies of the sequence with its longest tail's class
    pool = KVPool(32, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)
    graphs = ForwardGraphs(engine.model, pool, capture=capture, max_tokens=4 * PAGE_ROWS)
    for n in tails:
        ids = [(37 * i + 11) % (engine.cfg.vocab_size - 3) for i in range(n)]
        alone = engine.restore_cache(state, PagedKV(pool))
        want, _ = engine.forward(alone, engine.ids_tensor(ids), "last")
        padded = engine.restore_cache(state, PagedKV(pool))
        assert padded.kv.ensure(state.length + graphs.tail_rows(n))
        got, _ = graphs.run_tail(padded, ids, state.length)
        assert torch.equal(got, want[-1:]), n
        assert same_state(engine.cache_state(padded), engine.cache_state(alone)), n
        alone.kv.truncate(0)
        padded.kv.truncate(0)


def test_a_padded_tail_is_the_eager_tails_bits(small_model_dir, cache_dir):
    engine = make_engine("invariant", small_model_dir, cache_dir)
    starts = prefill(small_model_dir, cache_dir, PROMPTS)
    _compare(engine, starts[0], [5], capture=False)


@pytest.mark.gpu
def test_captured_tail_graphs_are_the_eager_tails_bits(small_model_dir, cache_dir):
    engine = make_engine("invariant", small_model_dir, cache_dir)
    starts = prefill(small_model_dir, cache_dir, PROMPTS)
    tails = [2, 3, TAIL_CLASS - 1, TAIL_CLASS, TAIL_CLASS + 1, 3 * TAIL_CLASS + 7, 4 * PAGE_ROWS]
    for start in starts:  # the second one's tail starts on a page line
        _compare(engine, start, tails, capture=True)
