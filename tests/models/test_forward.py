"""The torch forward on the embedded default: determinism, grid exactness, bad input."""

from __future__ import annotations

import pytest
import torch

from qse.models.qwen3_5 import InputError
from qse.models.qwen3_5.presets import EMBEDDED_SHAPE

GRID = 64


def _state(model, cache):
    return ([t.clone() for t in cache.recurrent], [t.clone() for t in cache.conv],
            [cache.kv.read(s, cache.length) for s in range(len(model.cfg.attention_layers))])


def _equal(a, b):
    rec_a, conv_a, kv_a = a
    rec_b, conv_b, kv_b = b
    return (all(torch.equal(x, y) for x, y in zip(rec_a, rec_b)) and all(torch.equal(x, y) for x, y in zip(conv_a, conv_b))
            and all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(kv_a, kv_b)))


def _read_on_grid(model, ids, grid=GRID):
    cache = model.new_cache()
    logits = [model.forward(ids[s : s + grid], cache, "last") for s in range(0, len(ids), grid)]
    return cache, logits


def test_embedded_default_has_the_real_vocabulary(tiny_engine):
    cfg = tiny_engine.cfg
    assert cfg.vocab_size == 248320
    assert cfg.hidden_size == EMBEDDED_SHAPE["hidden_size"]
    assert tiny_engine.chat.tokenizer.vocab_size == 248077
    assert len(cfg.attention_layers) == 2 and len(cfg.gdn_layers) == 6


def test_grid_reads_are_deterministic(tiny_engine):
    model = tiny_engine.model
    ids = torch.randint(0, 248000, (5 * GRID,), generator=torch.Generator().manual_seed(0))
    a, la = _read_on_grid(model, ids)
    b, lb = _read_on_grid(model, ids)
    assert _equal(_state(model, a), _state(model, b))
    assert all(torch.equal(x, y) for x, y in zip(la, lb))


def test_grid_chunks_in_two_sittings_equal_one_fresh_prefill(tiny_engine):
    """Reading 3 chunks, stopping, then 2 more equals reading all 5 at once on the same grid."""
    model = tiny_engine.model
    ids = torch.randint(0, 248000, (5 * GRID,), generator=torch.Generator().manual_seed(1))
    fresh, _ = _read_on_grid(model, ids)
    cache = model.new_cache()
    for s in range(0, 3 * GRID, GRID):
        model.forward(ids[s : s + GRID], cache, "none")
    snapshot = [t.clone() for t in cache.recurrent]
    for s in range(3 * GRID, 5 * GRID, GRID):
        model.forward(ids[s : s + GRID], cache, "none")
    assert _equal(_state(model, cache), _state(model, fresh))
    assert not all(torch.equal(x, y) for x, y in zip(snapshot, cache.recurrent))


def test_another_grid_is_close_but_is_another_rounding(tiny_engine):
    model = tiny_engine.model
    ids = torch.randint(0, 248000, (4 * GRID,), generator=torch.Generator().manual_seed(2))
    a, la = _read_on_grid(model, ids, GRID)
    b, lb = _read_on_grid(model, ids, 2 * GRID)
    assert torch.allclose(la[-1], lb[-1], atol=1e-3)
    assert torch.equal(la[-1].argmax(), lb[-1].argmax())


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([1, 2, 248320]), "token id 248320 is outside the vocabulary"),
    (torch.tensor([-1, 2]), "token id -1 is outside the vocabulary"),
    (torch.tensor([], dtype=torch.long), "empty input"),
    (torch.tensor([[1, 2]]), "1-D tensor"),
], ids=["id-past-vocab", "negative-id", "empty", "2d"])
def test_bad_ids_are_refused_with_the_value(tiny_engine, bad, match):
    model = tiny_engine.model
    cache = model.new_cache()
    with pytest.raises(InputError, match=match):
        model.forward(bad, cache)
    assert cache.length == 0


def test_window_is_enforced(tiny_engine):
    model = tiny_engine.model
    cache = model.new_cache()
    cache.length = model.cfg.max_position_embeddings
    with pytest.raises(InputError, match="exceeds the model window"):
        model.forward(torch.tensor([1]), cache)


def test_kernel_choice_errors_name_the_value(tiny_engine, monkeypatch):
    import qse_kernels
    from qse.engine.engine import Engine

    with pytest.raises(ValueError, match="QSE_KERNELS='fast'.*expected naive, triton, invariant or auto"):
        Engine(tiny_engine.resolved, kernels="fast")
    monkeypatch.setattr(qse_kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="QSE_KERNELS=triton asked for, but Triton cannot run here"):
        Engine(tiny_engine.resolved, kernels="triton")
    assert Engine(tiny_engine.resolved, kernels="auto").kernels == "naive"  # a CPU engine


