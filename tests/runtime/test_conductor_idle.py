"""The idle window on the real runtime: a request that arrives waits at most one chunk; everyone who waits
for the engine goes before the idle reader; a hold or the box lock keeps the window shut."""

import asyncio

import pytest

from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role
from qse.core.locks import Priority
from qse.runtime.conductor import GenerateRequest
from qse.shadow.reader import ShadowReader


async def _consume(conductor, req: GenerateRequest) -> list[int]:
    return [t async for t in conductor.generate(req)]


async def test_a_request_arriving_mid_burst_waits_at_most_one_chunk(make_rig):
    rig = make_rig()  # a frozen scripted clock: the burst never runs out of time, only a waiter stops it
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("old", prompt_ids(10 * GRID))
    second_chunk = probe.hold("chunk", 2)
    burst = asyncio.create_task(c.idle_once())
    await second_chunk.entered  # the burst is reading its second chunk

    request = GenerateRequest(prompt_ids(20, start=3000), max_tokens=3, session_id="new")
    turn = asyncio.create_task(_consume(c, request))
    await c.board.engine.wait_for_waiters(1)  # the request waits for the engine
    assert c.board.engine.holder is Priority.IDLE_READER
    second_chunk.release.set()

    assert await burst == 2  # the chunk in flight finished; no further chunk started
    out = await turn
    assert len(out) == 3
    kinds = probe.kinds()
    assert kinds[: kinds.index("prefill")] == ["chunk", "chunk"]
    assert reader.sessions["old"].committed == 2 * GRID
    assert c.idle_bursts == 1
    assert c.ledger.balance().num_entries[Role.READER_IDLE] == 2


async def test_the_idle_reader_goes_behind_every_waiter(make_rig):
    rig = make_rig(shared=True)
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("old", prompt_ids(4 * GRID))
    first_decode = probe.hold("decode", 1)
    a = asyncio.create_task(rig.turn(prompt_ids(10, start=5000), 3, session="a"))
    await first_decode.entered
    b = asyncio.create_task(rig.turn(prompt_ids(10, start=6000), 3, session="b"))
    await c.wait_for_waiting(1)  # b is queued for the round loop, which holds the engine

    assert await c.idle_once() == 0  # a request runs and one waits: the window stays shut
    first_decode.release.set()
    await asyncio.gather(a, b)
    kinds = probe.kinds()
    # b's prefill came right after a's turn: no idle chunk between them
    assert "chunk" not in kinds
    assert [r.session_id for r in rig.records] == ["a", "b"]

    # now quiet: the idle reader reads the backlog
    assert await c.idle_once() == 4
    assert reader.sessions["old"].backlog == 0


async def test_a_hold_or_the_box_lock_keeps_the_window_shut(make_rig):
    rig = make_rig()
    c = rig.conductor
    rig.reader.feed("old", prompt_ids(2 * GRID))
    async with c.board.hold():
        assert await c.idle_once() == 0
    async with c.board.box_lock():
        assert await c.idle_once() == 0
    assert rig.probe.calls == []
    assert await c.idle_once() == 2


async def test_the_burst_reads_the_oldest_backlog_first_and_stops_at_its_end(make_rig):
    rig = make_rig()
    c, reader, clock = rig.conductor, rig.reader, rig.clock
    reader.feed("a", prompt_ids(GRID + 5))
    c._note_backlog("a")
    clock.t += 1.0
    reader.feed("b", prompt_ids(2 * GRID, start=9000))
    c._note_backlog("b")
    assert await c.idle_once() == 3
    chunks = [r for r in rig.probe.calls if r.kind == "chunk"]
    assert len(chunks) == 3
    assert (reader.sessions["a"].committed, reader.sessions["b"].committed) == (GRID, 2 * GRID)
    assert await c.idle_once() == 0  # nothing left


