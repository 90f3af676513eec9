"""The round loop: turns that run together are decoded in one batched round a token; each gets the tokens it
gets alone; a client that leaves frees its slot at the next round; the ledger holds every measured round."""

from __future__ import annotations

import asyncio
import json

import pytest
from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role
from qse.core.ledger import ms_to_us
from qse.engine.sampling import SamplingParams
from qse.runtime.conductor import GenerateRequest

PROMPTS = {"a": prompt_ids(GRID + 9, start=3000), "b": prompt_ids(2 * GRID + 3, start=9000),
           "c": prompt_ids(17, start=15000)}


async def test_batched_greedy_equals_solo_greedy_token_for_token(make_rig):
    alone = {}
    for sid, prompt in PROMPTS.items():  # one at a time, a fresh conductor each
        rig = make_rig(max_running=4)
        alone[sid] = await rig.turn(prompt, 6, session=sid)
    rig = make_rig(max_running=4)
    hold = rig.probe.hold("prefill", 1)  # the loop opens the three turns and reads the first prompt
    tasks = {sid: asyncio.create_task(rig.turn(prompt, 6, session=sid)) for sid, prompt in PROMPTS.items()}
    await hold.entered
    assert len(rig.conductor.status()["running"]) == 3  # (being read)
    hold.release.set()
    together = {sid: await task for sid, task in tasks.items()}
    assert together == alone
    rows = [c.num_ids for c in rig.probe.of("decode")]
    assert max(rows) == 3  # the three turns shared rounds
    assert rig.conductor.serving.rounds.num_free == 4  # every slot back


async def test_a_client_that_leaves_frees_its_slot_at_the_next_round(make_rig):
    rig = make_rig(max_running=2)
    c = rig.conductor
    stay = asyncio.create_task(rig.turn(PROMPTS["a"], 8, session="a"))
    leaving = c.generate(GenerateRequest(prompt_ids=PROMPTS["b"], max_tokens=50, session_id="b"))
    first = await leaving.__anext__()
    assert isinstance(first, int)
    await leaving.aclose()  # the client is gone: its turn ends at the next round, its slot is free
    assert c.serving.rounds.num_free == 1 or not stay.done()
    out = await stay
    assert len(out) == 8
    finishes = {r.session_id: r.finish_reason for r in rig.records}
    assert finishes == {"a": "length", "b": "abort"}
    assert c.serving.rounds.num_free == 2
    assert not c.serving.book.get("b").pinned  # the store may move it again


async def test_the_ledger_holds_every_measured_round(make_rig):
    import time

    rig = make_rig(clock=time.monotonic, max_running=4)
    outs = await asyncio.gather(*(rig.turn(p, 5, session=s) for s, p in PROMPTS.items()))
    assert all(len(o) == 5 for o in outs)
    total = rig.conductor.ledger.balance()
    decode_us = sum(ms_to_us(c.ms) for c in rig.probe.of("decode"))
    # each round's time is split evenly over its turns: the parts add up to the round within a microsecond each
    assert abs(total.gpu_us[Role.SERVED_DECODE] - decode_us) <= 3 * len(rig.probe.of("decode"))


