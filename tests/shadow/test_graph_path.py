"""The graph path's buffers and flow (qse/engine/graphs.py) against the eager path, bit for bit.

On CPU the graph path runs in its "static" form: the same fixed buffers, state copies, page table and
device-side position as under CUDA graphs, replayed by calling the forward again. What a CPU cannot
check (the capture itself) runs in the GPU tests; everything around it runs here.
"""

from __future__ import annotations

import torch

from qse.shadow.reader import ShadowReader

GRID = 32


def _readers(engine):
    eager = ShadowReader(engine, grid=GRID, pool_bytes=16 << 20, graphs=False)
    static = ShadowReader(engine, grid=GRID, pool_bytes=16 << 20, graphs="static")
    assert eager.mode == "eager" and static.mode == "graph"
    return eager, static


def _same_state(reader, a, b) -> bool:
    """Every KV row below the committed length, the recurrent and the conv state, bit for bit."""
    return all(reader.state_equal(a, b).values())


def _drive(reader, script):
    for sid, ids, prompt_end in script:
        reader.feed(sid, ids, prompt_end=prompt_end)
        reader.read_all(sid)


def test_graph_path_reads_the_same_bits_as_eager(tiny_engine):
    """Two sessions read in turns (their pages interleave in the pool), a rollback, growth past pages."""
    base = list(range(1000, 1000 + 3 * GRID + 5))
    other = list(range(5000, 5000 + 2 * GRID + 1))
    edited = base[: GRID + 3] + [7, 8, 9] + base[GRID + 6 :] + list(range(20, 20 + GRID))
    script = [("a", base[: GRID + 4], GRID + 4), ("b", other, None), ("a", base, len(base)),
              ("b", other + list(range(60, 60 + GRID)), None), ("a", edited, None)]
    eager, static = _readers(tiny_engine)
    _drive(eager, script)
    _drive(static, script)
    for sid in ("a", "b"):
        assert static.get(sid).committed > GRID
        assert _same_state(eager, eager.get(sid), static.get(sid))
    assert static.get("a").stats.rollbacks == eager.get("a").stats.rollbacks == 1
    # and the graph path still equals its own fresh prefill
    fresh = static.fresh_prefill(static.get("a").ids, "fresh")
    assert all(static.state_equal(static.get("a"), fresh).values())


def test_graph_path_answers_and_summaries_equal_eager(tiny_engine):
    ids = list(range(2000, 2000 + 2 * GRID + 11))
    eager, static = _readers(tiny_engine)
    for reader in (eager, static):
        reader.feed("s", ids)
        reader.read_all("s")
    before = [t.clone() for t in static.get("s").cache.recurrent]
    question = list(range(40, 75))
    a = eager.ask("s", question, ["A", "B", "C"])
    b = static.ask("s", question, ["A", "B", "C"])
    assert a.distribution == b.distribution and a.position == b.position
    sa = eager.summarize("s", list(range(90, 96)), max_tokens=5)
    sb = static.summarize("s", list(range(90, 96)), max_tokens=5)
    assert sa.token_ids == sb.token_ids and len(sb.token_ids) == 5
    # the forks left the committed state alone, and nothing above it holds pages
    session = static.get("s")
    assert all(torch.equal(x, y) for x, y in zip(before, session.cache.recurrent))
    assert session.kv.capacity == session.kv.pages_for(session.committed) * static.pool.page_rows
    assert _same_state(eager, eager.get("s"), session)


def test_pipelined_greedy_decode_gives_the_tokens_of_one_step_at_a_time(tiny_engine):
    """The graph path launches each decode step on the device's token before the host reads it: the tokens
    must still be those of the eager loop, for every max_tokens and wherever a stop token falls (the step
    launched on a stop token is dropped with the fork)."""
    ids = list(range(2500, 2500 + GRID + 9))
    eager, static = _readers(tiny_engine)
    for reader in (eager, static):
        reader.feed("s", ids)
        reader.read_all("s")
    prompt = list(range(100, 108))
    longest = eager.summarize("s", prompt, max_tokens=7).token_ids
    assert len(longest) == 7
    for max_tokens in (1, 2, 3, 7):
        a = eager.summarize("s", prompt, max_tokens=max_tokens)
        b = static.summarize("s", prompt, max_tokens=max_tokens)
        assert a.token_ids == b.token_ids == longest[:max_tokens]
    for at in (0, 1, 4):  # a stop token at the first token, the second, the fifth
        stop = (longest[at],)
        a = eager.summarize("s", prompt, max_tokens=7, stop_ids=stop)
        b = static.summarize("s", prompt, max_tokens=7, stop_ids=stop)
        assert b.token_ids == a.token_ids == longest[: longest.index(longest[at])]
    session = static.get("s")
    assert all(static.state_equal(session, eager.get("s")).values())
    assert session.kv.capacity == session.kv.pages_for(session.committed) * static.pool.page_rows