async def test_the_idle_window_looks_when_the_last_turn_ends_not_at_its_next_poll(make_rig):
    """QSE_SHADOW_IDLE_WAKE (on): the round loop letting the engine go wakes the idle loop, which reads the
    backlog at once though its next poll is an hour off."""
    rig = make_rig(idle_poll_s=3600.0)
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    await c.start()
    reader.feed("old", prompt_ids(3 * GRID, start=9000))
    c._note_backlog("old")
    first_chunk = probe.hold("chunk", 1)
    assert len(await rig.turn(prompt_ids(10, start=5000), 3, session="new")) == 3
    await first_chunk.entered  # the idle loop woke and reads: no poll came
    first_chunk.release.set()
    await c.stop()
    assert probe.kinds()[:2] == ["prefill", "decode"] and "chunk" in probe.kinds()
    assert reader.sessions["old"].committed >= GRID


async def test_without_the_wake_the_round_loop_leaves_the_idle_loop_asleep(make_rig):
    rig = make_rig(idle_poll_s=3600.0, idle_wake=False)
    c = rig.conductor
    await c.start()
    assert len(await rig.turn(prompt_ids(10, start=5000), 3, session="new")) == 3
    await c.rounds_ended()
    assert not c._wake.is_set()
    await c.stop()
    assert "chunk" not in rig.probe.kinds()


async def test_each_read_logs_where_its_host_time_went(make_rig):
    """One reader_read event a session read: its chunks and device ms (the chunks' own), and its host time in
    parts (the hop to the reader's thread and back, before the first launch, the chunks, after the last
    readback): what a session switch costs the idle window."""
    import structlog

    rig = make_rig()
    c, reader = rig.conductor, rig.reader
    reader.feed("a", prompt_ids(GRID + 5))
    c._note_backlog("a")
    reader.feed("b", prompt_ids(2 * GRID, start=9000))
    c._note_backlog("b")
    with structlog.testing.capture_logs() as logs:
        assert await c.idle_once() == 3
    reads = [e for e in logs if e["event"] == "reader_read"]
    chunks = [e for e in logs if e["event"] == "chunk"]
    assert [(e["session"], e["chunks"]) for e in reads] == [("a", 1), ("b", 2)]
    for read in reads:
        assert read["gpu_ms"] == pytest.approx(sum(e["gpu_ms"] for e in chunks if e["session"] == read["session"]),
                                               abs=1e-3)
        assert all(read[k] >= 0 for k in ("hop_ms", "back_ms", "setup_ms", "chunks_ms", "drain_ms"))


async def test_the_idle_loop_stops_with_the_conductor(make_rig):
    rig = make_rig(idle_poll_s=3600.0)
    c = rig.conductor
    await c.start()
    await c.stop()  # wakes the loop at once; nothing waits for a poll
    assert c._idle_task is None


def test_the_reader_lookahead_and_lead_come_from_the_config_and_a_bad_one_is_named(make_rig):
    rig = make_rig(reader_lookahead=0, launch_lead_ms=2.5)
    assert (rig.conductor.runner.lookahead, rig.conductor.runner.launch_lead_ms) == (0, 2.5)
    assert make_rig().conductor.runner.lookahead == 1  # the default launches one chunk ahead
    with pytest.raises(ValueError, match=r"QSE_SHADOW_LOOKAHEAD\) must be a whole number of chunks >= 0, got -1"):
        make_rig(reader_lookahead=-1)
    with pytest.raises(ValueError, match=r"QSE_SHADOW_LAUNCH_LEAD_MS\) must be a finite number of ms >= 0, got nan"):
        make_rig(launch_lead_ms=float("nan"))


async def test_an_idle_group_reads_several_chunks_a_launch_with_the_bits_of_one_at_a_time(make_rig):
    """QSE_SHADOW_IDLE_GROUP 4 on the graph path (static): 7 chunks of backlog read in launches of 4, 2 and 1,
    every chunk counted in the window and the ledger, the state that of a reader reading one at a time."""
    rig = make_rig(reader_graphs="static", idle_group=4)
    c, reader = rig.conductor, rig.reader
    assert c.runner.idle_group == 4
    ids = prompt_ids(7 * GRID + 3)
    reader.feed("s", ids)
    c._note_backlog("s")
    assert await c.idle_once() == 7
    session = reader.sessions["s"]
    assert session.committed == 7 * GRID and session.stats.chunks_read == 7
    assert rig.conductor.ledger.spent_us(Role.READER_IDLE) > 0
    assert sorted(k[1] for k in reader.graphs._entries if k[0] == "group") == [2, 4]  # launches of 4, 2 (and 1)
    alone = ShadowReader(reader.engine, grid=GRID, pool_bytes=8 << 20, graphs="static")
    alone.feed("s", ids)
    while alone.read_step("s") is not None:
        pass
    assert all(alone.state_equal(alone.get("s"), session).values())
    with pytest.raises(ValueError, match=r"QSE_SHADOW_IDLE_GROUP\) must be a whole number of chunks >= 1, got 0"):
        make_rig(idle_group=0)