async def _each_alone(make_rig, config: dict, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """Each session's turn on a fresh conductor of its own: the tokens it gets alone."""
    alone = {}
    for sid, prompt in prompts.items():
        rig = make_rig(**config)
        alone[sid] = await rig.turn(prompt, max_tokens, session=sid)
    return alone


async def _b_arrives_while_a_decodes(make_rig, **policy):
    """a (a short prompt) decodes until b (six grid chunks and a tail) arrives, under a budget of one chunk a
    round; returns the rig, each turn's tokens alone and together, and the probe's mark at b's arrival."""
    short, long_ = prompt_ids(17, start=4000), prompt_ids(6 * GRID + 5, start=12000)
    config = dict(max_running=4, served_grid=GRID, round_token_budget=GRID)
    alone = await _each_alone(make_rig, config, {"a": short, "b": long_}, 12)
    rig = make_rig(**config, **policy)
    hold = rig.probe.hold("decode", 1)  # a decodes; b arrives meanwhile
    a = asyncio.create_task(rig.turn(short, 12, session="a"))
    await hold.entered
    b = asyncio.create_task(rig.turn(long_, 12, session="b"))
    await rig.conductor.wait_for_waiting(1)
    mark = len(rig.probe.calls)
    hold.release.set()
    return rig, alone, {"a": await a, "b": await b}, mark


async def test_a_long_prompt_is_read_a_chunk_a_round_while_a_turn_decodes(make_rig):
    """With a budget of one grid chunk a round, b's 6-chunk prompt is read between a's decode rounds (a keeps
    decoding), and both get the tokens they get alone."""
    rig, alone, together, mark = await _b_arrives_while_a_decodes(make_rig)
    assert together == alone
    kinds = rig.probe.kinds()[mark:]
    first, last = kinds.index("prefill"), len(kinds) - 1 - kinds[::-1].index("prefill")
    reads = kinds[first:last + 1]
    # b's six chunks and its tail, one a round, a decode round of a between each two
    assert reads.count("prefill") == 7 and reads.count("decode") == 6
    assert all(reads[i] != reads[i + 1] for i in range(len(reads) - 1))
    record = {r.session_id: r for r in rig.records}["b"]
    assert abs(record.prefill_ms - sum(c.ms for c in rig.probe.of("prefill", mark))) < 0.01  # (whole us a read)
    assert rig.conductor.serving.rounds.num_free == 4 and not rig.conductor.serving.book.get("b").pinned


async def test_with_a_decode_yield_a_prompt_is_read_before_the_running_turn_decodes_again(make_rig):
    """With a yield longer than the test (QSE_DECODE_YIELD_MS), a decodes until b arrives, then sits out every
    round that reads b's prompt: b's six chunks and its tail run back to back, a's next round comes after b's
    first token, and both get the tokens they get alone (a's id launched ahead before b came is carried over
    the rounds it sat out)."""
    rig, alone, together, mark = await _b_arrives_while_a_decodes(make_rig, decode_yield_ms=1e9)
    assert rig.conductor.policy.launch_ahead
    assert together == alone
    kinds = rig.probe.kinds()[mark:]
    first = kinds.index("prefill")
    assert kinds[first:first + 7] == ["prefill"] * 7 and kinds[first + 7] == "decode"
    assert rig.conductor.serving.rounds.num_free == 4


async def test_short_prompts_go_first_but_an_overtaken_one_is_not_starved(make_rig):
    """Prompts waiting together are read shortest first, ties in arrival order; a long prompt overtaken by
    MAX_OVERTAKEN later arrivals goes before any prompt not yet overdue."""
    from qse.core.rounds import MAX_OVERTAKEN, prefill_order as core_order
    from qse.runtime.turn import RoundEntry

    def prefill_order(entry: RoundEntry) -> tuple[int, int, int]:  # the planner's order, on the conductor's turns
        return core_order(entry.prompt())

    def entry(no: int, unread: int, overtaken: int = 0) -> RoundEntry:
        return RoundEntry(None, None, None, arrival_no=no, unread_tokens=unread, overtaken=overtaken)

    long_, short1, short2, tie = entry(0, 5000), entry(1, 40), entry(2, 40), entry(3, 5000)
    assert sorted([long_, short1, short2, tie], key=prefill_order) == [short1, short2, long_, tie]
    long_.overtaken = MAX_OVERTAKEN
    assert sorted([short2, tie, long_, short1], key=prefill_order) == [long_, short1, short2, tie]

    rig = make_rig(max_running=1, served_grid=GRID, round_token_budget=GRID)
    hold = rig.probe.hold("decode", 1)
    first = asyncio.create_task(rig.turn(prompt_ids(9, start=500), 2, session="first"))
    await hold.entered
    tasks = [asyncio.create_task(rig.turn(prompt_ids(n, start=1000 * n), 2, session=f"n{n}"))
             for n in (5 * GRID, 20, 3 * GRID)]
    await rig.conductor.wait_for_waiting(3)
    hold.release.set()
    await first
    await asyncio.gather(*tasks)
    assert [r.session_id for r in rig.records] == ["first", "n20", f"n{3 * GRID}", f"n{5 * GRID}"]


async def test_a_client_that_leaves_while_its_prompt_is_read_frees_its_slot(make_rig):
    rig = make_rig(max_running=2, served_grid=GRID, round_token_budget=GRID)
    c = rig.conductor
    hold = rig.probe.hold("prefill", 2)  # b's second chunk
    gen = c.generate(GenerateRequest(prompt_ids=prompt_ids(5 * GRID), max_tokens=4, session_id="b"))
    task = asyncio.create_task(gen.__anext__())
    await hold.entered
    task.cancel()  # the client is gone while the rounds read its prompt
    hold.release.set()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await gen.aclose()
    b_chunks = rig.probe.of("prefill")
    out = await rig.turn(PROMPTS["c"], 3, session="c")
    assert len(out) == 3
    record = {r.session_id: r for r in rig.records}["b"]
    assert record.finish_reason == "abort"
    assert c.serving.rounds.num_free == 2 and not c.serving.book.get("b").pinned
    assert c.serving.book.get("b").committed == 2 * GRID  # the chunks read stay (they are on the grid)
    # the chunk it left running when it went is read back and charged to it, like the one before it
    assert len(b_chunks) == 2 and abs(record.prefill_ms - sum(x.ms for x in b_chunks)) < 0.01


async def test_a_stop_id_read_one_round_late_ends_the_turn_with_its_state_on_the_grid(make_rig):
    """Rounds launch before the last one's ids are read: a stop id ends its turn one round late, the round past
    it is dropped (its time goes to the ledger's total), and the session keeps its prompt's grid line only."""
    prompt = prompt_ids(2 * GRID + 5, start=7000)
    rig = make_rig(max_running=2, served_grid=GRID)
    solo = await rig.turn(prompt, 6, session="s")
    stop = solo[3]
    assert stop not in solo[:3]
    rig = make_rig(max_running=2, served_grid=GRID)
    out = [t async for t in rig.conductor.generate(GenerateRequest(prompt_ids=prompt, max_tokens=6,
                                                                    session_id="s", stop_ids=(stop,)))]
    assert out == solo[:3] and rig.records[0].finish_reason == "stop"
    await rig.conductor.rounds_ended()
    decodes = rig.probe.of("decode")
    assert len(decodes) == 4  # the round that read the stop id's successor was launched before the stop was seen
    total = rig.conductor.ledger.balance().gpu_us[Role.SERVED_DECODE]
    assert abs(total - sum(ms_to_us(c.ms) for c in decodes)) <= 4
    session = rig.conductor.serving.book.get("s")
    assert session.committed == 2 * GRID and session.cache.length == 2 * GRID and len(session.kv.pages) == 2 * GRID // session.kv.pool.page_rows
    assert rig.conductor.serving.rounds.num_free == 2


def _grammar_params(rig, temperature: float, max_tokens: int):
    """A json_schema-like answer held by a grammar, on the rig's tokenizer; its end id stops the turn."""
    from qse.engine.grammar import Grammar, json_rule
    from qse.engine.sampling import SampleRecord, SamplingParams

    schema = {"type": "object", "required": ["title", "n"], "additionalProperties": False,
              "properties": {"title": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}}}
    tok = rig.conductor.served.chat.tokenizer.grammar_tokenizer()
    g = Grammar.compile("start: answer\nanswer: " + json_rule(schema) + "\n", tok, max_tokens)
    return SamplingParams(temperature=temperature, seed=4, grammar=g, record=SampleRecord()), tok.eos_id


