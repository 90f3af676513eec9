"""The replay's served rounds on a virtual clock: two overlapping requests, exact times from the cost models."""

import pytest

from qse.policy import Policy
from qse.replay.read_model import ReadModel, group_share
from qse.core.rounds import Read
from qse.replay.rounds import DecodeCost, ReaderCost, simulate_rounds
from qse.replay.usage import UsageRecord

GRID = 10


def policy(max_running=2, launch_ahead=False):
    return Policy(max_running=max_running, round_token_budget=GRID, served_grid=GRID, launch_ahead=launch_ahead)


def rec(session, arrival_s, prompt_tokens, output_tokens):
    return UsageRecord(session=session, arrival_s=arrival_s, first_token_s=None, end_s=arrival_s,
                       prompt_tokens=prompt_tokens, shared_prefix_tokens=0, output_tokens=output_tokens)


def test_two_overlapping_requests_share_rounds():
    """A chunk costs 10 ms (1 ms an id of a tail), a decode round 5 ms, one piece a round. x (2 chunks and a
    1-id tail) is read in rounds 1-3; y arrives in round 2, opens before round 3 but waits (x has 1 id left,
    y 5); round 4 decodes x and reads y's tail; round 5 decodes both, and both end."""
    read_model = ReadModel.flat(1000.0, grid=GRID)
    sim = simulate_rounds([rec("y", 0.015, 5, 2), rec("x", 0.0, 2 * GRID + 1, 3)],
                          policy(), read_model, DecodeCost(5.0))
    x, y = sim.turns  # in arrival order
    assert (x.record.session, y.record.session) == ("x", "y")
    assert [round(t, 6) for t, _ in sim.plans] == [0.0, 0.01, 0.02, 0.021, 0.031]
    assert x.ttft_s == pytest.approx(0.021) and y.ttft_s == pytest.approx(0.016)
    assert x.end_s == pytest.approx(0.036) and y.end_s == pytest.approx(0.036)
    assert x.tokens_per_s == pytest.approx(3 / 0.036) and y.tokens_per_s == pytest.approx(2 / 0.021)
    report = sim.report()
    assert report["num_rounds"] == 5 and [t["output_tokens"] for t in report["turns"]] == [3, 2]


def test_a_sessions_next_turn_waits_for_the_one_before():
    sim = simulate_rounds([rec("s", 0.0, 5, 2), rec("s", 0.001, 5, 1)], policy(),
                          ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0))
    first, second = sim.turns
    assert second.first_token_s > first.end_s  # it joined the queue when the first turn ended


def test_launched_ahead_a_turn_holds_its_slot_one_round_longer():
    recs, model = [rec("a", 0.0, 5, 2), rec("b", 0.0, 6, 1)], ReadModel.flat(1000.0, grid=GRID)
    plain = simulate_rounds(recs, policy(1), model, DecodeCost(5.0))
    ahead = simulate_rounds(recs, policy(1, launch_ahead=True), model, DecodeCost(5.0))
    assert len([p for _, p in ahead.plans]) == len(plain.plans) + 1  # the round that brings a's last id back
    assert ahead.turns[1].first_token_s == plain.turns[1].first_token_s  # (that round costs no device time)


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["plain", "ahead"])
def test_a_stretch_of_decode_rounds_stops_where_a_turn_arrives_or_ends(launch_ahead):
    """Long decodes: the same decode rounds run as one stretch, which stops at the first round boundary at or
    after an arrival (c opens and is read there) and before a turn's last id; every round is still counted."""
    recs = [rec("a", 0.0, 5, 60), rec("b", 0.0, 25, 40), rec("c", 0.2, 12, 50)]
    sim = simulate_rounds(recs, policy(3, launch_ahead), ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0, 1.0))
    a, b, c = sim.turns
    assert sim.num_rounds == len(sim.plans)
    assert [t.ids for t in sim.turns] == [60, 40, 50]
    for t in sim.turns:  # a first token at a round's end, then one id a round
        assert sum(t.arrival_no in p.decode for _, p in sim.plans) == t.record.output_tokens - 1
    reads_c = [k for k, (_, p) in enumerate(sim.plans) if any(r.key == 2 for r in p.reads)]
    assert sim.plans[reads_c[0]][0] >= 0.2 > sim.plans[reads_c[0] - 1][0]
    for (s0, p0), (s1, _) in zip(sim.plans, sim.plans[1:]):  # each round starts where the one before ended
        if not p0.reads:
            assert s1 - s0 == pytest.approx((5.0 + 1.0 * len(p0.decode)) / 1000)
    # b ends first; its round is the last with three decodes
    assert b.end_s < a.end_s and b.end_s < c.end_s