async def test_a_session_too_long_for_the_reader_is_left_and_the_others_are_read(make_rig):
    """A session longer than the reader's whole pool is never tried (it would evict the others, then fail, at
    every poll): the window reads the other sessions, then finds no work; the status says which is too long."""
    page_nbytes = make_rig().reader.pool.page_nbytes
    rig = make_rig(reader_pool_bytes=4 * page_nbytes)  # 4 pages of GRID rows
    c, reader, clock = rig.conductor, rig.reader, rig.clock
    assert reader.max_rows == 4 * GRID
    reader.feed("long", prompt_ids(5 * GRID + 3))
    c._note_backlog("long")
    clock.t += 1.0
    reader.feed("short", prompt_ids(2 * GRID, start=9000))
    c._note_backlog("short")
    assert await c.idle_once() == 2
    assert (reader.sessions["long"].committed, reader.sessions["short"].committed) == (0, 2 * GRID)
    assert not c._idle_has_work()
    assert await c.idle_once() == 0
    shown = {s["session"]: s for s in c.status()["sessions"]}
    assert shown["long"]["too_long"] and shown["long"]["backlog"] == 0 and not shown["short"]["too_long"]


def test_the_idle_loop_waits_for_the_schedulers_next_look(make_rig):
    """The loop looks on the scheduler's lattice (the replay's): until its next look, never longer than a poll,
    and at once (a millisecond) where the clock has passed it."""
    rig = make_rig()
    c, clock = rig.conductor, rig.clock
    poll = c.scheduler.idle.poll_s
    assert c._idle_wait_s() == poll  # no look yet: a poll
    c.scheduler.next_look_s = clock() + poll / 4
    assert c._idle_wait_s() == pytest.approx(poll / 4)
    c.scheduler.next_look_s = clock() + 10 * poll
    assert c._idle_wait_s() == poll
    c.scheduler.next_look_s = clock() - 1.0
    assert c._idle_wait_s() == 1e-3


@pytest.mark.parametrize("share", [True, False], ids=["shared", "own"])
async def test_sessions_that_begin_alike_start_from_each_others_state_reader_and_served(make_rig, share):
    """Three agents' first prompts begin with one 3-chunk head (one harness's system prompt). a is read from
    row 0 by both models; b finds no state of a's at or below the head (a holds only its newest lines) and is
    read from row 0 too, taking the state at the head's line as it goes; c then starts there from b's state on
    the served model and in the reader (QSE_SHARE_HEADS). Every state equals a fresh read of the same ids, and
    c's tokens are the ones it gets without sharing."""
    head = prompt_ids(3 * GRID + 5, start=500)
    prompts = {s: head + prompt_ids(6 * GRID + 7, start=start) for s, start in (("a", 20000), ("b", 30000),
                                                                                 ("c", 40000))}
    rig = make_rig(served_grid=GRID, share_heads=share)
    c, reader = rig.conductor, rig.reader
    out = {}
    for sid, prompt in prompts.items():
        out[sid] = await rig.turn(prompt, 2, session=sid)
        assert await c.idle_once() > 0  # the reader reads the session's prompt and output
    cached = {r.session_id: r.cached_tokens for r in rig.records}
    assert cached == ({"a": 0, "b": 0, "c": 3 * GRID} if share else {"a": 0, "b": 0, "c": 0})
    assert reader.get("c").stats.shared_rows == (3 * GRID if share else 0)
    for sid in prompts:
        fresh = reader.fresh_prefill(reader.get(sid).ids, "__fresh__", group=1)
        assert all(reader.state_equal(reader.get(sid), fresh).values()), sid
    if share:
        alone = make_rig(served_grid=GRID, share_heads=False)
        assert await alone.turn(prompts["c"], 2, session="c") == out["c"]
