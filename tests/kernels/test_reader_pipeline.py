"""The reader's chunks launched ahead of being read back (ShadowReader.read_all's lookahead) under real CUDA
graphs; the CPU side of the same contract is tests/shadow/test_graph_path.py."""

from __future__ import annotations

import pytest
import torch

from qse.shadow.reader import ShadowReader


def _read_one_at_a_time(reader, sid):
    reports = []
    while (report := reader.read_step(sid)) is not None:
        reports.append(report)
    return reports


@pytest.mark.gpu
def test_cuda_graph_chunks_launched_ahead_equal_one_at_a_time(cache_dir):
    """Under real CUDA graphs, chunks launched two ahead (events, pinned ids and page tables in flight)
    hold the bits of chunks read one at a time; each report carries its own device time."""
    from qse.engine.engine import Engine
    from qse.models import resolve

    engine = Engine(resolve("", torch.device("cuda"), torch.bfloat16, cache_dir), kernels="triton")
    ids = list(range(5000, 5000 + 12 * 64 + 7))
    ahead = ShadowReader(engine, grid=64, pool_bytes=64 << 20, graphs=True, recent_checkpoints=3)
    one = ShadowReader(engine, grid=64, pool_bytes=64 << 20, graphs=True, recent_checkpoints=3)
    for reader in (ahead, one):
        reader.feed("s", ids)
    got = ahead.read_all("s", lookahead=2)
    _read_one_at_a_time(one, "s")
    assert len(got) == 12 and all(r.gpu_ms > 0 for r in got)
    assert all(ahead.state_equal(ahead.get("s"), one.get("s")).values())
    for ca, cb in zip(ahead.get("s").checkpoints, one.get("s").checkpoints):
        assert ca.position == cb.position
        assert all(torch.equal(x, y) for x, y in zip((*ca.recurrent, *ca.conv), (*cb.recurrent, *cb.conv)))


@pytest.mark.gpu
def test_cuda_graph_chunk_groups_on_two_streams_equal_one_at_a_time(cache_dir):
    """Chunk groups under real CUDA graphs (first halves on a side stream, second halves on the replay's
    stream, one event between them a chunk), launched ahead: the bits of one chunk at a time, on the
    tiny model and on the 0.8B's shapes (random weights, 512-row grid, 4 groups of 4 and one of 2)."""
    from qse.engine.engine import Engine
    from qse.models import resolve

    tiny = Engine(resolve("", torch.device("cuda"), torch.bfloat16, cache_dir), kernels="triton")
    big = Engine(resolve("qwen3.5-0.8b", torch.device("cuda"), torch.bfloat16, cache_dir), kernels="triton")
    for engine, grid, chunks in ((tiny, 64, 13), (big, 512, 18)):
        ids = [(7 * i + 11) % 240000 for i in range(chunks * grid + 5)]
        pool = engine.state_bytes_per_token() * (chunks + 8) * grid * 2 + (64 << 20)
        grouped = ShadowReader(engine, grid=grid, pool_bytes=pool, graphs=True, chunk_group=4)
        one = ShadowReader(engine, grid=grid, pool_bytes=pool, graphs=True)
        for reader in (grouped, one):
            reader.feed("s", ids)
        got = grouped.read_all("s", lookahead=2)
        _read_one_at_a_time(one, "s")
        assert sum(r.chunks for r in got) == chunks and max(r.chunks for r in got) == 4
        assert all(r.gpu_ms > 0 for r in got)
        assert all(grouped.state_equal(grouped.get("s"), one.get("s")).values())
        # graphs captured after the groups (a question's, a summary's) and replayed between group reads
        question = [(5 * i + 3) % 240000 for i in range(37)]
        for _ in range(2):
            a, b = grouped.ask("s", question, ["A", "B"]), one.ask("s", question, ["A", "B"])
            assert a.distribution == b.distribution
            assert grouped.summarize("s", question[:9], 4).token_ids == one.summarize("s", question[:9], 4).token_ids
            more = [(3 * i + 1) % 240000 for i in range(4 * grid)]
            for reader in (grouped, one):
                reader.feed("s", reader.get("s").ids + more)
            grouped.read_all("s")
            _read_one_at_a_time(one, "s")
            assert all(grouped.state_equal(grouped.get("s"), one.get("s")).values())
        del grouped, one