async def _held_turn(rig, prompt, temperature: float, max_tokens: int, session: str):
    params, eos = _grammar_params(rig, temperature, max_tokens)
    req = GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=params, stop_ids=(eos,),
                          session_id=session)
    return [t async for t in rig.conductor.generate(req)], params.record


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded-draw"])
async def test_a_grammar_turn_launched_ahead_gets_the_synchronous_tokens(make_rig, temperature):
    """A grammar turn's rounds launch ahead (the forward of step n+1 fed step n's id on the device, the mask built
    while it runs): the same ids as the rounds that wait for each id, a valid answer, its end seen one round late
    (that round dropped) and the session left with its prompt's grid line only."""
    prompt = prompt_ids(2 * GRID + 5, start=6000)
    outs, decodes = {}, {}
    for ahead in (False, True):
        rig = make_rig(max_running=2, served_grid=GRID, launch_ahead=ahead)
        outs[ahead], record = await _held_turn(rig, prompt, temperature, 40, "s")
        await rig.conductor.rounds_ended()
        decodes[ahead] = len(rig.probe.of("decode"))
        assert rig.records[0].finish_reason == "stop" and record.grammar_done
        answer = json.loads(rig.conductor.served.chat.tokenizer.decode(outs[ahead]))
        assert set(answer) == {"title", "n"} and isinstance(answer["n"], int)
        session = rig.conductor.serving.book.get("s")
        assert session.committed == 2 * GRID and session.cache.length == 2 * GRID
        assert rig.conductor.serving.rounds.num_free == 2
    assert outs[True] == outs[False]
    assert decodes[False] == len(outs[False])  # one round a token after the first, and the end id's
    assert decodes[True] == decodes[False] + 1  # the round launched before the end id was read


