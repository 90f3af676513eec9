"""Served sessions: every turn's first token equals a cold prefill of the same prompt, bit for bit, whichever
tier the reused state came from; the kept state equals the cold one; caps hold; bad files are misses."""

from __future__ import annotations

import os

import pytest
import torch

from qse.sessions.check import greedy_turn
from qse.sessions.grid import GridSessions, SessionError
from qse.sessions.served import ServedSessions
from qse.store import ShadowStore

GRID = 32
VOCAB = 248000


def _served(engine, store=None, graphs=False, pool_bytes=16 << 20, recent=2, group=1) -> ServedSessions:
    book = GridSessions(engine, grid=GRID, pool_bytes=pool_bytes, residency=store, graphs=graphs,
                        recent_checkpoints=recent, chunk_group=group, who="the served model")
    return ServedSessions(book)


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def _turn(served: ServedSessions, sid: str, prompt: list[int], steps: int = 3):
    return greedy_turn(served, sid, prompt, steps)


def _cold(engine, prompt: list[int], steps: int = 3, graphs=False):
    cold = _served(engine, graphs=graphs)
    first, tokens, start = _turn(cold, "cold", prompt, steps)
    assert start.cached_tokens == 0
    return first, tokens, cold


def _agent_turns(gen: torch.Generator, num_turns: int) -> list[list[int]]:
    """Prompts of an agent: each turn resends the last prompt with the output and new ids; turn 3 re-renders
    the middle (a rollback)."""
    prompt = _ids(gen, 2 * GRID + 7)
    turns = [prompt]
    for n in range(1, num_turns):
        prompt = prompt + _ids(gen, 5 + 11 * n)
        if n == 3:
            cut = len(prompt) // 2
            prompt = prompt[:cut] + _ids(gen, 3) + prompt[cut + 3:]
        turns.append(prompt)
    return turns


@pytest.mark.parametrize("graphs, group", [(False, 1), ("static", 1), ("static", 4)],
                         ids=["eager", "static-graph", "static-graph-groups"])
def test_every_turn_equals_a_cold_prefill_bit_for_bit(tiny_engine, graphs, group):
    """(groups: the turns' prompts read up to 4 chunks a launch; the cold prefill one at a time.)"""
    gen = torch.Generator().manual_seed(7)
    served = _served(tiny_engine, graphs=graphs, group=group)
    rolled = 0
    for i, prompt in enumerate(_agent_turns(gen, 5)):
        first, tokens, start = _turn(served, "agent", prompt)
        cold_first, cold_tokens, cold = _cold(tiny_engine, prompt, graphs=graphs)
        assert torch.equal(first, cold_first), f"turn {i}"
        assert tokens == cold_tokens
        # the kept state: every KV row below the committed line, the recurrent and the conv state
        assert served.book.state_equal(served.book.get("agent"), cold.book.get("cold")) == {
            "committed": True, "kv": True, "recurrent": True, "conv": True}
        if i:
            assert start.cached_tokens > 0 and start.tier == "device"
        rolled += start.rolled_back_to is not None
        assert start.cached_tokens + start.chunks_read * GRID + start.tail_tokens == len(prompt)
        assert 1 <= start.tail_tokens <= GRID
    assert rolled == 1  # the re-rendered middle went back to a checkpoint
    assert served.counts["hit_tokens"] > 0 and served.counts["hits_device"] == 4


def test_a_prompt_ending_on_a_grid_line_keeps_a_whole_chunk_as_its_tail(tiny_engine):
    gen = torch.Generator().manual_seed(3)
    prompt = _ids(gen, 3 * GRID)
    served = _served(tiny_engine)
    first, _, start = _turn(served, "s", prompt, steps=1)
    assert (start.chunks_read, start.tail_tokens) == (2, GRID)
    assert served.book.get("s").committed == 2 * GRID
    cold_first, _, _ = _cold(tiny_engine, prompt, steps=1)
    assert torch.equal(first, cold_first)


