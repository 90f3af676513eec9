"""Turns on the real runtime: the ledger holds what was measured, the ration and the narrator's share stay
within what the turn earned since its first token in whole chunks, requests queue FIFO, and the router's
question is asked exactly where the turn inserted it."""

import asyncio
import json
import math

import pytest
from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role, ms_to_us
from qse.core.locks import Priority
from qse.core.plan import Window
from qse.runtime.conductor import GenerateRequest, ShadowOptions
from qse.runtime.narrator import Narration


def _us(calls) -> int:
    return sum(ms_to_us(c.ms) for c in calls)


async def test_the_ledger_holds_exactly_what_was_measured(make_rig):
    import time

    rig = make_rig(clock=time.monotonic, shared=True)  # real clock, real measurements
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("x", prompt_ids(3 * GRID + 7))
    assert await c.idle_once() == 3
    idle_chunks = probe.of("chunk")

    mark = len(probe.calls)
    out = await rig.turn(prompt_ids(2 * GRID + 3, start=7000), 5, session="y")
    assert len(out) == 5
    turn_calls = probe.calls[mark:]
    ration_chunks = [k for k in turn_calls if k.kind == "chunk"]

    answer = await c.ask("x", "Is this a test?", ["A", "B"])
    summary = await c.summarize("x", "Summarize.", 3)

    total = c.ledger.balance()
    assert total.gpu_us.get(Role.READER_IDLE, 0) == _us(idle_chunks)
    assert total.gpu_us.get(Role.READER_RATION, 0) == _us(ration_chunks)
    assert total.gpu_us[Role.SERVED_PREFILL] == _us(k for k in turn_calls if k.kind == "prefill")
    assert total.gpu_us[Role.SERVED_DECODE] == _us(k for k in turn_calls if k.kind == "decode")
    assert total.gpu_us[Role.READER_ASK] == ms_to_us(answer.gpu_ms)
    assert total.gpu_us[Role.NARRATOR] == ms_to_us(summary.gpu_ms)
    assert c.ledger.total_ms == {role.value: total.gpu_us.get(role, 0) / 1000 for role in Role}
    assert c.status()["ledger_ms"]["reader_idle"] == round(_us(idle_chunks) / 1000, 3)
    record = rig.records[0]
    assert ms_to_us(record.reader_ration_ms) == _us(ration_chunks)
    assert ms_to_us(record.decode_ms) == _us(k for k in turn_calls if k.kind == "decode")
    assert c.ledger.num_open_turns == 0


SCRIPT = {"prefill": 1000.0, "decode": 100.0, "chunk": 10.0, "fork": 5.0}


async def test_the_ration_never_exceeds_what_the_turn_earned_and_reads_whole_chunks(make_rig):
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=0.0)
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reports = []
    finish_step = reader.finish_step
    reader.finish_step = lambda pending: reports.append(finish_step(pending)) or reports[-1]

    prompt = prompt_ids(4 * GRID + 12)
    out = await rig.turn(prompt, 40, session="s")
    assert len(out) == 40
    record = rig.records[0]
    first_token_s = record.first_token_s
    assert first_token_s == 100.0 + 1.0  # the scripted prefill

    chunks = probe.of("chunk")
    assert chunks, "the ration read nothing"
    spent_us = 0
    for chunk in chunks:
        spent_us += ms_to_us(chunk.ms)
        earned_us = math.floor(0.02 * round((chunk.t0 - first_token_s) * 1e6))
        assert spent_us <= earned_us, (chunk, spent_us, earned_us)
    # the first slice: 20 ms (the prior) earned 1 s after the first token, two 10 ms chunks in it
    assert round(chunks[0].t0 - first_token_s, 6) == 1.0 and round(chunks[1].t0 - chunks[0].t0, 6) == 0.01
    # whole chunks on the grid, the prompt first, then the output so far
    assert [(r.context, r.position - r.context) for r in reports] == [(i * GRID, GRID) for i in range(5)]
    assert reports[-1].position > len(prompt)  # the fifth chunk holds output ids
    assert all(k.num_ids == GRID for k in chunks)
    assert record.reader_ration_ms == 5 * 10.0
    assert record.decode_ms == 39 * 100.0 and record.prefill_ms == 1000.0
    assert record.reader_share == 50.0 / 3900.0
    assert c.ledger.total_ms["reader_ration"] == 50.0
    assert c.ledger.balance().estimate_error_us(Role.READER_RATION) == -10_000  # the prior said 20, it cost 10


