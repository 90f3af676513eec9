"""The MTP head's forward (qse/models/qwen3_5/mtp.py) against its naive twin, written from the formula in float64
(mtp_twin.py), and the forward's final-hidden tap that feeds it (issue 30, item 1)."""

from __future__ import annotations

import pytest
import torch
from mtp_twin import naive_draft, naive_logits, naive_mtp

from qse.models.cache import SlotStates
from qse.models.inputs import DecodeBatch
from qse.models.qwen3_5 import Qwen35Model, parse_config
from qse.models.qwen3_5.presets import embedded_config_dict, random_weights, tiny_mtp_config_dict

# tiny forwards on one thread: on a shared CPU, OpenMP's spinning makes them many times slower at random
pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 13


@pytest.fixture(scope="module")
def model() -> Qwen35Model:
    cfg = parse_config(tiny_mtp_config_dict())
    return Qwen35Model(cfg, random_weights(cfg, 3, "cpu", torch.float32), "cpu", torch.float32)


@pytest.fixture(scope="module")
def pairs(model):
    """next ids [CONTEXT] and hidden states [CONTEXT, H] of the size the target's final norm gives."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, model.cfg.vocab_size, (CONTEXT,), generator=gen)
    hidden = torch.randn(CONTEXT, model.cfg.hidden_size, generator=gen)
    return ids, hidden


# ---- the head -------------------------------------------------------------------------------------------------
def test_the_head_is_its_formula(model, pairs):
    ids, hidden = pairs
    head = model.mtp_head()
    cache = head.new_cache()
    g = head.forward(ids, hidden, cache)
    want = naive_mtp(model, ids, hidden)
    assert cache.length == CONTEXT and g.shape == (CONTEXT, model.cfg.hidden_size)
    torch.testing.assert_close(g.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(g).double(), naive_logits(model, want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunks", [(5, 1, 7), (1,) * CONTEXT, (12, 1)], ids=["5-1-7", "one-by-one", "12-1"])
def test_a_chunked_forward_equals_one_shot(model, pairs, chunks):
    ids, hidden = pairs
    head = model.mtp_head()
    whole, parts = head.new_cache(), head.new_cache()
    g = head.forward(ids, hidden, whole)
    start, outs = 0, []
    for n in chunks:
        outs.append(head.forward(ids[start:start + n], hidden[start:start + n], parts))
        start += n
    assert parts.length == whole.length == CONTEXT
    torch.testing.assert_close(torch.cat(outs), g, rtol=1e-5, atol=1e-5)
    for got, want in zip(parts.kv.read(0, CONTEXT), whole.kv.read(0, CONTEXT)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.last_hidden, whole.last_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_draft_is_the_rule_and_leaves_the_rows_alone(model, pairs, k):
    """k greedy drafts equal the twin's chain; the cache keeps its length, a second draft gives the same ids, and
    rows forwarded after a draft are those forwarded without one (the draft's rows are written over)."""
    ids, hidden = pairs
    head = model.mtp_head()
    cache = head.new_cache()
    head.forward(ids[:-2], hidden[:-2], cache)
    drafts = head.draft(cache, k)
    assert drafts.dtype == torch.long and drafts.tolist() == naive_draft(model, ids[:-2], hidden[:-2], k)
    assert cache.length == CONTEXT - 2
    assert head.draft(cache, k).tolist() == drafts.tolist()
    after = head.forward(ids[-2:], hidden[-2:], cache)
    clean = head.new_cache()
    head.forward(ids[:-2], hidden[:-2], clean)
    torch.testing.assert_close(after, head.forward(ids[-2:], hidden[-2:], clean), rtol=0, atol=0)


def test_a_paged_store_holds_the_contiguous_rows(model, pairs):
    """The head's rows in pages of a pool (read and written on the device, as a graph needs): the same outputs
    and drafts as in one contiguous buffer, across a page line."""
    from qse.engine.kv import KVPool, PagedKV

    ids, hidden = pairs
    cfg, head = model.cfg, model.mtp_head()
    pool = KVPool(4, 8, 1, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
    paged, flat = head.new_cache(kv=PagedKV(pool)), head.new_cache()
    for lo, hi in ((0, 5), (5, CONTEXT)):
        torch.testing.assert_close(head.forward(ids[lo:hi], hidden[lo:hi], paged),
                                   head.forward(ids[lo:hi], hidden[lo:hi], flat), rtol=1e-6, atol=1e-6)
    assert head.draft(paged, 3).tolist() == head.draft(flat, 3).tolist()
    assert paged.kv.pages_for(CONTEXT + 2) == len(paged.kv.pages) == 2


def test_rollback_drops_rows_and_asks_for_the_accepted_ones(model, pairs):
    ids, hidden = pairs
    head = model.mtp_head()
    cache = head.new_cache()
    head.forward(ids, hidden, cache)
    want = head.draft(cache, 2).tolist()
    cache.rollback_to(CONTEXT - 3)
    assert cache.length == CONTEXT - 3
    with pytest.raises(ValueError, match="no row to draft from"):
        head.draft(cache, 2)
    head.forward(ids[-3:], hidden[-3:], cache)
    assert head.draft(cache, 2).tolist() == want
    with pytest.raises(ValueError, match="cannot roll the MTP head back to 99 rows: it holds 13"):
        cache.rollback_to(99)
    with pytest.raises(ValueError, match=r"hidden states \[T, 64\]"):
        head.forward(ids[:2], hidden[:3], cache)


def test_a_model_without_a_head_says_so():
    cfg = parse_config({**embedded_config_dict(), "vocab_size": 512})
    model = Qwen35Model(cfg, random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=0"):
        model.mtp_head()


# ---- the final-hidden tap -------------------------------------------------------------------------------------
def test_the_tap_is_what_the_head_reads(model):
    ids = torch.arange(3, 3 + 20)
    taps = model.new_taps(20)
    logits = model.forward(ids, model.new_cache(), "all", taps=taps)
    assert torch.equal(logits, model._logits(taps["final_hidden"]))
    plain = model.forward(ids, model.new_cache(), "all")
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)
    # "last" with taps: every row's hidden, the last row's logits (as "last" without taps, to the matmul's rounding)
    last_taps = model.new_taps(20)
    last = model.forward(ids, model.new_cache(), "last", taps=last_taps)
    torch.testing.assert_close(last_taps["final_hidden"], taps["final_hidden"], rtol=0, atol=0)
    torch.testing.assert_close(last, model.forward(ids, model.new_cache(), "last"), rtol=1e-5, atol=1e-5)
    none_taps = model.new_taps(20)
    assert model.forward(ids, model.new_cache(), "none", taps=none_taps) is None
    torch.testing.assert_close(none_taps["final_hidden"], taps["final_hidden"], rtol=0, atol=0)


def test_decode_step_taps_each_row(model):
    from qse.engine.kv import KVPool, PagedKV

    cfg = model.cfg
    pool = KVPool(8, 16, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
    cache = model.new_cache(kv=PagedKV(pool))
    model.forward(torch.arange(5, 15), cache, "none")
    states: SlotStates = model.new_slot_states(1)
    states.load(0, cache)
    cache.kv.ensure(11)
    batch = DecodeBatch(torch.tensor([10], dtype=torch.int32), torch.tensor([0]), cache.kv.device_table()[None],
                        pool, pool.num_pages * pool.page_rows)
    taps = model.new_taps(1)
    logits = model.decode_step(torch.tensor([15]), states, batch, taps=taps)
    assert torch.equal(logits, model._logits(taps["final_hidden"]))


def test_taps_are_refused_where_they_cannot_be_filled(model):
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="unknown tap 'aux_hidden'"):
        model.forward(ids, model.new_cache(), taps={"aux_hidden": torch.empty(4, 64)})
    with pytest.raises(ValueError, match="tap 'final_hidden' holds 3 rows; the forward reads 4"):
        model.forward(ids, model.new_cache(), taps=model.new_taps(3))
    with pytest.raises(ValueError, match="has no taps"):
        model.forward_layers(ids, model.new_cache(), None, "none", 0, 2, taps=model.new_taps(4))
