"""The round loop: turns that run together are decoded in one batched round a token; each gets the tokens it
gets alone; a client that leaves frees its slot at the next round; the ledger holds every measured round."""

from __future__ import annotations

import asyncio

from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role
from qse.core.ledger import ms_to_us
from qse.runtime.conductor import GenerateRequest

PROMPTS = {"a": prompt_ids(GRID + 9, start=3000), "b": prompt_ids(2 * GRID + 3, start=9000),
           "c": prompt_ids(17, start=15000)}


async def test_batched_greedy_equals_solo_greedy_token_for_token(make_rig):
    alone = {}
    for sid, prompt in PROMPTS.items():  # one at a time, a fresh conductor each
        rig = make_rig(max_running=4)
        alone[sid] = await rig.turn(prompt, 6, session=sid)
    rig = make_rig(max_running=4)
    hold = rig.probe.hold("prefill", 1)  # the loop starts a's turn; b and c queue meanwhile
    tasks = {sid: asyncio.create_task(rig.turn(prompt, 6, session=sid)) for sid, prompt in PROMPTS.items()}
    await hold.entered
    await rig.conductor.wait_for_waiting(2)
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
