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


def test_copy_pages_gives_each_destination_its_sources_rows_and_names_a_mismatch():
    pool = KVPool(6, 4, 2, 1, 3, torch.float32, "cpu")
    pool.k.copy_(torch.arange(pool.k.numel(), dtype=torch.float32).reshape(pool.k.shape))
    pool.v.copy_(-pool.k)
    before_k, before_v = pool.k.clone(), pool.v.clone()
    pool.copy_pages([0, 2], [5, 3])
    assert torch.equal(pool.k[5], before_k[0]) and torch.equal(pool.k[3], before_k[2])
    assert torch.equal(pool.v[5], before_v[0]) and torch.equal(pool.v[3], before_v[2])
    assert all(torch.equal(pool.k[p], before_k[p]) for p in (0, 1, 2, 4))  # no other page touched
    with pytest.raises(ValueError, match="2 source pages for 1 destinations"):
        pool.copy_pages([0, 1], [4])
