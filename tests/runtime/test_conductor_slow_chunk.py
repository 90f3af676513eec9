"""The reader never stalls on the real runtime: a chunk read under load (2.5 s, over a whole idle burst and a
whole slice) is followed by reading in the ration and in the idle window once chunks are cheap again."""

from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role
from qse.core.plan import Window


async def test_a_slow_chunk_is_followed_by_reading_in_the_ration_and_the_idle_window(make_rig):
    rig = make_rig(script_ms={"prefill": 1000.0, "decode": 100.0, "chunk": 2500.0, "fork": 5.0},
                   chunk_prior_ms=20.0, ration_after_s=0.0, busy_share=0.0)  # the turn's own ration alone
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("old", prompt_ids(6 * GRID))
    c._note_backlog("old")
    assert await c.idle_once() == 1  # the one chunk took 2.5 s: the burst is spent
    slow_ms = c.estimator.estimate_ms(reader.sessions["old"].committed)
    assert slow_ms == 2500.0 > c.scheduler.idle.burst_s * 1000 > c.scheduler.rations[Window.RATION].slice_ms  # larger than any window

    probe.script_ms["chunk"] = 10.0  # the load has gone
    mark = len(probe.calls)
    prompt = prompt_ids(4 * GRID + 12, start=4000)
    out = await rig.turn(prompt, 100, session="s")  # 99 rounds of 100 ms
    assert len(out) == 100
    record = rig.records[0]
    chunks = probe.of("chunk", since=mark)
    # the ration waited for a whole slice (150 ms earned: 7.5 s after the first token), read one chunk alone
    # (its estimate, 2.5 s, is over a slice), learnt it costs 10 ms, and went on
    assert round(chunks[0].t0 - record.first_token_s, 6) == 7.5
    # 140 prompt ids and 75 output ids are known by then: 6 whole chunks in that slice, a 7th in a later one
    assert [round((k.t0 - chunks[0].t0) * 1000, 3) for k in chunks[:6]] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert len(chunks) == 7 and all(k.num_ids == GRID for k in chunks)
    assert reader.sessions["s"].committed == 7 * GRID
    assert record.reader_ration_ms == 7 * 10.0
    assert c.estimator.estimate_ms(0) == 10.0

    # the idle window reads the rest of the old session
    assert await c.idle_once() == 5
    assert reader.sessions["old"].backlog == 0
    assert c.ledger.total_ms[Role.READER_IDLE.value] == 2500.0 + 5 * 10.0