async def test_a_grammar_turn_and_plain_turns_in_one_round_each_get_their_solo_tokens(make_rig):
    grammar_prompt, greedy_prompt = prompt_ids(GRID + 9, start=3000), prompt_ids(17, start=15000)
    drawn_prompt = prompt_ids(2 * GRID + 3, start=9000)
    drawn = SamplingParams(temperature=0.9, seed=8, frequency_penalty=0.2)

    async def plain(rig, prompt, params, session):
        req = GenerateRequest(prompt_ids=prompt, max_tokens=10, sampling=params, session_id=session)
        return [t async for t in rig.conductor.generate(req)]

    solo_rig = make_rig(max_running=4, launch_ahead=False)
    alone = {"g": (await _held_turn(solo_rig, grammar_prompt, 0.8, 30, "g"))[0],
             "p": await plain(solo_rig, greedy_prompt, SamplingParams(), "p"),
             "d": await plain(solo_rig, drawn_prompt, drawn, "d")}
    rig = make_rig(max_running=4, launch_ahead=True)
    hold = rig.probe.hold("prefill", 1)
    tasks = {"g": asyncio.create_task(_held_turn(rig, grammar_prompt, 0.8, 30, "g")),
             "p": asyncio.create_task(plain(rig, greedy_prompt, SamplingParams(), "p")),
             "d": asyncio.create_task(plain(rig, drawn_prompt, drawn, "d"))}
    await hold.entered
    hold.release.set()
    together = {k: await t for k, t in tasks.items()}
    together["g"] = together["g"][0]
    assert together == alone
    assert max(c.num_ids for c in rig.probe.of("decode")) == 3  # the three turns shared rounds
    assert rig.conductor.serving.rounds.num_free == 4


async def test_a_grammar_id_in_flight_is_taken_when_a_logprobs_turn_makes_the_rounds_wait(make_rig):
    """A grammar turn decodes ahead alone; a turn asking for log-probabilities joins, so the next rounds sample on
    the host: the grammar's id still on the device is taken before its next step, and it gets its solo ids."""
    from qse.engine.sampling import SampleRecord

    grammar_prompt, other = prompt_ids(GRID + 9, start=3000), prompt_ids(17, start=15000)
    solo_rig = make_rig(max_running=2, launch_ahead=False)
    alone = (await _held_turn(solo_rig, grammar_prompt, 0.8, 30, "g"))[0]
    rig = make_rig(max_running=2, launch_ahead=True)
    hold = rig.probe.hold("decode", 3)
    held = asyncio.create_task(_held_turn(rig, grammar_prompt, 0.8, 30, "g"))
    await hold.entered
    record = SampleRecord()
    req = GenerateRequest(prompt_ids=other, max_tokens=4, session_id="l",
                          sampling=SamplingParams(top_logprobs=2, record=record))
    joined = asyncio.create_task(_collect(rig.conductor.generate(req)))
    await rig.conductor.wait_for_waiting(1)
    hold.release.set()
    assert (await held)[0] == alone
    assert len(await joined) == 4 and len(record.logprobs) == 4
    assert max(c.num_ids for c in rig.probe.of("decode")) == 2  # they shared rounds


async def _collect(gen) -> list[int]:
    return [t async for t in gen]


async def test_a_request_that_ends_while_its_prompt_is_read_ends_at_the_next_round(make_rig):
    """A client that leaves before its first token cannot close the generator it waits on: the request's own
    `ended` says so, and the turn ends at the next round instead of reading the rest of its prompt; its slot is
    free and the record says abort."""
    rig = make_rig(max_running=2, served_grid=GRID, round_token_budget=GRID)  # one chunk a round: 8 rounds
    c = rig.conductor
    why = {"ended": None}
    req = GenerateRequest(prompt_ids=prompt_ids(8 * GRID + 5, start=21000), max_tokens=4, session_id="gone",
                          ended=lambda: why["ended"])
    hold = rig.probe.hold("prefill", 2)  # the second chunk of the prompt
    task = asyncio.create_task(rig.turn_request(req))
    await hold.entered
    why["ended"] = "abort"  # the client left (the server's ticket ended)
    hold.release.set()
    assert await task == []
    assert len(rig.probe.of("prefill")) <= 3  # at most the chunk a launched round had begun, never all 8
    assert [(r.session_id, r.finish_reason, r.output_tokens) for r in rig.records] == [("gone", "abort", 0)]
    assert c.serving.rounds.num_free == 2 and not c.serving.book.get("gone").pinned


