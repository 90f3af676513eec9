"""The whole model on the Triton kernels (interpreted on CPU): the exactness contract and the graph
path's bits, on the same kernels the H200 runs. The tests that run on CPU read a four-layer model with a
328-token vocabulary (conftest's small_model_dir): every kernel path, each layer kind twice, in minutes
of interpreter time rather than a quarter of an hour (the grid-invariance test, whose two sides run the same
eager path, one layer of each kind: two_layer_model_dir); the GPU tests keep the embedded default."""

from __future__ import annotations

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.shadow.reader import ShadowReader

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("few_programs")]

GRID = 64


def _engine(model: str, cache_dir, kernels: str) -> Engine:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine(resolve(model, torch.device(device), dtype, cache_dir), kernels=kernels)
    assert engine.kernels == kernels
    return engine


@pytest.fixture(scope="module")
def triton_engine(cache_dir):
    """The embedded default (the GPU tests)."""
    return _engine("", cache_dir, "triton")


@pytest.fixture(scope="module")
def small_triton_engine(small_model_dir, cache_dir):
    engine = _engine(str(small_model_dir), cache_dir, "triton")
    assert engine.model.cfg.layer_types == ("linear_attention", "full_attention") * 2
    return engine


def test_triton_graph_path_reads_and_answers_the_same_bits(small_triton_engine):
    """The paged kernel through the page table and the device-side position, the working-state copies:
    the same bits as the eager forward. (Interpreted kernels are slow: two chunks and one question; the graph
    path's attention launch covers the whole pool, so the pool is kept to 512 rows.)"""
    ids = list(range(100, 100 + 2 * GRID + 17))
    pool_bytes = 512 * small_triton_engine.state_bytes_per_token()
    eager = ShadowReader(small_triton_engine, grid=GRID, pool_bytes=pool_bytes, page_rows=GRID, graphs=False)
    static = ShadowReader(small_triton_engine, grid=GRID, pool_bytes=pool_bytes, page_rows=GRID, graphs="static")
    assert static.graphs.capacity <= 512
    for reader in (eager, static):
        reader.feed("s", ids)
        reader.read_all("s")
        assert reader.get("s").committed == 2 * GRID
    assert all(eager.state_equal(eager.get("s"), static.get("s")).values())
    question = list(range(50, 80))
    a = eager.ask("s", question, ["A", "B"])
    b = static.ask("s", question, ["A", "B"])
    assert a.distribution == b.distribution
    assert all(eager.state_equal(eager.get("s"), static.get("s")).values())


def test_one_row_logits_on_the_paged_kernels(small_triton_engine, rel):
    """One row's logits (the last layer run for that row alone, its query at start + row through the page
    table) agree with that row of the whole forward; the KV rows written are the same bits."""
    ids = list(range(200, 200 + GRID + 20))
    reader = ShadowReader(small_triton_engine, grid=GRID, pool_bytes=8 << 20, page_rows=GRID, graphs=False)
    for sid in ("one", "all"):
        reader.feed(sid, ids[:GRID])
        reader.read_all(sid)
    model = small_triton_engine.model
    tail = small_triton_engine.ids_tensor(ids[GRID:])
    one = model.forward(tail, reader.get("one").cache, "row", logit_row=11)
    every = model.forward(tail, reader.get("all").cache, "all")
    assert rel(one[0], every[11]) < (1e-4 if one.dtype == torch.float32 and model.dtype == torch.float32 else 2e-2)
    assert all(reader.state_equal(reader.get("one"), reader.get("all")).values())


