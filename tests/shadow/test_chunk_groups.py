"""Chunk groups: several grid chunks of one session in one launch, each chunk's second half of the layers
beside the next chunk's first half (qse/engine/graphs.py, run_chunks). The bits must be those of reading
the chunks one at a time; a group must end where a checkpoint is due.

On CPU the group runs in the graph path's static form (the halves one after the other, the same buffers
and staging); the two streams and the capture run in the GPU tests.
"""

from __future__ import annotations

import pytest
import torch

from qse.models.inputs import Step
from qse.sessions.session import PROMPT
from qse.shadow.reader import ShadowError, ShadowReader

GRID = 32


def _reader(engine, graphs="static", **kw):
    return ShadowReader(engine, grid=GRID, pool_bytes=16 << 20, graphs=graphs, **kw)


def _same_state(reader, a, b) -> bool:
    return all(reader.state_equal(a, b).values())


def test_forward_layers_in_two_ranges_equal_one_forward(tiny_engine):
    """Any split point: the second range on the first's hand-over gives the logits and state of one forward."""
    model = tiny_engine.model
    ids = torch.arange(300, 300 + 40)
    whole = model.new_cache()
    want = model.forward(ids, whole, logits="all")
    layers = len(model.cfg.layer_types)
    for split in (1, layers // 2, layers - 1):
        cache = model.new_cache()
        cache.kv.ensure(len(ids))
        step = Step(torch.zeros(1, dtype=torch.int32), len(ids), 0, None, len(ids))
        pair = model.forward_layers(ids, cache, step, "none", 0, split)
        assert isinstance(pair, tuple) and len(pair) == 4  # residual, normed, the rotary tables
        got = model.forward_layers(pair, cache, step, "all", split)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(cache.recurrent, whole.recurrent))
        assert all(torch.equal(a, b) for a, b in zip(cache.conv, whole.conv))


def test_forward_layers_refuses_bad_ranges(tiny_engine):
    model = tiny_engine.model
    layers = len(model.cfg.layer_types)
    cache = model.new_cache()
    step = Step(torch.zeros(1, dtype=torch.int32), 4, 0, None, 4)
    ids = torch.arange(4)
    for first, stop in ((0, 0), (2, 1), (-1, 2), (0, layers + 1)):
        with pytest.raises(ValueError, match="layers"):
            model.forward_layers(ids, cache, step, "none", first, stop)
    with pytest.raises(ValueError, match="returns no logits"):
        model.forward_layers(ids, cache, step, "last", 0, 1)


def test_grouped_read_equals_one_chunk_at_a_time(tiny_engine):
    """11 chunks read in groups of up to 4 (4, 4, 2, 1), and a second turn in groups: the state of one
    chunk a launch, bit for bit, and reports that account for every chunk."""
    ids = list(range(1000, 1000 + 11 * GRID + 7))
    more = ids + list(range(70, 70 + 5 * GRID))
    single, grouped = _reader(tiny_engine), _reader(tiny_engine, chunk_group=4)
    single.feed("s", ids)
    single.read_all("s")
    grouped.feed("s", ids)
    reports = grouped.read_all("s")
    assert [r.chunks for r in reports] == [4, 4, 2, 1]
    assert [r.position for r in reports] == [4 * GRID, 8 * GRID, 10 * GRID, 11 * GRID]
    assert [r.context for r in reports] == [0, 4 * GRID, 8 * GRID, 10 * GRID]
    assert grouped.get("s").stats.chunks_read == 11 and grouped.stats.chunks == 11
    assert _same_state(single, single.get("s"), grouped.get("s"))
    for reader in (single, grouped):
        reader.feed("s", more)
    single.read_all("s")
    assert [r.chunks for r in grouped.read_all("s", group=8)] == [4, 1]
    assert _same_state(single, single.get("s"), grouped.get("s"))
    # and a grouped fresh prefill equals the grouped live read
    fresh = grouped.fresh_prefill(more, "fresh")
    assert _same_state(grouped, grouped.get("s"), fresh)


def test_a_group_ends_at_a_prompt_line_and_takes_its_checkpoint(tiny_engine):
    """A prompt end 3 chunks in: the first launch reads 2 chunks (a power of two), the next 1 and stops on
    the line, whose checkpoint holds the state of a one-at-a-time read to that line."""
    ids = list(range(3000, 3000 + 8 * GRID))
    grouped = _reader(tiny_engine, max_checkpoints=2)
    grouped.feed("s", ids, prompt_end=3 * GRID + 5)
    reports = grouped.read_all("s", group=8)
    assert [r.chunks for r in reports] == [2, 1, 4, 1]
    session = grouped.get("s")
    assert session.checkpoint_positions(PROMPT) == [3 * GRID]
    single = _reader(tiny_engine)
    single.feed("t", ids[: 3 * GRID])
    single.read_all("t")
    held = next(c for c in session.checkpoints if c.position == 3 * GRID)
    want = single.get("t").cache.clone_state()
    assert all(torch.equal(a, b) for a, b in zip(held.recurrent, want[0]))
    assert all(torch.equal(a, b) for a, b in zip(held.conv, want[1]))


