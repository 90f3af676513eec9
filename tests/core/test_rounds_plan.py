"""The round planner (qse/core/rounds.py): admission, the prefill order and its starvation bound, the budget's
pieces, the decoders, a departure: exact decisions from scripted views."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qse.core.rounds import (MAX_OVERTAKEN, Prompt, Read, RoundPlan, RoundPlanner, Running, chunks_before_tail,
                             prefill_order)

GRID = 64


def opened(key, arrival_no, unread, overtaken=0):
    return Prompt(key, arrival_no, unread, overtaken, chunks_before_tail(unread, GRID))


def test_shortest_prompt_first_ties_first_come_first_served():
    long_, short1, short2, tie = Prompt("long", 0, 5000), Prompt("s1", 1, 40), Prompt("s2", 2, 40), Prompt("t", 3, 5000)
    assert [p.key for p in sorted([tie, long_, short2, short1], key=prefill_order)] == ["s1", "s2", "long", "t"]


def test_a_prompt_overtaken_max_times_goes_before_every_prompt_not_overdue():
    long_ = Prompt("long", 0, 5000, overtaken=MAX_OVERTAKEN)
    late = Prompt("late", 5, 9000, overtaken=MAX_OVERTAKEN)
    short = Prompt("short", 1, 10, overtaken=MAX_OVERTAKEN - 1)
    assert [p.key for p in sorted([short, late, long_], key=prefill_order)] == ["long", "late", "short"]


def test_overtaken_counts_the_earlier_arrivals_still_waiting():
    first = Prompt("c", 2, 10)
    others = [Prompt("a", 0, 900), Prompt("b", 1, 900), Prompt("d", 3, 5)]
    assert RoundPlanner.overtaken(first, others) == ["a", "b"]


def test_the_starvation_bound_holds_under_a_stream_of_short_prompts():
    """One long prompt and a short one arriving every round, max_running 1, one piece a round: the long one
    gets its first token after exactly MAX_OVERTAKEN short ones."""
    planner = RoundPlanner(max_running=1, token_budget=GRID, grid=GRID)
    waiting = {"long": Prompt("long", 0, 10 * GRID)}
    reading: dict = {}
    firsts, arrivals = [], 1
    while "long" not in firsts:
        waiting[f"s{arrivals}"] = Prompt(f"s{arrivals}", arrivals, 5)
        arrivals += 1
        for key in planner.admit(waiting.values(), len(reading)):
            p = waiting.pop(key)
            reading[key] = p._replace(chunks_left=chunks_before_tail(p.unread_tokens, GRID))
        plan = planner.plan([], reading.values())
        (read,) = plan.reads
        p = reading[read.key]
        reading[read.key] = p._replace(unread_tokens=p.unread_tokens - read.chunks * GRID,
                                       chunks_left=p.chunks_left - read.chunks)
        if read.tail:
            first = reading.pop(read.key)
            firsts.append(first.key)
            for key in planner.overtaken(first, list(waiting.values())):
                waiting[key] = waiting[key]._replace(overtaken=waiting[key].overtaken + 1)
    assert firsts == [f"s{i}" for i in range(1, MAX_OVERTAKEN + 1)] + ["long"]


def test_admission_fills_free_slots_in_prefill_order():
    planner = RoundPlanner(max_running=3, token_budget=2 * GRID, grid=GRID)
    waiting = [Prompt("a", 0, 900), Prompt("b", 1, 30), Prompt("c", 2, 500), Prompt("d", 3, 30)]
    assert planner.admit(waiting, num_busy=0) == ["b", "d", "c"]
    assert planner.admit(waiting, num_busy=2) == ["b"]
    assert planner.admit(waiting, num_busy=3) == []
    assert planner.admit([], num_busy=0) == []


def test_the_budget_reads_whole_chunks_then_the_tail_one_prompt_at_a_time():
    planner = RoundPlanner(max_running=4, token_budget=3 * GRID + 10, grid=GRID)  # 3 pieces a round
    assert planner.pieces_per_round == 3
    short, long_ = opened("short", 1, GRID + 5), opened("long", 0, 4 * GRID + 1)  # 1 chunk + tail, 4 + tail
    plan = planner.plan([], [long_, short])
    assert plan.reads == (Read("short", 1, True), Read("long", 1, False))
    assert plan.first_tokens == ("short",)
    assert sum(r.pieces for r in plan.reads) == 3


def test_a_prompt_on_its_tail_alone_and_a_budget_under_a_chunk_still_advance():
    planner = RoundPlanner(max_running=2, token_budget=10, grid=GRID)
    assert planner.pieces_per_round == 1
    plan = planner.plan([], [opened("x", 0, GRID), opened("y", 1, 3 * GRID)])  # x: the tail only (GRID ids)
    assert plan.reads == (Read("x", 0, True),)
    plan = planner.plan([], [opened("y", 1, 3 * GRID)])
    assert plan.reads == (Read("y", 1, False),)


def test_running_turns_with_ids_left_decode_and_a_departed_one_is_gone():
    planner = RoundPlanner(max_running=3, token_budget=GRID, grid=GRID)
    running = [Running("a", 5), Running("b", 0), Running("c", 1)]  # b: its last id is in flight
    plan = planner.plan(running, [opened("d", 3, 10)])
    assert plan == RoundPlan(("a", "c"), (Read("d", 0, True),))
    # a leaves (its client went): the next round decodes c only; its slot lets a waiting turn in
    running = [r for r in running if r.key != "a"]
    assert planner.plan(running, []).decode == ("c",)
    assert planner.admit([Prompt("e", 4, 70)], num_busy=len(running)) == ["e"]
    assert not planner.plan([Running("b", 0)], [])  # nothing to run: no round


def test_running_turns_sit_out_prompt_rounds_within_the_decode_yield():
    """With a 100 ms yield the running turns leave a round to the prompts while each decoded less than 100 ms
    ago; once one of them has waited that long they all decode; with no prompt to read, or no yield, every
    round decodes them."""
    planner = RoundPlanner(max_running=4, token_budget=GRID, grid=GRID, decode_yield_ms=100)
    prompt = opened("p", 2, 3 * GRID)
    running = [Running("a", 5, last_round_s=10.0), Running("b", 5, last_round_s=10.05), Running("c", 0, 9.0)]
    assert planner.plan(running, [prompt], now=10.09) == RoundPlan((), (Read("p", 1, False),))
    assert planner.plan(running, [prompt], now=10.11).decode == ("a", "b")  # a waited 110 ms (c: no ids left)
    assert planner.plan(running, [], now=10.01).decode == ("a", "b")  # no prompt: they decode
    assert RoundPlanner(4, GRID, GRID).plan(running, [prompt], now=10.01).decode == ("a", "b")  # no yield
    assert planner.plan([Running("a", 5)], [prompt], now=10.0).decode == ("a",)  # never decoded: it decodes


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1)), max_size=6),
       st.lists(st.integers(1, 5 * GRID), max_size=4), st.floats(0, 500), st.floats(0, 2))
def test_a_yield_only_ever_takes_the_whole_decode_out_of_a_prompt_round(running, unread, yield_ms, now):
    """Against the same views without a yield: the reads are the same; the decode is the same or empty, and
    empty only where prompts are read and every turn that would decode did so less than the yield ago."""
    views = [Running(f"r{i}", left, last) for i, (left, last) in enumerate(running)]
    prompts = [opened(f"p{i}", i, n) for i, n in enumerate(unread)]
    plain = RoundPlanner(8, 2 * GRID, GRID).plan(views, prompts, now)
    got = RoundPlanner(8, 2 * GRID, GRID, decode_yield_ms=yield_ms).plan(views, prompts, now)
    assert got.reads == plain.reads
    assert got.decode in (plain.decode, ())
    if got.decode != plain.decode:
        assert plain.reads and all((now - v.last_round_s) * 1e3 < yield_ms for v in views if v.ids_to_launch > 0)


def test_chunks_before_tail_leaves_one_to_grid_ids():
    assert [chunks_before_tail(n, GRID) for n in (1, GRID, GRID + 1, 2 * GRID, 2 * GRID + 1)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("kwargs, word", [(dict(max_running=0, token_budget=1, grid=GRID), "max_running"),
                                          (dict(max_running=1, token_budget=-1, grid=GRID), "budget"),
                                          (dict(max_running=1, token_budget=1, grid=0), "grid"),
                                          (dict(max_running=1, token_budget=1, grid=GRID, decode_yield_ms=-1), "yield"),
                                          (dict(max_running=1, token_budget=1, grid=GRID, decode_yield_ms=float("inf")),
                                           "QSE_DECODE_YIELD_MS")])
def test_bad_settings_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        RoundPlanner(**kwargs)


def test_an_unopened_prompt_cannot_be_read():
    with pytest.raises(ValueError, match="not opened"):
        RoundPlanner(1, GRID, GRID).plan([], [Prompt("w", 0, 10)])


def test_a_round_is_cut_where_a_newcomer_goes_before_its_next_piece():
    planner = RoundPlanner(max_running=3, token_budget=4 * GRID, grid=GRID, cut_rounds=True)
    piece = opened("long", 0, 6 * GRID)
    assert planner.cuts_before(piece, [Prompt("short", 1, 40)], num_busy=1)  # shorter: it goes first
    assert not planner.cuts_before(piece, [Prompt("longer", 1, 9 * GRID)], num_busy=1)  # it would wait anyway
    assert not planner.cuts_before(piece, [], num_busy=1)
    assert not planner.cuts_before(piece, [Prompt("short", 1, 40)], num_busy=3)  # no slot: it could not open
    overdue = opened("long", 0, 6 * GRID, overtaken=MAX_OVERTAKEN)
    assert not planner.cuts_before(overdue, [Prompt("short", 1, 40)], num_busy=1)  # the starvation bound holds
    off = RoundPlanner(max_running=3, token_budget=4 * GRID, grid=GRID)
    assert not off.cuts_before(piece, [Prompt("short", 1, 40)], num_busy=1)  # cut_rounds off