@pytest.mark.gpu
def test_cuda_graphs_read_and_answer_the_same_bits_as_eager(triton_engine):
    """Captured once, replayed over two sessions that grow past the pages they had at capture time."""
    eager = ShadowReader(triton_engine, grid=GRID, pool_bytes=64 << 20, graphs=False)
    graph = ShadowReader(triton_engine, grid=GRID, pool_bytes=64 << 20, graphs=True)
    assert graph.mode == "graph"
    sessions = {"a": list(range(1000, 1000 + 9 * GRID + 3)), "b": list(range(7000, 7000 + 5 * GRID + 40))}
    for reader in (eager, graph):
        for step in range(1, 4):  # the sessions grow in turns, so their pages interleave
            for sid, ids in sessions.items():
                reader.feed(sid, ids[: len(ids) * step // 3])
                reader.read_all(sid)
    assert graph.graphs.num_graphs == 1
    for sid in sessions:
        assert all(eager.state_equal(eager.get(sid), graph.get(sid)).values())
    question = list(range(50, 350))
    a = eager.ask("a", question, ["A", "B", "C"])
    b = graph.ask("a", question, ["A", "B", "C"])
    assert a.distribution == b.distribution
    sa = eager.summarize("b", list(range(90, 100)), max_tokens=6)
    sb = graph.summarize("b", list(range(90, 100)), max_tokens=6)
    assert sa.token_ids == sb.token_ids
    for sid in sessions:
        assert all(eager.state_equal(eager.get(sid), graph.get(sid)).values())


@pytest.mark.gpu
def test_served_turn_under_a_cuda_graph_equals_eager(triton_engine):
    from qse.sessions.grid import GridSessions
    from qse.sessions.served import ServedSessions

    prompt = list(range(300, 300 + 509))  # the decode crosses a page line
    out = {}
    # (groups: the prompt's 3 chunks in a group of 2 and one chunk, the layers' ranges on two streams)
    for name, graphs, group in (("eager", False, 1), ("graph", True, 1), ("groups", True, 4)):
        served = ServedSessions(GridSessions(triton_engine, grid=128, pool_bytes=64 << 20, graphs=graphs,
                                             chunk_group=group))
        turn, logits = served.begin("s", prompt)
        tokens, rows = [], []
        for _ in range(8):
            tokens.append(int(torch.argmax(logits[-1])))
            rows.append(logits[-1].clone())
            logits, _ = served.decode(turn, tokens[-1])
        served.finish(turn)
        out[name] = (tokens, rows)
    for name in ("graph", "groups"):
        assert out["eager"][0] == out[name][0], name
        assert all(torch.equal(x, y) for x, y in zip(out["eager"][1], out[name][1])), name


def test_invariant_kernels_read_the_same_state_on_any_grid(two_layer_model_dir, cache_dir):
    """QSE_KERNELS=invariant: a question asked over a different committed length (64 rows and a tail of 36
    against no rows and a tail of 100, so a different fork) gets the same answer, and the session then read on
    to 128 rows on grid 64 (two chunks) and on grid 128 (one) holds the same bits. (Both sides run the same
    eager path, so one layer of each kind: conftest's two_layer_model_dir.)"""
    engine = _engine(str(two_layer_model_dir), cache_dir, "invariant")
    assert engine.model.cfg.layer_types == ("linear_attention", "full_attention")
    fine = ShadowReader(engine, grid=64, pool_bytes=8 << 20, graphs=False)
    coarse = ShadowReader(engine, grid=128, pool_bytes=8 << 20, graphs=False)
    ids = list(range(150, 150 + 128))
    for reader in (fine, coarse):
        reader.feed("a", ids[:100])
        reader.read_all("a")
    assert (fine.get("a").committed, coarse.get("a").committed) == (64, 0)
    question = list(range(70, 90))
    assert fine.ask("a", question, ["A", "B"]).distribution == coarse.ask("a", question, ["A", "B"]).distribution
    for reader in (fine, coarse):
        reader.feed("a", ids)
        reader.read_all("a")
    assert fine.get("a").stats.chunks_read == 2 and coarse.get("a").stats.chunks_read == 1
    assert all(fine.state_equal(fine.get("a"), coarse.get("a")).values())