def test_the_simulator_reports_the_served_rounds_of_all_sessions_together(tmp_path, capsys):
    """One entry point: `qse replay --served-rounds` serves every record in the scheduler's rounds beside the
    per-session replay; the same records through simulate_rounds give the same figures."""
    from qse.replay.cli import main
    from qse.replay.simulator import SimOptions, simulate
    from qse.replay.usage import write_usage

    recs = [UsageRecord(session=s, arrival_s=a, first_token_s=a + 0.5, end_s=a + 0.5 + out * 0.01,
                        prompt_tokens=p, shared_prefix_tokens=0, output_tokens=out)
            for s, a, p, out in (("a", 0.0, 3000, 40), ("b", 0.1, 700, 20), ("c", 5.0, 100, 10))]
    model = ReadModel.flat(87.0)
    res = simulate(recs, model, SimOptions.of(served_rounds=True))
    alone = simulate_rounds(recs, res.options.policy, model, DecodeCost(10.0), keep_plans=False)
    got = res.report()["served_rounds"]
    assert res.decode_round_ms == pytest.approx(10.0)  # the records' decode ms per id
    assert got["num_rounds"] == alone.num_rounds > 0 and got["num_turns"] == 3
    assert got["ttft_s"] == alone.summary()["ttft_s"]
    assert got["aggregate_tokens_per_s"] == pytest.approx(70 / (max(t.end_s for t in alone.turns) - 0.0))
    assert simulate(recs, model).report()["served_rounds"] is None  # off unless asked

    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, recs)
    assert main([str(ledger), "--served-rounds", "--decode-round-ms", "10", "--no-progress"]) == 0
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["served_rounds"]["num_rounds"] == alone.num_rounds
    assert report["options"]["decode_round_ms"] == 10.0


def test_the_served_rounds_reuse_what_the_session_cache_keeps():
    """A public trace records no cached tokens: the rounds take a follow-up turn's reuse from the per-session
    replay's served book (the state the previous turn kept at its prompt's last grid line), so only the new
    rows are read; a session's first turn reads its whole prompt."""
    from qse.replay.simulator import SimOptions, simulate

    grid = SimOptions().policy.served_grid
    recs = [UsageRecord(session="a", arrival_s=0.0, first_token_s=0.5, end_s=0.6, prompt_tokens=6 * grid + 40,
                        shared_prefix_tokens=0, output_tokens=10),
            UsageRecord(session="a", arrival_s=30.0, first_token_s=30.5, end_s=30.6, prompt_tokens=8 * grid + 7,
                        shared_prefix_tokens=6 * grid + 50, output_tokens=10)]
    res = simulate(recs, ReadModel.flat(87.0), SimOptions.of(served_rounds=True, decode_round_ms=5.0))
    starts = {s.turn: s.served_from for s in res.turn_starts}
    assert starts == {0: 0, 1: 6 * grid}
    first, second = sorted(res.rounds.turns, key=lambda t: t.record.arrival_s)
    chunk_s = 87.0 * grid / 1000 / 1000  # the flat read model's chunk
    assert first.ttft_s == pytest.approx(chunk_s * (6 + 40 / grid))  # six chunks and the tail
    assert second.ttft_s == pytest.approx(chunk_s * (2 + 7 / grid))  # from the kept line: two chunks and the tail


def test_the_served_model_has_its_own_chunk_costs(tmp_path, capsys):
    """A served model that reads a chunk in twice the reader's time doubles the served TTFT, with the cache and
    cold, and leaves the reader's own figures as they were; the CLI takes it as a flat rate or a file."""
    from qse.replay.cli import main
    from qse.replay.simulator import SimOptions, simulate
    from qse.replay.usage import write_usage

    grid = SimOptions().policy.served_grid
    recs = [UsageRecord(session="a", arrival_s=0.0, first_token_s=0.5, end_s=0.6, prompt_tokens=6 * grid + 40,
                        shared_prefix_tokens=0, output_tokens=10),
            UsageRecord(session="a", arrival_s=30.0, first_token_s=30.5, end_s=30.6, prompt_tokens=8 * grid + 7,
                        shared_prefix_tokens=6 * grid + 50, output_tokens=10)]
    reader = ReadModel.flat(87.0)
    alone = simulate(recs, reader).report()
    slow = simulate(recs, reader, served_model=ReadModel.flat(174.0)).report()
    for arm in ("cached", "cold"):
        assert slow["served_ttft_ms"][arm]["p50"] == pytest.approx(2 * alone["served_ttft_ms"][arm]["p50"])
    assert slow["fresh_share"] == alone["fresh_share"] and slow["reader_ms"] == alone["reader_ms"]

    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, recs)
    assert main([str(ledger), "--served-ms-per-1000", "174", "--no-progress"]) == 0
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["served_ttft_ms"]["cold"]["p50"] == pytest.approx(slow["served_ttft_ms"]["cold"]["p50"])
    assert report["served_read_model"]["points"] == [[0, 174.0 * grid / 1000]]
    model = tmp_path / "served.json"
    model.write_text(__import__("json").dumps(ReadModel.flat(174.0).to_json()))
    assert main([str(ledger), "--served-read-model", str(model), "--served-ms-per-1000", "1", "--no-progress"]) == 2
    assert "give one" in capsys.readouterr().err