def test_eager_reads_one_chunk_a_launch_and_bad_group_sizes_are_refused(tiny_engine):
    eager = _reader(tiny_engine, graphs=False)
    eager.feed("s", list(range(500, 500 + 3 * GRID)))
    assert [r.chunks for r in eager.read_all("s", group=4)] == [1, 1, 1]
    static = _reader(tiny_engine)
    static.feed("s", list(range(500, 500 + 3 * GRID)))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ShadowError, match="chunks must be a whole number"):
            static.launch_step("s", bad)
    for bad in (0, 2.0, False):
        with pytest.raises(ShadowError, match="chunk_group must be a whole number"):
            _reader(tiny_engine, chunk_group=bad)
    with pytest.raises(ValueError, match="a chunk group is 2 or more chunks"):
        static.graphs.can_group(1, GRID)


@pytest.mark.parametrize("stages", [2, 3, 8])
def test_groups_of_any_layer_split_read_the_same_bits(tiny_engine, monkeypatch, stages):
    """The layers in 2, 3 or 8 ranges (one a layer on the tiny model): the bits of one chunk at a time."""
    from qse.engine import graphs

    monkeypatch.setattr(graphs, "GROUP_STAGES", stages)
    ids = list(range(4000, 4000 + 6 * GRID + 3))
    single, grouped = _reader(tiny_engine), _reader(tiny_engine, chunk_group=2)
    for reader in (single, grouped):
        reader.feed("s", ids)
        reader.read_all("s")
    assert _same_state(single, single.get("s"), grouped.get("s"))
    assert ("group", 2, GRID, stages) in grouped.graphs._entries
    with pytest.raises(ValueError, match="ranges"):
        grouped.graphs._prepare_group(2, GRID, stages=len(tiny_engine.cfg.layer_types) + 1)


def test_layer_bounds_are_as_even_as_whole_layers_allow():
    from qse.engine import graphs

    assert graphs.layer_bounds(24, 4) == [0, 6, 12, 18, 24]
    assert graphs.layer_bounds(24, 5) == [0, 5, 10, 14, 19, 24]
    assert graphs.layer_bounds(32, 3) == [0, 11, 21, 32]


def test_a_group_the_pool_cannot_hold_reads_one_chunk(tiny_engine):
    """A pool of two pages, one held by a pinned session (a served turn's): a launch asked for 2 chunks reads 1
    (the group's pages do not fit, one chunk's do), with the bits of a one-chunk read; the next chunk, which
    has no room at all, is refused by name."""
    page = _reader(tiny_engine).pool.page_nbytes
    tight = ShadowReader(tiny_engine, grid=GRID, pool_bytes=2 * page, graphs="static", chunk_group=2)
    assert tight.pool.num_pages == 2
    tight.feed("pinned", list(range(7000, 7000 + GRID)))
    tight.read_all("pinned")
    tight.get("pinned").pinned = True
    ids = list(range(8000, 8000 + 2 * GRID))
    tight.feed("s", ids)
    pending = tight.launch_step("s", 2)
    assert pending.chunks == 1 and tight.finish_step(pending).position == GRID
    single = _reader(tiny_engine)
    single.feed("s", ids[:GRID])
    single.read_all("s")
    assert _same_state(single, single.get("s"), tight.get("s"))
    with pytest.raises(MemoryError, match="cannot hold session 's'"):
        tight.launch_step("s", 2)


def test_a_group_whose_capture_runs_out_of_device_memory_reads_one_chunk(tiny_engine, monkeypatch):
    """The group's capture out of memory (the device's or the pool's scratch pages): that launch reads one
    chunk, with the bits of one chunk; nothing is half-advanced."""
    reader = _reader(tiny_engine, chunk_group=4)
    ids = list(range(9000, 9000 + 4 * GRID))
    reader.feed("s", ids)
    for error in (torch.OutOfMemoryError("CUDA out of memory"), MemoryError("no scratch pages")):
        def refuse(*args, _error=error, **kwargs):
            raise _error

        monkeypatch.setattr(reader.graphs, "_prepare_group", refuse)
        pending = reader.launch_step("s", 4)
        assert pending.chunks == 1
        reader.finish_step(pending)
    single = _reader(tiny_engine)
    single.feed("s", ids[: 2 * GRID])
    single.read_all("s")
    assert reader.get("s").committed == 2 * GRID
    assert _same_state(single, single.get("s"), reader.get("s"))