def test_a_fork_does_not_touch_the_session_between_replays(tiny_engine):
    """The graph path forks on its working copy: the session's own tensors are never written by a fork."""
    _, static = _readers(tiny_engine)
    static.feed("s", list(range(3000, 3000 + GRID + 7)))
    static.read_all("s")
    session = static.get("s")
    ptrs = [t.data_ptr() for t in session.cache.recurrent]
    versions = [t._version for t in session.cache.recurrent]
    static.ask("s", [5, 6, 7], ["A", "B"])
    assert [t.data_ptr() for t in session.cache.recurrent] == ptrs
    assert [t._version for t in session.cache.recurrent] == versions


def _read_one_at_a_time(reader, sid):
    reports = []
    while (report := reader.read_step(sid)) is not None:
        reports.append(report)
    return reports


def test_chunks_launched_ahead_read_the_same_bits_as_one_at_a_time(tiny_engine):
    """read_all launches chunks ahead of reading them back: the same state, reports and checkpoints as
    read_step one chunk at a time, on the graph path and eagerly."""
    ids = list(range(3000, 3000 + 5 * GRID + 9))
    for graphs in (False, "static"):
        ahead = ShadowReader(tiny_engine, grid=GRID, pool_bytes=16 << 20, graphs=graphs, recent_checkpoints=2)
        one = ShadowReader(tiny_engine, grid=GRID, pool_bytes=16 << 20, graphs=graphs, recent_checkpoints=2)
        for reader in (ahead, one):
            reader.feed("s", ids, prompt_end=3 * GRID + 4)
        got = ahead.read_all("s", lookahead=2)
        want = _read_one_at_a_time(one, "s")
        assert [(r.context, r.position, r.backlog) for r in got] == [(r.context, r.position, r.backlog) for r in want]
        assert [r.position for r in got] == [GRID * k for k in range(1, 6)] and got[-1].backlog == 0
        a, b = ahead.get("s"), one.get("s")
        assert a.committed == b.committed == 5 * GRID
        assert a.checkpoint_positions(None) == b.checkpoint_positions(None) == [3 * GRID, 4 * GRID, 5 * GRID]
        for ca, cb in zip(a.checkpoints, b.checkpoints):
            assert all(torch.equal(x, y) for x, y in zip((*ca.recurrent, *ca.conv), (*cb.recurrent, *cb.conv)))
        assert _same_state(ahead, a, ahead.fresh_prefill(ids[: 5 * GRID], "f"))
        assert torch.equal(a.cache.recurrent[0], b.cache.recurrent[0]) and torch.equal(a.cache.conv[0], b.cache.conv[0])
        assert a.stats.chunks_read == 5 and ahead.stats.chunks == 5 + 5  # and the fresh prefill's five


def test_a_launched_chunk_advances_the_session_at_once_and_reports_when_read_back(tiny_engine):
    _, static = _readers(tiny_engine)
    static.feed("s", list(range(100, 100 + 3 * GRID + 1)))
    first = static.launch_step("s")
    second = static.launch_step("s")
    assert (first.start, second.start, static.get("s").committed) == (0, GRID, 2 * GRID)
    r1, r2 = static.finish_step(first), static.finish_step(second)
    assert (r1.context, r1.position, r1.backlog) == (0, GRID, 2 * GRID)
    assert (r2.context, r2.position, r2.backlog) == (GRID, 2 * GRID, GRID)
    assert r1.gpu_ms >= 0 and static.stats.chunks == 2
    static.read_all("s")
    assert static.launch_step("s") is None  # no whole chunk left