@pytest.mark.parametrize("early", [True, False], ids=["early", "at_round_end"])
async def test_a_first_token_reaches_its_client_while_its_round_reads_other_prompts(make_rig, early):
    """a decodes; s (a tail only) and l (four chunks and a tail) arrive together; the next round decodes a,
    reads s's tail, then two of l's chunks. With QSE_FIRST_TOKEN_EARLY (the default) s's first token reaches
    its consumer while the served thread is still held inside l's first chunk; without, only after the round.
    Either way every turn gets the tokens it gets alone."""
    short, long_ = prompt_ids(5, start=4000), prompt_ids(4 * GRID + 1, start=12000)
    config = dict(max_running=3, served_grid=GRID, round_token_budget=3 * GRID)
    alone = await _each_alone(make_rig, config, {"s": short, "l": long_}, 3)
    rig = make_rig(**config, first_token_early=early)
    c = rig.conductor
    held_decode = rig.probe.hold("decode", 1)
    a = asyncio.create_task(rig.turn(prompt_ids(17, start=100), 4, session="a"))  # its tail is prefill call 1
    await held_decode.entered
    s_stream = c.generate(GenerateRequest(prompt_ids=short, max_tokens=3, session_id="s"))
    s_first = asyncio.ensure_future(s_stream.__anext__())
    l_task = asyncio.create_task(rig.turn(long_, 3, session="l"))
    await c.wait_for_waiting(2)
    held_chunk = rig.probe.hold("prefill", 3)  # s's tail is call 2; l's first chunk call 3
    held_decode.release.set()
    await held_chunk.entered
    if early:
        first = await asyncio.wait_for(s_first, 30)  # (the served thread is still held)
    else:
        await asyncio.sleep(0.2)
        assert not s_first.done()  # it comes with the round's end
    assert rig.probe.of("prefill")[-1].num_ids == 5  # the last read done: s's tail (l's chunk is held)
    held_chunk.release.set()
    if not early:
        first = await s_first
    rest = [t async for t in s_stream]
    assert [first, *rest] == alone["s"]
    assert await l_task == alone["l"]
    await a
    record = {r.session_id: r for r in rig.records}["s"]
    assert record.first_token_s is not None and record.first_token_s <= record.end_s


@pytest.mark.parametrize("cut", [True, False], ids=["cut", "uncut"])
async def test_a_round_stops_where_a_shorter_prompt_joins_and_reads_it_next(make_rig, cut):
    """l (eight chunks and a tail) is read four chunks a round; s (a 5-id tail) joins while l's first chunk
    is held on the served thread. With QSE_ROUND_CUT (the default) the round stops there and the next one reads
    s's tail before l's next chunk; without, l's four chunks come first. Both get the tokens they get alone."""
    short, long_ = prompt_ids(5, start=4000), prompt_ids(8 * GRID + 1, start=12000)
    config = dict(max_running=2, served_grid=GRID, round_token_budget=4 * GRID)
    alone = await _each_alone(make_rig, config, {"s": short, "l": long_}, 3)
    rig = make_rig(**config, cut_rounds=cut)
    held = rig.probe.hold("prefill", 1)  # l's first chunk
    l_task = asyncio.create_task(rig.turn(long_, 3, session="l"))
    await held.entered
    s_task = asyncio.create_task(rig.turn(short, 3, session="s"))
    await rig.conductor.wait_for_waiting(1)
    held.release.set()
    assert await s_task == alone["s"] and await l_task == alone["l"]
    reads = [c.num_ids for c in rig.probe.of("prefill")]
    assert reads[:5] == ([GRID, 5, GRID, GRID, GRID] if cut else [GRID, GRID, GRID, GRID, 5])
    assert sum(1 for n in reads if n == GRID) == 8  # l's eight chunks, each read once
