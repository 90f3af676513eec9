"""A prompt's tail read in its class's graph (ForwardGraphs.run_tail: the rows past it padding, Step.valid)
against the same ids read alone: the padding rows write KV rows above the real ones and step no state, so
the state after the tail, its real KV rows and the last id's logits are the tail's own. On the CPU rehearsal
of the graph path; tests/kernels/test_tail_graphs_gpu.py holds the same on the device with CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from qse.engine.graphs import TAIL_CLASS, ForwardGraphs
from qse.engine.kv import KVPool, PagedKV

GRID = 32


def _rig(engine, context_ids):
    cfg = engine.cfg
    pool = KVPool.for_budget(16 << 20, GRID, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                             engine.dtype, engine.device)
    pool.k.zero_()
    pool.v.zero_()
    cache = engine.new_cache(kv=PagedKV(pool))
    assert cache.kv.ensure(len(context_ids) + 4 * TAIL_CLASS)
    engine.forward(cache, engine.host_ids(context_ids), "none")
    return pool, cache


def _kv_rows(pool, cache, first, stop):
    out = []
    for slot in range(pool.num_slots):
        k, v = cache.kv.read(slot, stop)
        out += [k[first:], v[first:]]
    return out


@pytest.mark.parametrize("tail", [1, 2, 13, TAIL_CLASS - 1, TAIL_CLASS, TAIL_CLASS + 3])
def test_a_padded_tail_gives_the_tails_own_state_and_logits(tiny_engine, tail):
    engine = tiny_engine
    context = list(range(300, 300 + 2 * GRID + 5))  # not on a grid line: the conv window comes from both sides
    ids = list(range(2000, 2000 + tail))
    pool_a, alone = _rig(engine, context)
    pool_b, padded = _rig(engine, context)
    graphs = ForwardGraphs(engine.model, pool_b, capture=False)
    assert graphs.tail_rows(tail) % TAIL_CLASS == 0 and graphs.tail_rows(tail) >= tail
    want, _ = engine.forward(alone, engine.host_ids(ids), "last")
    got, _ = graphs.run_tail(padded, ids, len(context))
    assert padded.length == alone.length == len(context) + tail
    assert got.shape == want.shape == (1, engine.cfg.vocab_size)
    # the tiny model computes in fp32 on the CPU: the GEMMs of the padded read see more rows, which may
    # round a real row differently; the state's conv window is copied, never computed, from the inputs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for x, y in zip(padded.state_tensors(), alone.state_tensors()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    for x, y in zip(_kv_rows(pool_b, padded, len(context), padded.length),
                    _kv_rows(pool_a, alone, len(context), alone.length)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_padding_rows_never_touch_the_state_even_far_from_the_real_ones(tiny_engine):
    """A tail of 3 ids in a class of 64 rows: 61 rows of padding through one whole GDN chunk and most of
    another. Two reads of the same tail, one padded to 64 rows and one to 128, give the same bits (the same
    kernels on the same real rows; only the padding differs): padding is exactly inert."""
    engine = tiny_engine
    context = list(range(500, 500 + GRID + 7))
    ids = [7, 8, 9]
    pool_a, small = _rig(engine, context)
    pool_b, large = _rig(engine, context)
    graphs_a = ForwardGraphs(engine.model, pool_a, capture=False)
    graphs_b = ForwardGraphs(engine.model, pool_b, capture=False)
    graphs_b.tail_rows = lambda n: 2 * TAIL_CLASS  # the larger class for the same ids
    got_a, _ = graphs_a.run_tail(small, ids, len(context))
    got_b, _ = graphs_b.run_tail(large, ids, len(context))
    assert torch.equal(got_a, got_b)
    assert all(torch.equal(x, y) for x, y in zip(small.state_tensors(), large.state_tensors()))


def test_tail_rows_refuses_a_tail_it_cannot_hold(tiny_engine):
    pool, _ = _rig(tiny_engine, [1, 2, 3])
    graphs = ForwardGraphs(tiny_engine.model, pool, capture=False, max_tokens=128)
    assert graphs.tail_rows(128) == 128 and graphs.tail_rows(65) == 128
    with pytest.raises(ValueError, match="1..128 ids, not 129"):
        graphs.tail_rows(129)
    with pytest.raises(ValueError, match="not 0"):
        graphs.tail_rows(0)


def test_a_padded_tail_gives_its_rows_final_hiddens_for_the_mtp_head(tiny_engine):
    """run_tail(hidden=True): the real rows' final hiddens (the MTP head's input), as the eager read's taps."""
    engine = tiny_engine
    context = list(range(700, 700 + GRID + 3))
    ids = list(range(40, 51))
    pool_a, alone = _rig(engine, context)
    pool_b, padded = _rig(engine, context)
    taps = engine.model.new_taps(len(ids), ("final_hidden",))
    want, _ = engine.forward(alone, engine.host_ids(ids), "last", taps=taps)
    graphs = ForwardGraphs(engine.model, pool_b, capture=False)
    got, hidden = graphs.run_tail(padded, ids, len(context), hidden=True)
    assert hidden.shape == (len(ids), engine.cfg.hidden_size)
    torch.testing.assert_close(hidden, taps["final_hidden"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _, none = graphs.run_tail(padded, ids, len(context) + len(ids))
    assert none is None