def test_a_tails_fixed_cost_is_charged_once_a_tail():
    """x: 2 chunks and a 1-id tail, alone. Its first token comes after 2 chunks (10 ms each), the tail's share
    (1 ms) and the tail's fixed cost, once, whatever its length."""
    model = ReadModel.flat(1000.0, grid=GRID)
    plain = simulate_rounds([rec("x", 0.0, 2 * GRID + 1, 1)], policy(), model, DecodeCost(5.0))
    fixed = simulate_rounds([rec("x", 0.0, 2 * GRID + 1, 1)], policy(), model, DecodeCost(5.0), tail_ms=7.0)
    assert plain.turns[0].ttft_s == pytest.approx(0.021)
    assert fixed.turns[0].ttft_s == pytest.approx(0.028)


def _reader_run(order: str, wake: bool, group: int = 1):
    """Two sessions' first turns end together at 51 ms (long: 4 chunks of prompt, short: 1), and both come back
    25 ms later: the idle window has room for two and a half of the reader's 10 ms chunks."""
    first = [rec("long", 0.0, 4 * GRID, 1), rec("short", 0.001, GRID + 1, 1)]
    back = 0.051 + 0.025
    follow = [UsageRecord(session=s, arrival_s=back, first_token_s=None, end_s=back, prompt_tokens=p,
                          shared_prefix_tokens=kept, output_tokens=1)
              for s, p, kept in (("long", 4 * GRID + 5, 4 * GRID), ("short", GRID + 5, GRID + 1))]
    pol = Policy(max_running=2, round_token_budget=GRID, served_grid=GRID, grid=GRID, launch_ahead=False,
                 read_order=order, idle_wake=wake, idle_group=group)
    model = ReadModel.flat(1000.0, grid=GRID)
    return simulate_rounds(first + follow, pol, model, DecodeCost(5.0), reader=ReaderCost(model))


def test_the_reader_reads_the_shortest_backlog_first_in_the_idle_window_and_a_turn_waits_for_its_chunk():
    shortest, oldest = _reader_run("shortest", True), _reader_run("oldest", True)
    assert max(t.end_s for t in shortest.turns[:2]) == pytest.approx(0.051)
    behind = {o: [(t.record.session, t.reader_behind_tokens) for t in sim.turns] for o, sim in
              (("shortest", shortest), ("oldest", oldest))}
    # first turns have none; the short session read first is fresh (1 id behind), the long one two chunks in
    assert behind["shortest"] == [("long", None), ("short", None), ("long", 2 * GRID), ("short", 1)]
    # oldest first: the long session's three chunks (the third in flight when both came back), the short unread
    assert behind["oldest"] == [("long", None), ("short", None), ("long", GRID), ("short", GRID + 1)]
    # the follow-ups joined when the chunk in flight ended, 5 ms after they came
    polled = _reader_run("shortest", False)
    assert shortest.turns[2].ttft_s == pytest.approx(polled.turns[2].ttft_s + 0.005)
    assert shortest.reader_chunks == oldest.reader_chunks == 5  # what is left is read after the last turn


def test_on_its_poll_the_idle_window_reads_nothing_between_turns_that_come_back_before_it():
    polled = _reader_run("shortest", False)  # the lattice: looks at 0.0, 0.2, ...; the gap is 51-76 ms
    assert [t.reader_behind_tokens for t in polled.turns[2:]] == [4 * GRID, GRID + 1]
    assert polled.reader_device_ms == pytest.approx(5 * 10.0)  # all of it after the last turn


def test_chunk_groups_read_as_the_reader_forms_them_and_a_joining_turn_waits_for_the_group_in_flight():
    """Groups of 2 (a chunk's share in a group: group_share(2)): the short session's one chunk (10 ms, alone), then
    a group of the long one's first two, in flight when both sessions come back (76 ms): they join at its end,
    before the second of two single chunks would have ended (81 ms); what is left is read after the last turn."""
    grouped, single = _reader_run("shortest", True, group=2), _reader_run("shortest", True)
    pair_ms = 2 * 10.0 * group_share(2)
    assert [t.reader_behind_tokens for t in grouped.turns[2:]] == [2 * GRID, 1] == \
        [t.reader_behind_tokens for t in single.turns[2:]]
    joined = 0.051 + (10.0 + pair_ms) / 1000
    assert grouped.turns[2].ttft_s == pytest.approx(single.turns[2].ttft_s - (0.081 - joined))
    assert grouped.reader_chunks == 5 and grouped.reader_device_ms == pytest.approx(10.0 + 2 * pair_ms)


