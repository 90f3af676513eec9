"""The KV pool's writes: whole pages in one indexed copy give the same pool as row by row, wherever the write
starts and however the session's pages lie in the pool."""

from __future__ import annotations

import pytest
import torch

from qse.engine.kv import KVPool, PagedKV

ROWS = 8


@pytest.mark.parametrize("start,count", [(0, 4 * ROWS + 3), (0, 2 * ROWS), (ROWS, 3 * ROWS), (5, 3 * ROWS + 1)])
def test_a_write_of_whole_pages_equals_one_row_at_a_time(start, count):
    gen = torch.Generator().manual_seed(start * 100 + count)
    pools = [KVPool(12, ROWS, 3, 2, 4, torch.float32, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.k.zero_()
        pool.v.zero_()
    kvs = []
    for pool in pools:
        scatter = PagedKV(pool)
        filler = PagedKV(pool)  # pages taken between the session's own: its pages are not consecutive
        for _ in range(6):
            scatter.ensure(len(scatter.pages) * ROWS + 1)
            filler.ensure(len(filler.pages) * ROWS + 1)
        kvs.append(scatter)
    k = torch.randn(count, 2, 4, generator=gen)
    v = torch.randn(count, 2, 4, generator=gen)
    kvs[0].write(1, start, k, v)
    for row in range(count):
        kvs[1].write(1, start + row, k[row : row + 1], v[row : row + 1])
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    got_k, got_v = kvs[0].read(1, start + count)
    assert torch.equal(got_k[start:], k) and torch.equal(got_v[start:], v)