@pytest.mark.parametrize("graphs", [False, "static"], ids=["eager", "static-graph"])
def test_the_turns_rows_are_dropped_and_pages_come_back(tiny_engine, graphs):
    """(On the graph path the tail's padding rows take pages above the tail's: they come back too.)"""
    gen = torch.Generator().manual_seed(4)
    served = _served(tiny_engine, graphs=graphs)
    free = served.book.pool.num_free  # (the rounds keep one scratch page for padding rows)
    prompt = _ids(gen, GRID + 5)
    _turn(served, "s", prompt, steps=GRID + 3)  # the decode crosses page lines
    session = served.book.get("s")
    assert session.cache.length == session.committed == GRID
    assert len(session.kv.pages) == 1
    assert served.book.pool.num_free == free - 1


def _tiered(tiny_engine, tmp_path, cap_pages: float, host_pages: float):
    """A store whose device cap holds about `cap_pages` sessions' worth and host cap `host_pages`."""
    probe = _served(tiny_engine)
    gen = torch.Generator().manual_seed(11)
    _turn(probe, "p", _ids(gen, 3 * GRID + 1), steps=1)
    one = probe.book.get("p").nbytes
    store = ShadowStore(int(one * cap_pages), tmp_path / "served", host_cap_nbytes=int(one * host_pages), journal=True)
    served = _served(tiny_engine, store=store)
    store.attach(served.book)
    return served, store


def test_every_tier_gives_back_the_cold_prefills_bits(tiny_engine, tmp_path):
    """Four sessions take turns under a device cap of about one session and a host cap of about two: each
    turn's state comes back from the device, the host or the disk, and every turn equals a cold prefill."""
    served, store = _tiered(tiny_engine, tmp_path, cap_pages=1.5, host_pages=2.5)
    gen = torch.Generator().manual_seed(5)
    prompts = {sid: _agent_turns(gen, 4) for sid in "abcd"}
    turns = {sid: 0 for sid in prompts}
    tiers = []
    for sid in "abaacdab":  # a from the host (b came between), then the device; b spilled to disk by c and d
        prompt = prompts[sid][turns[sid]]
        turns[sid] += 1
        first, tokens, start = _turn(served, sid, prompt)
        cold_first, cold_tokens, cold = _cold(tiny_engine, prompt)
        assert torch.equal(first, cold_first), (sid, start.tier)
        assert tokens == cold_tokens
        assert served.book.state_equal(served.book.get(sid), cold.book.get("cold")) == {
            "committed": True, "kv": True, "recurrent": True, "conv": True}
        tiers.append(start.tier)
        # the caps hold after every turn (one session alone may be over the device cap)
        resident = [s for s in served.book.sessions.values() if s.is_resident]
        assert len(resident) == 1 or served.book.resident_nbytes() <= store.cap_nbytes
        assert store.host_nbytes() <= store.host_cap_nbytes
    assert tiers == [None, None, "host", "device", None, None, "host", "disk"], tiers
    assert (served.counts["hits_device"], served.counts["hits_host"], served.counts["hits_disk"]) == (1, 2, 1)
    stats = store.stats()
    assert stats["host_restores"] == 2 and stats["restores"] == 1 and stats["host_spills"] >= 1


def test_a_torn_or_foreign_served_file_is_a_miss_and_a_cold_read(tiny_engine, tmp_path):
    served, store = _tiered(tiny_engine, tmp_path, cap_pages=0.5, host_pages=0)
    gen = torch.Generator().manual_seed(6)
    a, b = _agent_turns(gen, 2), _agent_turns(gen, 2)
    _turn(served, "a", a[0])
    _turn(served, "b", b[0])  # "a" is parked on disk to make room
    assert store.tier_of("a") == "disk"
    path = store.parked["a"].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the body
    path.write_bytes(bytes(data))
    first, _, start = _turn(served, "a", a[1])
    assert start.cached_tokens == 0 and start.tier is None
    assert store.misses["checksum"] == 1
    cold_first, _, _ = _cold(tiny_engine, a[1])
    assert torch.equal(first, cold_first)
    # a foreign file (another session's state under this one's name) is a miss too
    c = _agent_turns(gen, 1)[0]
    _turn(served, "b", b[1])  # "a" parked again
    _turn(served, "c", c)  # "b" parked
    assert store.tier_of("a") == store.tier_of("b") == "disk"
    os.replace(store.parked["a"].path, store.parked["b"].path)
    first, _, start = _turn(served, "b", b[1] + [5, 6, 7])
    assert start.cached_tokens == 0 and store.misses["session_id"] == 1
    cold_first, _, _ = _cold(tiny_engine, b[1] + [5, 6, 7])
    assert torch.equal(first, cold_first)