@pytest.mark.parametrize("logits,row", [("row", 37), ("row", 0), ("last", None)], ids=["row-37", "row-0", "last"])
def test_one_row_logits_run_the_last_layer_for_that_row_alone(tiny_engine, logits, row):
    """A forward that wants one row's logits runs the last layer's queries, MLP and norms for that row only:
    the same logits as the whole forward's row (to rounding), and the same state written, bit for bit."""
    model = tiny_engine.model
    ids = torch.randint(0, 248000, (2 * GRID + 20,), generator=torch.Generator().manual_seed(7))
    prefix, tail = ids[:GRID], ids[GRID:]
    whole_cache, one_cache, none_cache = model.new_cache(), model.new_cache(), model.new_cache()
    for cache in (whole_cache, one_cache, none_cache):
        model.forward(prefix, cache, "none")
    every_row = model.forward(tail, whole_cache, "all")
    one = model.forward(tail, one_cache, logits, logit_row=row)
    model.forward(tail, none_cache, "none")
    want = every_row[len(tail) - 1 if row is None else row]
    assert one.shape == (1, model.cfg.vocab_size)
    assert (one[0] - want).abs().max() <= 1e-4 * want.abs().max()
    assert _equal(_state(model, one_cache), _state(model, none_cache))
    assert _equal(_state(model, one_cache), _state(model, whole_cache))


def test_state_moves_whole_between_caches_in_one_copy_a_buffer(tiny_engine):
    """new_cache's layer states are rows of one stack a kind, so copy_state_from and clone_state move a
    whole state by two copies; a cache without the stacks (built by hand) still gets every layer."""
    from qse.models.cache import SequenceCache

    model = tiny_engine.model
    ids = torch.arange(3, 3 + GRID)
    source, _ = _read_on_grid(model, ids)
    rec_buf, conv_buf = source.stacked
    assert all(t.data_ptr() == rec_buf[i].data_ptr() for i, t in enumerate(source.recurrent))
    assert all(t.data_ptr() == conv_buf[i].data_ptr() for i, t in enumerate(source.conv))
    assert any(t.abs().sum() > 0 for t in source.recurrent)  # the read wrote through the views

    target = model.new_cache()
    target.copy_state_from(source)
    assert all(torch.equal(a, b) for a, b in zip(target.state_tensors(), source.state_tensors()))

    loose = SequenceCache(kv=None, recurrent=[torch.zeros_like(t) for t in source.recurrent],
                          conv=[torch.zeros_like(t) for t in source.conv])
    loose.copy_state_from(source)
    assert all(torch.equal(a, b) for a, b in zip(loose.state_tensors(), source.state_tensors()))
    back = model.new_cache()
    back.copy_state_from(loose)
    assert torch.equal(back.stacked[0], rec_buf) and torch.equal(back.stacked[1], conv_buf)

    # a clone is two stacked copies, its own memory, equal to the state
    rec, conv = source.clone_state()
    assert all(torch.equal(a, b) for a, b in zip(rec + conv, source.state_tensors()))
    assert rec[0].data_ptr() != rec_buf.data_ptr() and rec[1].data_ptr() == rec[0].data_ptr() + rec[0].nbytes
    rec_loose, _ = loose.clone_state()
    assert all(torch.equal(a, b) for a, b in zip(rec_loose, source.recurrent))


# ---- memory bounded by the chunk, not the prompt -----------------------------------------------------
def test_attention_past_the_score_budget_goes_in_query_blocks(monkeypatch):
    """Past ATTENTION_SCORE_ELEMENTS the twin attends in query blocks through the fused attention: the same
    result within rounding, the same bits on every call, and no T x L score matrix held (checked at 64k by
    tests/engine/test_prompt_memory.py)."""
    from qse_kernels import naive

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for n, h in ((96, 4), (160, 2), (160, 2)))
    whole = naive.attention(q, k, v, 64)
    monkeypatch.setattr(naive, "ATTENTION_SCORE_ELEMENTS", 4 * 160 * 10)  # blocks of 10 queries
    assert naive._query_block(96, 4, 160) == 10
    blocked = naive.attention(q, k, v, 64)
    assert torch.allclose(blocked, whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(blocked, naive.attention(q, k, v, 64))
    assert torch.allclose(naive.sdpa_attention(q, k, v, 64), whole, atol=1e-5, rtol=1e-5)


def test_prefill_reads_a_prompt_in_pieces(tiny_engine):
    """Engine.prefill: a prompt read in pieces of `chunk` rows, the same bits as those pieces read one by one."""
    ids = torch.randint(0, 248000, (2 * GRID + 9,), generator=torch.Generator().manual_seed(5))
    cache = tiny_engine.new_cache()
    logits, _ = tiny_engine.prefill(cache, ids, GRID)
    by_hand, pieces = _read_on_grid(tiny_engine.model, ids)
    assert cache.length == len(ids) and torch.equal(logits, pieces[-1])
    assert _equal(_state(tiny_engine.model, cache), _state(tiny_engine.model, by_hand))
    with pytest.raises(ValueError, match="chunk must be a positive"):
        tiny_engine.prefill(cache, ids, 0)
