"""The replay's rounds (qse/replay/rounds.py) take the conductor's decisions: the same arrivals give the same
sequence of round plans and the same order of first tokens, on the real conductor and on the virtual clock."""

from __future__ import annotations

import asyncio

from runtime_rig import GRID, prompt_ids

from qse.core.rounds import RoundPlanner
from qse.replay.read_model import ReadModel
from qse.replay.rounds import DecodeCost, simulate_rounds
from qse.replay.usage import UsageRecord

# a alone first; b (long) and c (short) arrive while a's first decode round runs
PROMPTS = {"a": 17, "b": 4 * GRID + 5, "c": GRID + 3}
MAX_TOKENS = 4


def named(plans, name_of):
    return [(tuple(name_of(k) for k in p.decode), tuple((name_of(r.key), r.chunks, r.tail) for r in p.reads))
            for p in plans if p]


async def test_replayed_rounds_plan_as_the_conductor_does(make_rig):
    rig = make_rig(max_running=2, served_grid=GRID, round_token_budget=GRID)
    c = rig.conductor
    plans, real_plan = [], c.scheduler.rounds.plan
    c.scheduler.rounds.plan = lambda *a: plans.append(real_plan(*a)) or plans[-1]  # (a spy: the decisions taken)
    hold = rig.probe.hold("decode", 1)
    a = asyncio.create_task(rig.turn(prompt_ids(PROMPTS["a"], start=100), MAX_TOKENS, session="a"))
    await hold.entered
    later = [asyncio.create_task(rig.turn(prompt_ids(PROMPTS[s], start=1000 * (i + 1)), MAX_TOKENS, session=s))
             for i, s in enumerate("bc")]
    await c.wait_for_waiting(2)
    hold.release.set()
    await asyncio.gather(a, *later)
    await c.rounds_ended()
    real_firsts = [k.turn.session_id for p in plans for k in p.first_tokens]

    planner = RoundPlanner(2, GRID, GRID)
    assert (planner.max_running, planner.token_budget, planner.grid) == (
        c.scheduler.rounds.max_running, c.scheduler.rounds.token_budget, c.scheduler.rounds.grid)
    # virtual time: a's tail is read in microseconds, a decode round takes a second: b and c arrive inside it
    records = [UsageRecord(session=s, arrival_s=t, first_token_s=None, end_s=t, prompt_tokens=PROMPTS[s],
                           shared_prefix_tokens=0, output_tokens=MAX_TOKENS)
               for s, t in (("a", 0.0), ("b", 0.5), ("c", 0.6))]
    sim = simulate_rounds(records, planner, ReadModel.flat(1.0, grid=GRID), DecodeCost(1000.0),
                          launch_ahead=c.policy.launch_ahead)
    names = [r.session for r in sorted(records, key=lambda r: r.arrival_s)]
    assert named([p for _, p in sim.plans], names.__getitem__) == named(plans, lambda e: e.turn.session_id)
    sim_firsts = [t.record.session for t in sorted(sim.turns, key=lambda t: t.first_token_s)]
    assert sim_firsts == real_firsts == ["a", "c", "b"]  # c is shorter: read first although b came first
    assert [r.session_id for r in rig.records if r.session_id != "a"] == ["c", "b"]