def test_a_restart_knows_every_fed_session_from_the_ids_journal(tiny_engine, tmp_path):
    """A killed process (nothing parked at the end): the journal still knows each session's ids, and its next
    turn equals a cold prefill; a parked then fed session keeps its newest ids."""
    served, store = _tiered(tiny_engine, tmp_path, cap_pages=0.5, host_pages=0)
    gen = torch.Generator().manual_seed(8)
    a, b = _agent_turns(gen, 3), _agent_turns(gen, 3)
    _turn(served, "a", a[0])
    _turn(served, "b", b[0])  # "a" parked
    _turn(served, "a", a[1])  # "a" restored (its file removed), "b" parked
    # the process dies here: no park_all
    again = ShadowStore(store.cap_nbytes, tmp_path / "served", journal=True)
    restarted = _served(tiny_engine, store=again)
    report = again.attach(restarted.book)
    assert set(restarted.book.sessions) == {"a", "b"}
    assert report["journaled"] == 1  # "a" had no state file left: known from its ids alone
    assert restarted.book.get("a").ids == a[1] and restarted.book.get("b").ids == b[0]
    for sid, prompt in (("a", a[2]), ("b", b[2])):
        first, _, _ = _turn(restarted, sid, prompt)
        cold_first, _, _ = _cold(tiny_engine, prompt)
        assert torch.equal(first, cold_first)


def test_a_planned_stop_writes_every_session_and_a_restart_resumes_them(tiny_engine, tmp_path):
    served, store = _tiered(tiny_engine, tmp_path, cap_pages=1.5, host_pages=1.5)
    gen = torch.Generator().manual_seed(9)
    prompts = {sid: _agent_turns(gen, 2) for sid in ("a", "b", "c")}
    for sid, p in prompts.items():
        _turn(served, sid, p[0])
    report = store.park_all(served.book)
    assert report["failed"] == [] and report["files"] == 3 and not store.host
    again = ShadowStore(store.cap_nbytes, tmp_path / "served", journal=True)
    restarted = _served(tiny_engine, store=again)
    assert again.attach(restarted.book)["sessions"] == 3
    for sid, p in prompts.items():
        first, _, start = _turn(restarted, sid, p[1])
        assert start.tier == "disk" and start.cached_tokens > 0
        cold_first, _, _ = _cold(tiny_engine, p[1])
        assert torch.equal(first, cold_first)


def test_bad_prompts_are_refused_by_name(tiny_engine):
    served = _served(tiny_engine)
    with pytest.raises(SessionError, match="empty prompt"):
        served.begin("s", [])
    with pytest.raises(SessionError, match="outside the vocabulary"):
        served.begin("s", [1, 2, VOCAB + 10_000])
    window = tiny_engine.cfg.max_position_embeddings
    with pytest.raises(SessionError, match="window"):
        served.begin("s", [1] * window)
    for bad, says in (([5, -1, 2], "token id -1 is outside"), ([5, 2.0], "token id 2.0 is outside"),
                      ([5, "7"], "token id '7' is outside"), ([5, [6]], r"token id \[6\] is outside"),
                      ([5, None], "token id None is outside"), ([True], "got elements of bool")):
        with pytest.raises(SessionError, match=says):
            served.begin("s", bad)
    assert "s" not in served.book.sessions  # a refused prompt leaves no session behind


