"""The conductor and the replay feed one scheduler (qse/core/scheduler.py): the same turn gives the same reader
slices between rounds, and the same arrivals the same round decisions, on the real conductor and on the virtual
clock."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role
from qse.core.plan import Window
from qse.core.scheduler import OpenTurn, ReadPlan, RunRound, Scheduler
from qse.replay import rounds as replay_rounds
from qse.replay.read_model import ReadModel
from qse.replay.rounds import DecodeCost, simulate_rounds
from qse.replay.simulator import SimOptions, simulate
from qse.replay.usage import UsageRecord

CHUNK_MS, DECODE_MS, PREFILL_MS = 10.0, 100.0, 1000.0


def spy(monkeypatch) -> list[tuple[Scheduler, object, object]]:
    """Every (scheduler, event, action) of every scheduler, in order."""
    seen, real = [], Scheduler.on
    monkeypatch.setattr(Scheduler, "on", lambda self, ev: seen.append((self, ev, real(self, ev))) or seen[-1][2])
    return seen


async def test_the_replay_opens_the_slices_the_conductor_opens(make_rig, monkeypatch):
    """One turn (a 140-id prompt, 100 ids out, 100 ms rounds, 10 ms chunks): the ration's slices open at the
    same moments, from the same rows, and read as many chunks, on the conductor and in the replay."""
    seen = spy(monkeypatch)
    rig = make_rig(script_ms={"prefill": PREFILL_MS, "decode": DECODE_MS, "chunk": CHUNK_MS},
                   chunk_prior_ms=CHUNK_MS, ration_after_s=0.0)
    c = rig.conductor
    arrival = c.clock()
    out = await rig.turn(prompt_ids(4 * GRID + 12, start=4000), 100, session="s")
    record = rig.records[0]
    slices = [(a.decision.opened_s, next(t.committed_rows for t in ev.turns if t.key is a.key), a.decision.num_chunks)
              for _, ev, a in seen if isinstance(a, ReadPlan) and a.window is Window.RATION]
    assert len(out) == 100 and len(slices) >= 3

    # the same turn on the virtual clock: its prompt read in the prefill's time, a round a 100 ms
    first_s = record.first_token_s - arrival
    rec = UsageRecord(session="s", arrival_s=0.0, first_token_s=first_s, end_s=first_s + 100 * DECODE_MS / 1000,
                      prompt_tokens=4 * GRID + 12, shared_prefix_tokens=0, output_tokens=100)
    opt = SimOptions.of(grid=GRID, ration_after_s=0.0, chunk_prior_ms=CHUNK_MS, prior_from_read_model=False,
                        estimator_bucket_tokens=4096)
    res = simulate([rec], ReadModel.flat(CHUNK_MS / GRID * 1000, grid=GRID), opt, record_decisions=True)
    replayed = [(d.opened_s, d.start_row, d.num_chunks) for d in res.decisions if d.window is Window.RATION]
    assert [r[1:] for r in replayed] == [r[1:] for r in slices]
    assert [r[0] for r in replayed] == pytest.approx([r[0] - arrival for r in slices], abs=1e-6)
    assert res.ledger.spent_us(Role.READER_RATION) == pytest.approx(record.reader_ration_ms * 1000)


PROMPTS = {"a": 17, "b": 4 * GRID + 5, "c": GRID + 3}


@pytest.mark.parametrize("decode_yield_ms", [0.0, 1e9])
async def test_the_replay_takes_the_round_decisions_the_conductor_takes(make_rig, monkeypatch, decode_yield_ms):
    """a alone first; b (long) and c (short) arrive while a's first decode round runs: the same turns open in
    the same order and the same rounds run, on the conductor and on the virtual clock (with a decode yield
    longer than the test too: a then sits out the rounds that read b and c)."""
    seen = spy(monkeypatch)
    rig = make_rig(max_running=2, served_grid=GRID, round_token_budget=GRID, decode_yield_ms=decode_yield_ms)
    c = rig.conductor
    hold = rig.probe.hold("decode", 1)
    a = asyncio.create_task(rig.turn(prompt_ids(PROMPTS["a"], start=100), 4, session="a"))
    await hold.entered
    later = [asyncio.create_task(rig.turn(prompt_ids(PROMPTS[s], start=1000 * (i + 1)), 4, session=s))
             for i, s in enumerate("bc")]
    await c.wait_for_waiting(2)
    hold.release.set()
    await asyncio.gather(a, *later)
    await c.rounds_ended()

    def opened(scheduler, name):
        return [name(a.key) for sc, ev, a in seen if sc is scheduler and isinstance(a, OpenTurn)]

    def named(plans, name):
        return [(tuple(name(k) for k in p.decode), tuple((name(r.key), r.chunks, r.tail) for r in p.reads))
                for p in plans]

    real_plans = [a.plan for sc, ev, a in seen if sc is c.scheduler and isinstance(a, RunRound)]
    seen_before = len(seen)
    # virtual time: a's tail is read in microseconds, a decode round takes a second: b and c arrive inside it
    records = [UsageRecord(session=s, arrival_s=t, first_token_s=None, end_s=t, prompt_tokens=PROMPTS[s],
                           shared_prefix_tokens=0, output_tokens=4) for s, t in (("a", 0.0), ("b", 0.5), ("c", 0.6))]
    policy = replace(c.policy, max_running=2, round_token_budget=GRID, served_grid=GRID)
    assert policy.decode_yield_ms == decode_yield_ms
    sim = simulate_rounds(records, policy, ReadModel.flat(1.0, grid=GRID), DecodeCost(1000.0))
    replayed = next(sc for sc, _, _ in seen[seen_before:])
    names = [r.session for r in records]
    # (the replay runs a stretch of the same decode rounds without asking again: its plans are every round)
    assert named([p for _, p in sim.plans], names.__getitem__) == named(real_plans, lambda e: e.turn.session_id)
    assert opened(replayed, names.__getitem__) == opened(c.scheduler, lambda e: e.turn.session_id) == ["a", "c", "b"]
    assert [t.record.session for t in sorted(sim.turns, key=lambda t: t.first_token_s)] == ["a", "c", "b"]
    assert [r.session_id for r in rig.records if r.session_id != "a"] == ["c", "b"]  # c is shorter: first
    assert replay_rounds.Scheduler is Scheduler  # (the replay's rounds are the scheduler's own)
    # a decodes beside the prompts' pieces, or (the yield) sits out every round that reads one
    assert any(p.reads and p.decode for p in real_plans) == (not decode_yield_ms)


async def test_the_replay_cuts_a_round_where_the_conductor_cuts_it(make_rig):
    """l (eight chunks and a 3-id tail) is read four chunks a round; s (a 5-id tail) joins while l's first chunk is
    read. On the conductor (s joins while that chunk is held) and on the virtual clock (s arrives half a chunk
    in) the round stops after that chunk, and the prompts' pieces run in the same order: l's chunk, s's tail,
    l's other seven chunks and its tail."""
    short, long_ = prompt_ids(5, start=4000), prompt_ids(8 * GRID + 3, start=12000)  # (a 1-id tail reads as a decode)
    rig = make_rig(max_running=2, served_grid=GRID, round_token_budget=4 * GRID)
    c = rig.conductor
    assert c.policy.cut_rounds
    held = rig.probe.hold("prefill", 1)
    l_task = asyncio.create_task(rig.turn(long_, 2, session="l"))
    await held.entered
    s_task = asyncio.create_task(rig.turn(short, 2, session="s"))
    await c.wait_for_waiting(1)
    held.release.set()
    await asyncio.gather(l_task, s_task)
    live = ["s" if call.num_ids == 5 else "l" for call in rig.probe.of("prefill")]

    records = [UsageRecord(session="l", arrival_s=0.0, first_token_s=None, end_s=0.0, prompt_tokens=len(long_),
                           shared_prefix_tokens=0, output_tokens=2),
               UsageRecord(session="s", arrival_s=0.0005, first_token_s=None, end_s=0.0005, prompt_tokens=len(short),
                           shared_prefix_tokens=0, output_tokens=2)]
    sim = simulate_rounds(records, c.policy, ReadModel.flat(1000.0 / GRID, grid=GRID), DecodeCost(1.0))
    names = [r.session for r in records]
    replayed = [names[r.key] for _, p in sim.plans for r in p.reads for _ in range(r.chunks + r.tail)]
    assert live == replayed == ["l", "s", *["l"] * 8]
    assert [len(p.reads) and p.reads[0].chunks for _, p in sim.plans][0] == 1  # the first round: one chunk, cut