async def test_the_ration_counts_from_ration_after_s_past_the_first_token(make_rig):
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=2.0)
    c, probe = rig.conductor, rig.probe
    assert (c.scheduler.rations[Window.RATION].after_s, c.scheduler.rations[Window.NARRATOR].after_s) == (2.0, 0.0)
    out = await rig.turn(prompt_ids(4 * GRID + 12), 40, session="s")  # 39 rounds of 100 ms: a 3.9 s decode
    assert len(out) == 40
    record = rig.records[0]
    since_s = record.first_token_s + 2.0
    chunks = probe.of("chunk")
    spent_us = 0
    for chunk in chunks:
        spent_us += ms_to_us(chunk.ms)
        assert spent_us <= math.floor(0.02 * round((chunk.t0 - since_s) * 1e6)), (chunk, spent_us)
    # the first slice opens when the prior's 20 ms are earned, 1 s after the delay: two 10 ms chunks in it;
    # the third when 30 ms are earned (0.5 s later, plus the 20 ms the reader took from the rounds)
    assert [round(k.t0 - record.first_token_s, 6) for k in chunks] == [3.0, 3.01, 3.52]
    assert record.reader_ration_ms == 3 * 10.0


async def test_a_short_turn_spends_no_ration_inside_the_delay(make_rig):
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=5.0)
    out = await rig.turn(prompt_ids(4 * GRID + 12), 40, session="s")  # a 3.9 s decode, all inside the delay
    assert len(out) == 40
    assert rig.probe.of("chunk") == []
    assert rig.records[0].reader_ration_ms == 0.0 and rig.records[0].reader_share == 0.0
    assert await rig.conductor.idle_once() == 5  # the idle window after it reads the backlog


@pytest.mark.parametrize("ration_after_s", [0.0, 5.0], ids=["reader-undelayed", "reader-after-5s"])
async def test_the_live_narrator_summarises_the_thought_before_the_answer_ends(make_rig, scripted_sampler,
                                                                                 ration_after_s):
    # the reader's delay does not move the narrator's share
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=ration_after_s,
                   options=ShadowOptions(narrator="on", narrator_max_tokens=3))
    c, probe = rig.conductor, rig.probe
    think_end = c.served.chat.thought_end_id
    thought, answer = prompt_ids(10, start=30_000), prompt_ids(60, start=40_000)
    scripted_sampler.script = thought + [think_end] + answer
    prompt = prompt_ids(3 * GRID + 5)
    events: list = []
    req = GenerateRequest(prompt_ids=prompt, max_tokens=len(scripted_sampler.script), session_id="a",
                          narrate=events.append)
    async for token in c.generate(req):
        events.append(token)

    narrations = [e for e in events if isinstance(e, Narration)]
    assert len(narrations) == 1 and narrations[0].live and 1 <= narrations[0].tokens <= 3
    tokens = [e for e in events if not isinstance(e, Narration)]
    assert tokens == thought + [think_end] + answer
    # delivered while the answer streamed: after the thought's end, before the answer's last token
    at = events.index(narrations[0])
    assert len(thought) + 1 <= at < len(events) - 1
    assert narrations[0].position >= len(prompt) + len(thought) + 1  # the fork stood above the thought's end
    record = rig.records[0]
    first_fork = probe.kinds().index("fork")
    assert first_fork < len(probe.calls) - 1  # the summary ran inside the turn, decode rounds came after it
    # the prompt's and the thought's 3 whole chunks were read before the summary (by the narrator, and by the
    # reader's ration where it was not delayed); the summary (its prefill and decode steps on a fork) is charged
    # to the turn's narrator as measured
    assert [k.kind for k in probe.calls[:first_fork]].count("chunk") == 3
    narrator_chunk_ms = record.narrator_ms - narrations[0].gpu_ms
    assert narrator_chunk_ms == pytest.approx(30.0 if ration_after_s > 0 else 20.0, abs=1e-3)
    # within its share: 3 % of the time since the first token, counted from the first token itself
    assert narrator_chunk_ms <= 0.03 * (probe.calls[first_fork].t0 - record.first_token_s) * 1e3 + 1e-3
    assert c.status()["narrator"]["live"] == 1 and c.status()["narrator"]["following"] == 0


def chunks_start_after(elapsed_s: float, threshold_s: float) -> bool:
    return elapsed_s >= threshold_s - 1e-9


