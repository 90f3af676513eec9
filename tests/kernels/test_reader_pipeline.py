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