def test_a_turn_start_reports_where_its_time_went(tiny_engine, tmp_path):
    """Each phase is reported: a host hit restores (no eviction: the pool has room), a device hit restores
    nothing, and the chunks and the tail are timed on every turn."""
    served, store = _tiered(tiny_engine, tmp_path, cap_pages=4, host_pages=4)
    gen = torch.Generator().manual_seed(12)
    first = _ids(gen, 2 * GRID + 7)
    prompts = [first, first + _ids(gen, 2 * GRID)]
    prompts.append(prompts[1] + [5])
    _turn(served, "a", prompts[0])
    assert store.move_to_host(served.book, served.book.get("a"))
    _, _, host = _turn(served, "a", prompts[1])
    _, _, device = _turn(served, "a", prompts[2])
    assert host.tier == "host" and device.tier == "device"
    assert host.restore_ms > 0 and device.restore_ms == 0
    assert host.evict_ms == device.evict_ms == 0
    assert all(s.tail_ms > 0 and s.read_ms >= 0 for s in (host, device))
    assert host.chunks_read > 0 and host.read_ms > 0


def test_warming_the_tails_reads_every_length_class_and_leaves_nothing(tiny_engine):
    from qse.sessions.served import tail_lengths

    lengths = tail_lengths(GRID)
    assert lengths == [1, 16, 17, 32]
    assert tail_lengths(512)[:4] == [1, 16, 17, 32] and tail_lengths(512)[-2:] == [497, 512]
    served = _served(tiny_engine)
    free = served.book.pool.num_free
    served.warm(tails=True)
    assert served.book.sessions == {} and served.book.pool.num_free == free
    assert served.counts["queries"] == 0 and served.rounds.num_free == served.rounds.max_running


def test_a_prompt_read_in_pieces_between_decode_rounds_equals_a_cold_prefill(tiny_engine):
    """Turn b's 4-chunk prompt is read one chunk at a time while turn a decodes between the pieces (as the round
    loop does): b's first token equals a cold prefill, a's steps equal a alone, and b's kept state the cold one."""
    gen = torch.Generator().manual_seed(12)
    a_prompt, b_prompt = _ids(gen, GRID + 3), _ids(gen, 4 * GRID + 9)
    a_first, a_tokens, _ = _cold(tiny_engine, a_prompt, steps=6)
    b_first, b_tokens, b_cold = _cold(tiny_engine, b_prompt, steps=3)
    book = GridSessions(tiny_engine, grid=GRID, pool_bytes=16 << 20, recent_checkpoints=2, who="the served model")
    served = ServedSessions(book, max_running=2)
    a, logits = served.begin("a", a_prompt)
    assert torch.equal(logits[-1], a_first)
    b = served.open("b", b_prompt)
    assert b.chunks_left == 4
    a_seen = []
    while b.chunks_left:
        a_seen.append(int(torch.argmax(logits[-1])))
        logits, _ = served.decode(a, a_seen[-1])
        served.read_chunks(b, 1)  # one chunk of b between two of a's rounds
    first = served.first_token(b)
    assert torch.equal(first[-1], b_first)
    assert b.start.chunks_read == 4 and b.start.tail_tokens == 9
    b_seen = [int(torch.argmax(first[-1]))]
    while len(b_seen) < 3:  # both in one round now
        a_seen.append(int(torch.argmax(logits[0])))
        logits, _ = served.decode_round([a, b], [a_seen[-1], b_seen[-1]])
        b_seen.append(int(torch.argmax(logits[1])))
    assert a_seen == a_tokens[:len(a_seen)] and b_seen == b_tokens
    served.finish(a)
    served.finish(b)
    assert served.book.state_equal(served.book.get("b"), b_cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}
    assert served.rounds.num_free == 2 and served._reserved == 0


