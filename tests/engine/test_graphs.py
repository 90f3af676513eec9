"""ForwardGraphs' one-call verbs (qse/engine/graphs.py) against the explicit capture/stage/load/replay/store
sequence their callers used to spell out, bit for bit, on the CPU rehearsal of the graph path (capture=False:
the same buffers, copies and calls, each replay calling the forward again)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.graphs import ForwardGraphs
from qse.engine.kv import KVPool, PagedKV

GRID = 32


def _rig(engine):
    """A fresh pool (zeroed, so whole pools compare), its graphs and one session cache with `rows` of room."""
    cfg = engine.cfg
    pool = KVPool.for_budget(8 << 20, GRID, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                             engine.dtype, engine.device)
    pool.k.zero_()
    pool.v.zero_()
    graphs = ForwardGraphs(engine.model, pool, capture=False)
    cache = engine.new_cache(kv=PagedKV(pool))
    assert cache.kv.ensure(8 * GRID)
    return pool, graphs, cache


def _same(a, b) -> bool:
    (pool_a, _, cache_a), (pool_b, _, cache_b) = a, b
    return (cache_a.length == cache_b.length and cache_a.kv.pages == cache_b.kv.pages
            and torch.equal(pool_a.k, pool_b.k) and torch.equal(pool_a.v, pool_b.v)
            and all(torch.equal(x, y) for x, y in zip(cache_a.state_tensors(), cache_b.state_tensors())))


def _explicit_chunks(graphs, cache, ids, start, chunks):
    """What grid.py did before run_chunks: capture, stage, load, replay, store."""
    entry = graphs._prepare(len(ids), "none") if chunks == 1 else graphs._prepare_group(chunks, len(ids) // chunks)
    graphs._stage(ids, start)
    graphs._load(cache)
    graphs._replay(entry)
    graphs._store(cache)
    cache.length = start + len(ids)


def test_run_chunks_answer_and_decoding_give_the_bits_of_the_explicit_sequence(tiny_engine):
    one, old = _rig(tiny_engine), _rig(tiny_engine)
    ids = list(range(1000, 1000 + 5 * GRID))
    # one chunk, then a group of two, then a group of two again (captured entries are reused)
    for start, chunks in ((0, 1), (GRID, 2), (3 * GRID, 2)):
        piece = ids[start : start + chunks * GRID]
        begin = one[1].run_chunks(one[2], piece, start, chunks)
        assert isinstance(begin, float)  # a DeviceClock mark (the wall clock off CUDA)
        _explicit_chunks(old[1], old[2], piece, start, chunks)
        assert _same(one, old) and one[2].length == start + chunks * GRID
    # a question's forward on the working copy: the same logits; the cache's state is not written
    question, pos = list(range(40, 51)), one[2].length
    state = [t.clone() for t in one[2].state_tensors()]
    logits, gpu_ms = one[1].answer(one[2], question + [0] * 5, pos, len(question) - 1)
    entry = old[1]._prepare(16, "row")
    old[1]._stage(question + [0] * 5, pos, len(question) - 1)
    old[1]._load(old[2])
    want = old[1]._replay(entry)[0].clone()
    assert torch.equal(logits, want) and gpu_ms >= 0 and logits.shape == (tiny_engine.cfg.vocab_size,)
    assert all(torch.equal(x, y) for x, y in zip(state, one[2].state_tensors()))
    assert _same(one, old)
    # a fork's decode: an eager prefill, then one-row steps fed the device's argmax
    prompt = list(range(60, 67))
    got, want = [], []
    with one[1].decoding(one[2]) as fork:
        out = fork.prefill(prompt, pos)
        got.append(out[-1].clone())
        token = torch.argmax(out[-1:], dim=-1)
        for step in range(3):
            out = fork(token, pos + len(prompt) + step)
            got.append(out[-1].clone())
            token = torch.argmax(out[-1:], dim=-1)
    entry = old[1]._prepare(1, "last")
    old[1]._load(old[2])
    out = old[1]._forward_eager(prompt, pos, "last")
    want.append(out[-1].clone())
    token = torch.argmax(out[-1:], dim=-1)
    for step in range(3):
        old[1]._stage(token, pos + len(prompt) + step)
        out = old[1]._replay(entry)
        want.append(out[-1].clone())
        token = torch.argmax(out[-1:], dim=-1)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 4
    assert all(torch.equal(x, y) for x, y in zip(state, one[2].state_tensors()))  # never stored back
    assert _same(one, old)  # the fork's KV rows too
    with pytest.raises(RuntimeError, match="decode has ended"):
        fork(token, pos)


def test_bad_shapes_are_refused_by_name(tiny_engine):
    _, graphs, cache = _rig(tiny_engine)
    with pytest.raises(ValueError, match="cannot split into 2 equal chunks"):
        graphs.run_chunks(cache, list(range(GRID + 1)), 0, 2)
    with pytest.raises(ValueError, match="a chunk group is 2 or more chunks"):
        graphs.can_group(1, GRID)
    assert graphs.can_group(2, GRID)
    with graphs.decoding(cache) as fork, pytest.raises(ValueError, match="one token, not 2"):
        fork([1, 2], 0)


def test_warming_leaves_out_a_group_there_is_no_room_to_capture(tiny_engine, monkeypatch):
    """A served book's KV pool sized to its sessions may have no scratch pages for a 4-chunk group's capture:
    warm() keeps the groups that fit (here one of 2) instead of failing the start, and can_group then says
    which a launch may take."""
    _, graphs, _ = _rig(tiny_engine)
    prepare_group = graphs._prepare_group

    def no_room_past_two(num_chunks, rows, stages=None):
        if num_chunks > 2:
            raise MemoryError("the KV pool has no room for 4 more scratch pages")
        return prepare_group(num_chunks, rows, stages)

    monkeypatch.setattr(graphs, "_prepare_group", no_room_past_two)
    graphs.warm(GRID, group=8)
    assert [key[1] for key in graphs._entries if key[0] == "group"] == [2]
    assert graphs.can_group(2, GRID) and not graphs.can_group(4, GRID)
