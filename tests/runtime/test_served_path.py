"""The served model's turn on the graph path (its static CPU form) against the eager turn."""

from __future__ import annotations

import pytest
import torch

from qse.engine.serving import PAGE_ROWS, ServedPath


def _greedy(path: ServedPath, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    seq, logits, _ = path.prefill(prompt)
    tokens, rows = [], []
    for _ in range(steps):
        token = int(torch.argmax(logits[-1]))
        tokens.append(token)
        rows.append(logits[-1].clone())
        logits, ms = path.decode(seq, token)
        assert ms >= 0
    path.finish(seq)
    return tokens, rows


def test_graph_decode_equals_eager_decode(tiny_engine):
    eager = ServedPath(tiny_engine, graphs=False)
    static = ServedPath(tiny_engine, graphs="static", pool_bytes=32 << 20)
    assert (eager.mode, static.mode) == ("eager", "graph")
    prompt = list(range(500, 500 + PAGE_ROWS - 3))  # decoding crosses into a second page
    a, rows_a = _greedy(eager, prompt, 6)
    b, rows_b = _greedy(static, prompt, 6)
    assert a == b
    # the paged and the contiguous store run the same arithmetic on CPU: the same bits
    assert all(torch.equal(x, y) for x, y in zip(rows_a, rows_b))
    assert static.pool.num_free == static.pool.num_pages  # every page went back


def test_a_prompt_the_pool_cannot_hold_runs_eagerly(tiny_engine):
    static = ServedPath(tiny_engine, graphs="static", pool_bytes=1)  # one page
    seq, _, _ = static.prefill(list(range(100, 100 + PAGE_ROWS + 10)))
    assert not seq.graphed
    static.finish(seq)


def test_graphs_on_a_cpu_engine_are_refused(tiny_engine):
    with pytest.raises(ValueError, match="CUDA graphs"):
        ServedPath(tiny_engine, graphs=True)