@pytest.mark.parametrize("graphs", [False, "static"], ids=["eager", "static-graph"])
def test_the_tail_launches_behind_the_last_chunk_it_holds(tiny_engine, graphs):
    """read_chunks(hold_last) leaves the last chunk it launched running (only that one): the next piece of the
    prompt (the next round's) launches its chunk before reading the held one back, and first_token launches the
    tail behind it and then counts it; the first token is a cold prefill's bits. A turn ended before its first
    token waits for the chunk it held, and the session's next turn is again a cold prefill's."""
    gen = torch.Generator().manual_seed(21)
    prompt = _ids(gen, 3 * GRID + 5)
    cold_first, _, cold = _cold(tiny_engine, prompt, steps=1, graphs=graphs)
    served = _served(tiny_engine, graphs=graphs)
    turn = served.open("s", prompt)
    served.read_chunks(turn, 2, hold_last=True)  # chunk 1 read back, chunk 2 left running
    assert [p.start for p in turn.held] == [GRID] and turn.chunks_left == 1 and turn.start.chunks_read == 2
    assert served.book.stats.chunks == 1
    ms_one = turn.start.gpu_ms
    served.read_chunks(turn, hold_last=True)  # chunk 3 launched, then chunk 2 read back; chunk 3 held
    assert [p.start for p in turn.held] == [2 * GRID] and turn.chunks_left == 0 and turn.start.chunks_read == 3
    assert served.book.stats.chunks == 2 and turn.start.gpu_ms >= ms_one  # the held chunk counts once waited for
    ms_two = turn.start.gpu_ms
    first = served.first_token(turn)
    assert torch.equal(first[-1], cold_first)
    assert turn.held == [] and turn.start.gpu_ms > ms_two and served.book.stats.chunks == 3
    served.finish(turn)
    longer = prompt + _ids(gen, 2 * GRID + 3)
    turn = served.open("s", longer)
    served.read_chunks(turn, hold_last=True)
    assert len(turn.held) == 1
    served.finish(turn)  # no first token: the held chunk is waited for and counted
    assert turn.held == [] and served.book.stats.chunks == 5
    final = longer + _ids(gen, 4)
    again, _, start = _turn(served, "s", final, steps=1)
    cold_final, _, _ = _cold(tiny_engine, final, steps=1, graphs=graphs)
    assert start.cached_tokens == 5 * GRID and torch.equal(again, cold_final)