async def test_concurrent_requests_queue_fifo_within_rank_and_each_completes(make_rig):
    rig = make_rig(shared=True)
    c, probe = rig.conductor, rig.probe
    first_decode = probe.hold("decode", 1)
    tasks = {"r0": asyncio.create_task(rig.turn(prompt_ids(8), 4, session="s0", request_id="r0"))}
    await first_decode.entered
    order: list[str] = []
    rig.reader.feed("q", prompt_ids(GRID))

    async def ask():
        await c.ask("q", "Yes or no?", ["A", "B"])
        order.append("ask")

    for name in ("r1", "ask", "r2", "r3"):
        if name == "ask":
            waiting = c.board.engine.num_waiting
            tasks[name] = asyncio.create_task(ask())
            await c.board.engine.wait_for_waiters(waiting + 1)  # the question waits for the engine
        else:
            queued = c.num_waiting
            tasks[name] = asyncio.create_task(rig.turn(prompt_ids(8, start=100 * len(tasks)), 4, session=f"s{name}",
                                                       request_id=name))
            await c.wait_for_waiting(queued + 1)  # a turn queues for the round loop
    assert c.status()["waiting"] == 4 and c.status()["running"] == ["r0"]
    assert not c.board.engine.has_waiter_above(Priority.QUESTION)  # the turns queue for the rounds, not the engine
    first_decode.release.set()
    outs = await asyncio.gather(*tasks.values())
    assert [r.request_id for r in rig.records] == ["r0", "r1", "r2", "r3"]  # FIFO among served requests
    assert all(len(o) == 4 for name, o in zip(tasks, outs) if name != "ask")
    assert order == ["ask"] and probe.kinds()[-1] == "fork"  # the question went after every served request
    starts = [r.start_s for r in rig.records]
    assert starts == sorted(starts)


async def test_the_router_question_is_asked_where_the_turn_inserted_it(make_rig, tmp_path):
    rig = make_rig(options=ShadowOptions(router="shadow", router_min_tokens=64))
    c, probe = rig.conductor, rig.probe
    im_end = c.served.chat.turn_end_id
    prompt = prompt_ids(9 * GRID + 12)
    prompt[100] = im_end  # the prompt's last end-of-turn: the question goes at position 101
    await rig.turn(prompt, 2, session="r", request_id="routed")
    assert c.status()["router_pending"] == 1
    assert await c.idle_once() == 9
    assert probe.kinds()[-10:] == ["chunk"] * 3 + ["fork"] + ["chunk"] * 6  # asked before passing row 101
    assert c.status()["router_pending"] == 0
    lines = (tmp_path / "shadow" / "shadow.jsonl").read_text().splitlines()
    entry = json.loads(lines[-1])
    assert (entry["request_id"], entry["position"], entry["session"]) == ("routed", 101, "r")
    assert entry["behind_at_turn_start"] == len(prompt)


async def test_between_rounds_the_busy_share_reads_a_session_whose_agent_is_thinking(make_rig):
    """Another agent's session waits unread (its agent thinks) while a short turn runs: no turn's ration opens
    (5 s delay), yet the reader reads that session between rounds, within 1 % of the served device time, and the
    running turn is charged the slices it waited for. The running turn's own session is left to the idle
    window."""
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=5.0, busy_share=0.01)
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("thinking", prompt_ids(6 * GRID + 5, start=9000))
    out = await rig.turn(prompt_ids(4 * GRID + 12), 40, session="s")  # 1 s prefill, 3.9 s decode
    assert len(out) == 40
    chunks = probe.of("chunk")
    assert chunks, "the busy share read nothing"
    assert reader.sessions["thinking"].committed == len(chunks) * GRID  # only the thinking agent's session
    assert reader.sessions["s"].committed == 0
    spent_us = 0
    for chunk in chunks:  # never more than 1 % of what the served model had run when the chunk started
        spent_us += ms_to_us(chunk.ms)
        served_us = _us(k for k in probe.calls if k.kind in ("prefill", "decode") and k.t0 < chunk.t0)
        assert spent_us <= math.floor(0.01 * served_us), (chunk, spent_us, served_us)
    assert c.ledger.total_ms["reader_ration"] == len(chunks) * 10.0
    record = rig.records[0]
    assert record.reader_ration_ms == 0.0  # no turn was charged the device time ...
    assert record.reader_ration_wall_ms > 0 and record.reader_ration_slices > 0  # ... but it waited for them


async def test_a_busy_share_of_zero_keeps_the_rounds_to_the_turns(make_rig):
    rig = make_rig(script_ms=SCRIPT, chunk_prior_ms=20.0, ration_after_s=5.0, busy_share=0.0)
    rig.reader.feed("thinking", prompt_ids(6 * GRID + 5, start=9000))
    assert len(await rig.turn(prompt_ids(4 * GRID + 12), 40, session="s")) == 40
    assert rig.probe.of("chunk") == [] and rig.records[0].reader_ration_wall_ms == 0.0