@pytest.mark.parametrize("launch_ahead", [False, True], ids=["plain", "ahead"])
def test_the_gaps_between_a_streams_ids_show_what_a_decode_yield_costs_it(launch_ahead):
    """a decodes 20 ids (5 ms rounds); b's prompt (3 chunks of 10 ms and a 1-id tail) comes at 30 ms. Every round
    decodes a: its gaps are 15 ms while b's chunks are read beside it, 6 ms at the tail. With a yield a sits out
    b's prompt rounds: one 36 ms gap, and b's first token comes 20 ms sooner. Either way a has 19 gaps."""
    recs, model = [rec("a", 0.0, 5, 20), rec("b", 0.03, 3 * GRID + 1, 1)], ReadModel.flat(1000.0, grid=GRID)
    runs = {y: simulate_rounds(recs, Policy(max_running=2, round_token_budget=GRID, served_grid=GRID,
                                            launch_ahead=launch_ahead, decode_yield_ms=y),
                               model, DecodeCost(5.0), keep_gaps=True) for y in (0.0, 1000.0)}
    plain, yielded = runs[0.0], runs[1000.0]
    assert len(plain.itl_s) == len(yielded.itl_s) == 19
    assert plain.itl_s[5:9] == pytest.approx([0.015, 0.015, 0.015, 0.006])
    assert max(yielded.itl_s) == pytest.approx(0.036) and sorted(yielded.itl_s)[:-1] == pytest.approx([0.005] * 18)
    assert plain.turns[1].ttft_s == pytest.approx(0.051) and yielded.turns[1].ttft_s == pytest.approx(0.031)
    assert simulate_rounds(recs, Policy(max_running=2, round_token_budget=GRID, served_grid=GRID), model,
                           DecodeCost(5.0)).itl_s == []  # kept only when asked


@pytest.mark.parametrize("early", [True, False], ids=["early", "at_round_end"])
def test_a_first_token_leaves_when_its_tail_is_read_not_when_its_round_ends(early):
    """One round of three pieces (a chunk 10 ms, 1 ms an id of a tail): s's 5-id tail goes first (the shortest
    prompt), then two of l's four chunks. With first_token_early (the conductor's default) s's first token comes
    when its tail is read, 5 ms in; without, at the round's end, 25 ms in. l's chunks and end are the same."""
    pol = Policy(max_running=2, round_token_budget=3 * GRID, served_grid=GRID, launch_ahead=False,
                 first_token_early=early)
    recs = [rec("s", 0.0, 5, 2), rec("l", 0.0, 4 * GRID + 1, 1)]
    sim = simulate_rounds(recs, pol, ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0))
    s, l = sim.turns
    assert [len(p.reads) for _, p in sim.plans][:1] == [2]  # s's tail and l's two chunks in the first round
    assert s.ttft_s == pytest.approx(0.005 if early else 0.025)
    round_2 = 0.005 + 2 * 0.010 + 0.001  # s decodes; l's last two chunks, its 1-id tail
    assert l.ttft_s == pytest.approx(0.025 + round_2)
    assert s.end_s == pytest.approx(0.025 + round_2)  # s's second id: round 2's end either way


@pytest.mark.parametrize("cut", [True, False], ids=["cut", "uncut"])
def test_a_round_is_cut_where_a_shorter_prompt_joins_and_it_is_read_next(cut):
    """l (8 chunks and a tail) is read four chunks a round (10 ms each); s (a 5-id tail) joins 12 ms into the
    first round. Cut (QSE_ROUND_CUT), the round stops at the first piece boundary after s joined (after l's
    second chunk), and the next round reads s's tail first: its first token 25 ms in. Uncut, s waits for the round's
    four chunks: 45 ms. l reads its chunks and its tail either way, and both get all their ids."""
    pol = Policy(max_running=2, round_token_budget=4 * GRID, served_grid=GRID, launch_ahead=False,
                 first_token_early=True, cut_rounds=cut)
    sim = simulate_rounds([rec("l", 0.0, 8 * GRID + 1, 2), rec("s", 0.012, 5, 2)], pol,
                          ReadModel.flat(1000.0, grid=GRID), DecodeCost(5.0))
    l, s = sim.turns
    first_round = sim.plans[0][1]
    assert first_round.reads == ((Read(0, 2, False),) if cut else (Read(0, 4, False),))
    assert s.ttft_s == pytest.approx((0.020 + 0.005 - 0.012) if cut else (0.040 + 0.005 - 0.012))
    read = {i: sum(r.chunks for _, p in sim.plans for r in p.reads if r.key == i) for i in (0, 1)}
    assert read == {0: 8, 1: 0} and l.ids == 2 and s.ids == 2