def test_a_prompt_that_is_a_grid_line_prefix_of_the_kept_ids_rolls_back_a_chunk(tiny_engine):
    """The new prompt ends on a grid line the session holds: the first token still needs the last chunk's
    logits, so the turn starts from the line before and reads that chunk as its tail."""
    gen = torch.Generator().manual_seed(11)
    long = _ids(gen, 4 * GRID + 9)
    served = _served(tiny_engine)
    _turn(served, "s", long, steps=2)
    short = long[:3 * GRID]
    first, tokens, start = _turn(served, "s", short, steps=2)
    cold_first, cold_tokens, cold = _cold(tiny_engine, short, steps=2)
    assert torch.equal(first, cold_first)
    assert tokens == cold_tokens
    assert 1 <= start.tail_tokens <= GRID
    assert start.cached_tokens + start.chunks_read * GRID + start.tail_tokens == len(short)
    assert served.book.state_equal(served.book.get("s"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}


@pytest.mark.parametrize("fail_at", [3, 13], ids=["first-chunk", "second-chunk"])
def test_a_chunk_that_fails_part_way_leaves_no_half_read_state(tiny_engine, monkeypatch, fail_at):
    """An out-of-memory inside a chunk's forward, after some layers wrote the session's state in place: the
    turn fails, and the session's next turn still equals a cold prefill bit for bit (it went back to a
    checkpoint at or below the failed chunk, never on from its half-written state)."""
    gen = torch.Generator().manual_seed(23)
    first_prompt = _ids(gen, 3 * GRID + 5)
    prompt = first_prompt + _ids(gen, 3 * GRID + 7)
    served = _served(tiny_engine)
    _turn(served, "s", first_prompt, steps=2)
    model, real, calls = tiny_engine.model, tiny_engine.model._mlp, [0]

    def failing_mlp(p, h):
        calls[0] += 1
        if calls[0] == fail_at:  # part-way through a chunk: earlier layers' state already written
            raise torch.cuda.OutOfMemoryError("injected")
        return real(p, h)

    monkeypatch.setattr(model, "_mlp", failing_mlp)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _turn(served, "s", prompt, steps=2)
    monkeypatch.setattr(model, "_mlp", real)
    session = served.book.get("s")
    assert session.committed <= 3 * GRID + (GRID if fail_at > 8 else 0)  # not past the failed chunk
    first, tokens, start = _turn(served, "s", prompt, steps=2)
    cold_first, cold_tokens, _ = _cold(tiny_engine, prompt, steps=2)
    assert start.cached_tokens > 0  # a checkpoint's state, not a read from row 0
    assert torch.equal(first, cold_first) and tokens == cold_tokens


def test_a_turn_ends_and_frees_its_slot_when_the_chunk_it_held_cannot_be_waited_for(tiny_engine, monkeypatch):
    gen = torch.Generator().manual_seed(29)
    served = _served(tiny_engine)
    turn = served.open("s", _ids(gen, 2 * GRID + 3))
    served.read_chunks(turn, hold_last=True)
    assert len(turn.held) == 1 and served._reserved == 1

    def failed(pending):
        raise RuntimeError("CUDA error: injected")

    monkeypatch.setattr(served.book, "finish_step", failed)
    served.finish(turn)
    assert not turn.is_open and turn.held == [] and served._reserved == 0
    assert served.rounds.num_free == served.rounds.max_running


def test_a_prompt_read_in_chunk_groups_keeps_to_the_rounds_allowance(tiny_engine):
    """With a chunk group of 4, read_chunks(turn, 3) reads 3 chunks (a group of 2, then one), never 4; the
    rest and the first token then equal a cold prefill read one chunk at a time."""
    gen = torch.Generator().manual_seed(31)
    prompt = _ids(gen, 7 * GRID + 3)
    cold_first, _, cold = _cold(tiny_engine, prompt, steps=1, graphs="static")
    served = _served(tiny_engine, graphs="static", group=4)
    launches, launch_step = [], served.book.launch_step

    def spy(*args, **kwargs):
        pending = launch_step(*args, **kwargs)
        if pending is not None:
            launches.append(pending.chunks)
        return pending

    served.book.launch_step = spy
    turn = served.open("s", prompt)
    served.read_chunks(turn, 3)
    assert turn.start.chunks_read == 3 and turn.chunks_left == 4 and launches == [2, 1]
    served.read_chunks(turn)
    assert turn.chunks_left == 0 and launches == [2, 1, 4]  # the last four in one launch
    first = served.first_token(turn)
    assert torch.equal(first[-1], cold_first)
    served.finish(turn)
    assert served.book.state_equal(served.book.get("s"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}


def test_a_tail_read_in_its_class_graph_is_the_eager_tail_to_rounding(tiny_engine):
    """The graph path reads a tail padded to its class (ForwardGraphs.run_tail): its first token's logits are the
    eager read's to fp32 rounding (the GEMMs see more rows), and both paths agree with themselves cold."""
    gen = torch.Generator().manual_seed(12)
    prompt = _ids(gen, 2 * GRID + 9)
    eager_first, eager_tokens, _ = _turn(_served(tiny_engine), "s", prompt)
    graph_first, graph_tokens, start = _turn(_served(tiny_engine, graphs="static"), "s", prompt)
    assert start.tail_tokens == 9
    torch.testing.assert_close(graph_first, eager_first, rtol=1e-4, atol=1e-4)
    assert graph_tokens == eager_tokens


def test_a_prompt_rewritten_below_every_prompt_checkpoint_goes_back_to_the_ladder_bit_equal(tiny_engine):
    """A session read to 7 chunks, then a prompt that keeps only its first 5 chunks and 3 ids (an agent's
    context rewritten past its system prompt): without the ladder it reads from row 0; with a ladder from 2
    chunks it goes back to 4 chunks (the ladder's 64, 128: the highest at or below what it keeps), and its
    first token's logits, its tokens and its state equal a cold prefill's, bit for bit."""
    gen = torch.Generator().manual_seed(31)
    first = _ids(gen, 7 * GRID + 4)
    rewritten = first[:5 * GRID + 3] + _ids(gen, 2 * GRID + 9)
    cold_first, cold_tokens, cold = _cold(tiny_engine, rewritten, steps=2)
    starts = {}
    for ladder in (0, 2 * GRID):
        book = GridSessions(tiny_engine, grid=GRID, pool_bytes=16 << 20, recent_checkpoints=2, ladder_from=ladder,
                            who="the served model")
        served = ServedSessions(book)
        _turn(served, "s", first, steps=2)
        logits, tokens, start = _turn(served, "s", rewritten, steps=2)
        assert torch.equal(logits, cold_first) and tokens == cold_tokens
        assert book.state_equal(book.get("s"), cold.book.get("cold")) == {
            "committed": True, "kv": True, "recurrent": True, "conv": True}
        starts[ladder] = (start.rolled_back_to, start.cached_tokens)
    assert starts == {0: (0, 0), 2 * GRID: (4 * GRID, 4 * GRID)}


@pytest.mark.parametrize("donor_id,shared", [("t1/a", True), ("t2/a", False)], ids=["one-tenant", "two-tenants"])
def test_a_first_turn_starts_from_another_sessions_state_where_their_prompts_agree(tiny_engine, donor_id, shared):
    """Session a read a prompt (checkpoints of the ladder at 2 and 4 chunks); b's first prompt begins with a's
    first 5 chunks and 3 ids (one harness's system prompt and tools), then goes its own way. Inside one tenant b
    starts from a's state at 4 chunks (its KV rows and GDN state copied), and its first token's logits, tokens
    and state equal a cold prefill's bit for bit; a third session then starts from b's state at the shared
    head's line (5 chunks), which b took as it read; across tenants nothing is shared."""
    from qse.core.ids import same_namespace

    gen = torch.Generator().manual_seed(41)
    head = _ids(gen, 5 * GRID + 3)
    first_a, first_b = head + _ids(gen, 2 * GRID + 9), head + _ids(gen, 3 * GRID + 1)
    cold_first, cold_tokens, cold = _cold(tiny_engine, first_b, steps=2)
    book = GridSessions(tiny_engine, grid=GRID, pool_bytes=16 << 20, recent_checkpoints=2, ladder_from=2 * GRID,
                        who="the served model")
    served = ServedSessions(book, may_share=same_namespace)
    _turn(served, donor_id, first_a, steps=2)
    logits, tokens, start = _turn(served, "t1/b", first_b, steps=2)
    assert torch.equal(logits, cold_first) and tokens == cold_tokens
    assert book.state_equal(book.get("t1/b"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}
    if shared:
        assert (start.cached_tokens, start.shared_from, start.tier) == (4 * GRID, "t1/a", "device")
        assert start.chunks_read == 4 and book.stats.shared_rows == 4 * GRID  # (b's line: 8 chunks)
        # b took the state at its shared head's line (5 chunks) as it read: a third session starts there
        first_c = head + _ids(gen, 2 * GRID + 7)
        cold_c, _, _ = _cold(tiny_engine, first_c, steps=1)
        logits_c, _, start_c = _turn(served, "t1/c", first_c, steps=1)
        assert (start_c.cached_tokens, start_c.shared_from) == (5 * GRID, "t1/b") and torch.equal(logits_c, cold_c)
    else:
        assert (start.cached_tokens, start.shared_from) == (0, None) and book.stats.shared_rows == 0
    # a's next turn is untouched by what b copied: from its own state, a cold prefill's bits
    next_a = first_a + _ids(gen, GRID + 2)
    again, _, a_start = _turn(served, donor_id, next_a, steps=1)
    cold_again, _, _ = _cold(tiny_engine, next_a, steps=1)
    assert torch.equal(again, cold_again) and a_start.cached_tokens == 7 * GRID and a_start.shared_from is None


def test_a_namespace_is_what_precedes_the_first_slash():
    from qse.core.ids import namespace_of

    assert [namespace_of(k) for k in ("t/x", "admin/t/x", "x", "", "/x")] == ["t/", "admin/", "", "", "/"]
