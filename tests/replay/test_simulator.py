"""The simulator on hand-built ledgers with known answers (flat read model: 44.544 ms a 512 chunk)."""

import json
import sys

import pytest

from qse.core import Role, Stop, Window
from qse.replay.cli import main
from qse.replay.read_model import ReadModel
from qse.replay.simulator import SimOptions, simulate
from qse.replay.usage import UsageRecord, write_usage

CHUNK_MS = 44.544
SEED = ReadModel.flat(87.0)
# the rules one at a time: the ration from the first token, only the prompt ends' checkpoints
UNDELAYED = SimOptions.of(ration_after_s=0.0)
PROMPT_ENDS = SimOptions.of(recent_checkpoints=0)


def rec(session, arrival, first, end, prompt, shared, output):
    return UsageRecord(session=session, arrival_s=arrival, first_token_s=first, end_s=end, prompt_tokens=prompt,
                       shared_prefix_tokens=shared, output_tokens=output)


def test_always_fresh():
    recs = [rec("s", 0.0, 1.0, 2.0, 1000, 0, 36),
            rec("s", 10.0, 10.1, 11.0, 1086, 1000, 36),
            rec("s", 20.0, 20.1, 21.0, 1172, 1086, 36)]
    res = simulate(recs, SEED, record_decisions=True)
    # turn 1 keeps 1000 + 36 ids (1024 read), turn 2 keeps 1086 + 36 (still 1024 read): less than a chunk behind
    assert [(s.turn, s.behind_tokens, s.fresh) for s in res.turn_starts] == [(0, 0, True), (1, 12, True), (2, 98, True)]
    # the one read: the idle window's first look after turn 0 (polls every 0.2 s from 0), two whole chunks
    assert [(d.window, d.opened_s, d.start_row, d.num_chunks, d.stop) for d in res.decisions] == [
        (Window.IDLE, 2.0, 0, 2, Stop.BACKLOG)]
    assert res.ledger.balance().gpu_us == {Role.SERVED_PREFILL: 1_200_000, Role.SERVED_DECODE: 2_800_000,
                                           Role.READER_IDLE: 89_088}
    report = res.report()
    assert report["fresh_share"] == 1.0 and report["fresh_share_followups"] == 1.0
    assert report["decode_loss"] == 0.0
    assert report["goal"]["met"] and report["goal"]["misses_by_cause_largest_first"] == []


def test_never_catches_up():
    # 20,000 new ids a turn, 0.5 s between turns, a one-id answer: the reader falls further behind each turn
    recs, prompt, t = [], 0, 0.0
    for k in range(6):
        new = 20_000
        recs.append(rec("s", t, t + 0.5, t + 0.6, prompt + new, prompt, 1))
        prompt += new + 1
        t += 1.1
    res = simulate(recs, SEED)
    behind = [s.behind_tokens for s in res.turn_starts]
    assert all(b > a for a, b in zip(behind, behind[1:]))
    assert not any(s.fresh for s in res.turn_starts[1:])
    assert res.report()["fresh_share_followups"] == 0.0
    assert {s.cause for s in res.turn_starts[1:]} == {"backlog_exceeds_idle_gap"}
    misses = res.report()["misses"]
    assert misses["num_missed"] == 5 and misses["by_cause"]["backlog_exceeds_idle_gap"]["n"] == 5
    assert misses["by_cause"]["backlog_exceeds_idle_gap"]["fresh_share_followups_if_fresh"] == 1.0
    assert misses["backlog_by_what_was_unread"] == {"previous_output_only": 0, "previous_prompt_too": 5}
    goal = res.report()["goal"]
    assert not goal["met_fresh_share"] and not goal["met_behind_p90"]
    assert goal["misses_by_cause_largest_first"] == [{"cause": "backlog_exceeds_idle_gap", "n": 5, "share_of_misses": 1.0}]
    assert goal["fresh_share_if_no_rollback_missed"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("chunks,next_arrival,fresh,behind,num_bursts,cause", [
    (44, 3.0, True, 1, 1, "fresh"),  # 44 chunks fit one 2 s burst: 1959.936 ms
    (45, 3.0, True, 1, 2, "fresh"),  # a spent burst's next one opens at once (2.96): the 45th chunk is in flight
    (90, 3.0, False, 45 * 512 + 1, 2, "backlog_exceeds_idle_gap"),  # 44, then the one in flight; 45 left
], ids=["44-one-burst", "45-second-burst-at-once", "90-too-many"])
def test_exactly_one_idle_window(chunks, next_arrival, fresh, behind, num_bursts, cause):
    prompt = chunks * 512
    recs = [rec("s", 0.0, 0.5, 1.0, prompt, 0, 1),
            rec("s", next_arrival, next_arrival + 0.1, next_arrival + 0.2, prompt + 100, prompt, 1)]
    res = simulate(recs, SEED, record_decisions=True)
    start = res.turn_starts[1]
    assert (start.fresh, start.behind_tokens) == (fresh, behind)
    # a burst stops at 2 s; the next look comes when it stops (not a poll later), so a long gap is read whole
    assert start.cause == cause
    assert start.idle_gap_s == pytest.approx(next_arrival - 1.0)
    assert start.backlog_ms_at_prev_end == pytest.approx(chunks * CHUNK_MS)
    before = [d for d in res.decisions if d.turn == 1]
    assert len(before) == num_bursts
    assert (before[0].opened_s, before[0].num_chunks) == (1.0, 44)
    assert before[0].stop is (Stop.BACKLOG if chunks == 44 else Stop.BUDGET)
    if num_bursts == 2:
        assert before[1].opened_s == pytest.approx(1.0 + 1.959936)  # at once, not a poll (0.2 s) later
        assert before[1].num_chunks == 1
    # every whole chunk is read in the end
    assert res.ledger.balance().gpu_us[Role.READER_IDLE] == 44_544 * chunks


def test_ration_counts_from_first_token():
    # a 17 s prefill, then 346 ids in 9.6 s: 2 % of 9.6 s is 192 ms, four 44.544 ms chunks
    recs = [rec("s", 0.0, 17.0, 26.6, 2048, 0, 346)]
    res = simulate(recs, SEED, UNDELAYED, record_decisions=True)
    ration = [d for d in res.decisions if d.window is Window.RATION]
    assert [(d.start_row, d.num_chunks) for d in ration] == [(0, 1), (512, 1), (1024, 1), (1536, 1)]
    assert ration[0].opened_s >= 17.0 + 2.2272  # not one chunk before it is earned
    assert ration[0].opened_s - (17.0 + 2.2272) < 9.6 / 346  # the first round boundary after
    report = res.report()
    assert report["reader_ms"]["ration"] == 4 * CHUNK_MS
    assert report["decode_loss"] == pytest.approx(4 * CHUNK_MS / 9600)

    # counted from the turn start (the seed's first build) the prefill's 340 ms is spent at once
    res2 = simulate(recs, SEED, SimOptions.of(ration_from="turn_start", ration_after_s=0.0), record_decisions=True)
    ration2 = [d for d in res2.decisions if d.window is Window.RATION]
    assert [(d.start_row, d.num_chunks, d.stop) for d in ration2] == [(0, 3, Stop.BUDGET), (1536, 1, Stop.BACKLOG)]
    assert ration2[0].opened_s == pytest.approx(17.0 + 9.6 / 346)
    assert res2.ledger.balance().gpu_us[Role.READER_RATION] == 4 * 44_544


def test_a_short_turn_spends_no_ration_with_a_delay_and_the_idle_window_reads_its_backlog():
    # a 17 s prefill, 162 ids in 4.5 s: undelayed, 2 % of 4.5 s (90 ms) buys two 44.544 ms chunks inside the
    # decode; counted from 5 s after the first token the decode is over first, and the idle window reads all four
    recs = [rec("s", 0.0, 17.0, 21.5, 2048, 0, 162), rec("s", 30.0, 30.5, 31.0, 2300, 2048, 1)]
    undelayed = simulate(recs, SEED, SimOptions.of(ration_after_s=0.0), record_decisions=True)
    assert [(d.turn, d.window, d.start_row, d.num_chunks) for d in undelayed.decisions] == [
        (0, Window.RATION, 0, 1), (0, Window.RATION, 512, 1), (1, Window.IDLE, 1024, 2)]
    assert undelayed.ledger.balance().gpu_us[Role.READER_RATION] == 2 * 44_544

    res = simulate(recs, SEED, SimOptions.of(ration_after_s=5.0), record_decisions=True)
    assert [(d.turn, d.window, d.opened_s, d.start_row, d.num_chunks, d.stop) for d in res.decisions] == [
        (1, Window.IDLE, 21.5, 0, 4, Stop.BACKLOG)]  # the moment the turn ends (QSE_SHADOW_IDLE_WAKE)
    polled = simulate(recs, SEED, SimOptions.of(ration_after_s=5.0, idle_wake=False), record_decisions=True)
    assert [(d.opened_s, d.num_chunks) for d in polled.decisions] == [(21.6, 4)]  # its first poll after (0.2 s)
    assert res.ledger.balance().gpu_us == {Role.SERVED_PREFILL: 17_500_000, Role.SERVED_DECODE: 5_000_000,
                                           Role.READER_IDLE: 4 * 44_544}
    assert res.report()["decode_loss"] == 0.0
    # the next turn finds the same reader either way: the prompt read, 162 output ids behind
    for r in (undelayed, res):
        assert [(s.turn, s.kept_tokens, s.behind_tokens, s.fresh) for s in r.turn_starts] == [
            (0, 0, 0, True), (1, 2210, 162, True)]


@pytest.mark.parametrize("after_s,slices", [
    (0.0, [(0, 1), (512, 1), (1024, 1), (1536, 1)]),  # 2 % of 9.6 s: 192 ms, four chunks
    (5.0, [(0, 1), (512, 1)]),  # 2 % of the last 4.6 s: 92 ms, two chunks, none before 22 s
    (10.0, []),  # the decode ends before the share starts counting
], ids=["undelayed", "after-5s", "after-10s"])
def test_a_long_turn_spends_its_ration_only_after_the_delay(after_s, slices):
    recs = [rec("s", 0.0, 17.0, 26.6, 2048, 0, 346)]
    res = simulate(recs, SEED, SimOptions.of(ration_after_s=after_s), record_decisions=True)
    ration = [d for d in res.decisions if d.window is Window.RATION]
    assert [(d.start_row, d.num_chunks) for d in ration] == slices
    if ration:
        first = 17.0 + after_s + 2.2272  # the first 44.544 ms earned
        assert first <= ration[0].opened_s < first + 9.6 / 346  # at the first round boundary after it
    assert res.report()["reader_ms"]["ration"] == pytest.approx(len(slices) * CHUNK_MS)
    assert res.report()["decode_loss"] == pytest.approx(len(slices) * CHUNK_MS / 9600)
    # what the ration left is read by the idle window after the turn
    gpu_us = res.ledger.balance().gpu_us
    assert gpu_us.get(Role.READER_RATION, 0) == len(slices) * 44_544
    assert gpu_us.get(Role.READER_IDLE, 0) == (4 - len(slices)) * 44_544


def test_a_waiting_request_waits_at_most_one_chunk():
    recs = [rec("s", 0.0, 0.5, 1.0, 100 * 512, 0, 1),
            rec("s", 1.5, 1.6, 1.7, 100 * 512 + 10, 100 * 512, 1)]
    res = simulate(recs, SEED, record_decisions=True)
    burst = [d for d in res.decisions if d.turn == 1][0]
    assert (burst.num_chunks, burst.stop) == (12, Stop.WAITING)
    (wait,) = res.request_waits_ms
    assert wait == pytest.approx(34.528)
    assert res.turn_starts[1].arrival_s == pytest.approx(1.534528)  # the turn starts after the chunk


def test_rollback_to_checkpoint():
    # turn 0 prompt 4096 (checkpoint at 4096 once read), turn 1 keeps only 3000 ids of it: back to 0
    # (no checkpoint at or below 3000 except the start); with the prompt end at 2048 it goes back there
    recs = [rec("s", 0.0, 0.1, 0.2, 4096, 0, 1), rec("s", 5.0, 5.1, 5.2, 6000, 3000, 1)]
    res = simulate(recs, SEED, PROMPT_ENDS)
    assert (res.turn_starts[1].rolled_back_tokens, res.turn_starts[1].behind_tokens) == (4096, 3000)
    recs = [rec("s", 0.0, 0.1, 0.2, 2048, 0, 1), rec("s", 5.0, 5.1, 5.2, 4096, 2048, 1),
            rec("s", 10.0, 10.1, 10.2, 6000, 3000, 1)]
    res = simulate(recs, SEED, PROMPT_ENDS)
    assert (res.turn_starts[2].rolled_back_tokens, res.turn_starts[2].behind_tokens) == (2048, 952)
    assert not res.turn_starts[2].fresh
    # it had read to 4096 (fresh without the rollback) and 3000 lies between its checkpoints 2048 and 4096
    assert res.turn_starts[2].cause == "rollback_below_newest_checkpoint"
    assert res.turn_starts[2].behind_without_rollback == 0


def test_ration_never_exceeds_its_share_on_a_trace_slice(traces_dir):
    from qse.replay.traces import from_weka

    recs = from_weka(traces_dir / "weka_cc_sessions_dev.csv", max_sessions=8).records
    res = simulate(recs, SEED, record_decisions=True)
    report = res.report()
    assert 0.0 < report["fresh_share"] <= 1.0
    assert report["decode_loss"] <= 0.02 / 0.98 + 1e-9
    slices = [d for d in res.decisions if d.window is Window.RATION]
    assert slices and all(d.gpu_us <= 150_000 for d in slices)


def test_cli_replay_writes_report_and_chart(tmp_path, capsys):
    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, [rec("a", 0.0, 1.0, 20.0, 8192, 0, 684), rec("a", 30.0, 30.5, 40.0, 9000, 8192, 300),
                         rec("b", 0.0, 0.2, 1.0, 600, 0, 30)])
    model = tmp_path / "rm.json"
    model.write_text(json.dumps({"read_model": {"points": [[0, 40.0], [8192, 50.0]], "grid": 512}}))
    out = tmp_path / "out"
    rc = main([str(ledger), "--read-model", str(model), "--out", str(out), "--ration", "0.03", "--grid", "512",
               "--ration-after-s", "2.5", "--no-progress"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_sessions"] == 2 and report["num_turns"] == 3
    assert report["options"]["ration"] == 0.03 and report["options"]["ration_after_s"] == 2.5
    assert report["read_model"]["points"] == [[0, 40.0], [8192, 50.0]]
    assert (out / "replay.png").stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["fresh_share"] == report["fresh_share"]


def test_cli_replay_out_without_matplotlib_writes_the_report_and_says_how_to_chart(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, [rec("a", 0.0, 1.0, 20.0, 8192, 0, 684), rec("a", 30.0, 30.5, 40.0, 9000, 8192, 300)])
    out = tmp_path / "out"
    assert main([str(ledger), "--out", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["chart"] is None and report["num_turns"] == 2
    assert json.loads((out / "report.json").read_text())["fresh_share"] == report["fresh_share"]
    assert not (out / "replay.png").exists()
    assert captured.err.startswith("qse replay: matplotlib is not installed") and "qse[plot]" in captured.err
    assert captured.err.count("\n") == 1


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "rm.json"
    bad.write_text('{"read_model": {"points": []}}')
    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, [rec("a", 0.0, 1.0, 2.0, 100, 0, 1)])
    assert main([str(ledger), "--read-model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qse replay: ") and "no points" in err and err.count("\n") == 1
    assert main([str(ledger), "--ration-after-s", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qse replay: ") and "got -1.0" in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["weka_cc_sessions_dev.csv", "mooncake_conversation_inferred_chains.csv"])
def test_whole_trace_replays_within_the_rules(traces_dir, name):
    from qse.replay.traces import convert

    res = simulate(convert(traces_dir / name).records, SEED, record_decisions=False)
    report = res.report()
    assert report["num_turns"] == len(res.turn_starts) > 10_000
    assert 0.5 < report["fresh_share_followups"] <= 1.0
    assert report["decode_loss"] <= 0.02 / 0.98
    assert report["request_wait_ms"]["max"] <= CHUNK_MS + 1e-6  # a waiting request waits at most one chunk


# ---- why a turn start missed, and the checkpoint switches --------------------------------------------

def _into_the_output():
    """Turn 0: prompt 2048, 1100 ids out; the idle window reads 6 chunks (to 3072, into the output). Turn 1
    keeps the whole previous prompt and re-renders the output from id 3000 on: the reader goes back."""
    return [rec("s", 0.0, 0.1, 0.2, 2048, 0, 1100), rec("s", 10.0, 10.1, 10.2, 3000, 2048, 1)]


def test_rollback_into_the_output_and_recent_checkpoints():
    res = simulate(_into_the_output(), SEED, PROMPT_ENDS)
    start = res.turn_starts[1]
    assert (start.kept_tokens, start.rolled_back_tokens, start.behind_tokens) == (3000, 1024, 952)
    assert start.cause == "rollback_above_newest_checkpoint"  # the one checkpoint is the prompt end's, 2048
    report = res.report()
    assert report["misses"]["by_cause"]["rollback_above_newest_checkpoint"]["n"] == 1
    assert report["misses"]["rollback_only"] == {"n": 1, "share_of_misses": 1.0}
    assert report["checkpoints"]["max_held_by_a_session"] == 2  # 2048, then 2560 (turn 1's prompt end) read again

    # the newest two grid lines read are checkpoints too: back to 2560, less than a chunk behind
    res = simulate(_into_the_output(), SEED, SimOptions.of(recent_checkpoints=2))
    start = res.turn_starts[1]
    assert (start.rolled_back_tokens, start.behind_tokens, start.fresh) == (512, 440, True)
    assert res.report()["checkpoints"]["max_held_by_a_session"] == 3
    assert res.report()["checkpoints"]["max_per_session"] == 8
    # the runtime's default, four: the same here
    res = simulate(_into_the_output(), SEED)
    assert (res.turn_starts[1].rolled_back_tokens, res.turn_starts[1].behind_tokens) == (512, 440)
    assert res.report()["checkpoints"]["max_per_session"] == 10


def test_checkpoint_at_the_line_the_reader_stands_on():
    # turn 0 (1000 + 100 out) is read to 1024; turn 1's prompt (1100) ends on the line 1024 where the reader
    # stands: the reader takes the checkpoint there at once (the default); without it, only a chunk ending
    # on a line would
    recs = [rec("s", 0.0, 0.1, 0.2, 1000, 0, 100), rec("s", 10.0, 10.1, 10.2, 1100, 1000, 500),
            rec("s", 20.0, 20.1, 20.2, 1500, 1100, 1)]
    res = simulate(recs, SEED, SimOptions.of(checkpoint_at_line=False, recent_checkpoints=0))
    start = res.turn_starts[2]
    assert (start.kept_tokens, start.rolled_back_tokens, start.behind_tokens) == (1500, 1024, 988)  # back to 512
    assert start.cause == "rollback_above_newest_checkpoint"
    res = simulate(recs, SEED, PROMPT_ENDS)
    start = res.turn_starts[2]
    assert (start.rolled_back_tokens, start.behind_tokens, start.fresh) == (512, 476, True)  # back to 1024


def test_lines_are_checkpointed_again_after_a_rollback():
    # as the reader: a prompt end's line stays a line while the session holds that many ids, so the read
    # after going back to 0 takes the checkpoint at 2048 again and the next re-render at 2100 finds it
    recs = [rec("s", 0.0, 0.1, 0.2, 2048, 0, 1), rec("s", 10.0, 10.1, 10.2, 4096, 2048, 1),
            rec("s", 20.0, 20.1, 20.2, 5000, 1000, 1), rec("s", 30.0, 30.1, 30.2, 5200, 2100, 1)]
    res = simulate(recs, SEED)
    assert [(s.rolled_back_tokens, s.behind_tokens) for s in res.turn_starts[2:]] == [(4096, 1000), (4608 - 2048, 52)]
    assert res.turn_starts[2].cause == "rollback_below_oldest_checkpoint"
    assert res.turn_starts[3].fresh


def test_divergence_checkpoints_catch_the_second_re_render_at_the_same_place():
    recs = [rec("s", 0.0, 0.1, 0.2, 4096, 0, 1), rec("s", 10.0, 10.1, 10.2, 6000, 1500, 1),
            rec("s", 20.0, 20.1, 20.2, 7000, 1500, 1)]
    res = simulate(recs, SEED)
    assert [(s.behind_tokens, s.cause) for s in res.turn_starts[1:]] == [
        (1500, "rollback_below_oldest_checkpoint"), (1500, "rollback_below_oldest_checkpoint")]
    res = simulate(recs, SEED, SimOptions.of(divergence_checkpoints=1))
    assert [(s.behind_tokens, s.fresh) for s in res.turn_starts[1:]] == [(1500, False), (476, True)]


def test_pin_first_checkpoint_keeps_the_lowest():
    # 4 turns, each prompt 1024 longer; with one checkpoint the first (1024) is dropped for the next ones,
    # pinned it stays, and a re-render at 1100 goes back to it
    recs = [rec("s", 10.0 * k, 10.0 * k + 0.1, 10.0 * k + 0.2, 1024 * (k + 1), 1024 * k, 1) for k in range(4)]
    recs.append(rec("s", 40.0, 40.1, 40.2, 5000, 1100, 1))
    assert simulate(recs, SEED, SimOptions.of(checkpoints=1)).turn_starts[4].behind_tokens == 1100
    assert simulate(recs, SEED, SimOptions.of(checkpoints=1, pin_first_checkpoint=True)).turn_starts[4].behind_tokens == 76


def test_miss_causes_add_up_on_a_trace_slice(traces_dir):
    from qse.replay.simulator import MISS_CAUSES
    from qse.replay.traces import from_weka

    recs = from_weka(traces_dir / "weka_cc_sessions_dev.csv", max_sessions=12).records
    res = simulate(recs, SEED)
    misses = res.report()["misses"]
    assert sum(v["n"] for v in misses["by_cause"].values()) == misses["num_missed"] > 0
    assert set(misses["by_cause"]) == set(MISS_CAUSES)
    assert all(s.cause in MISS_CAUSES for s in res.turn_starts if s.turn > 0 and not s.fresh)
    assert all(s.cause == "first_turn" for s in res.turn_starts if s.turn == 0)
    # the checkpoint switches never make a turn start less fresh here, nor change what the windows spend
    more = simulate(recs, SEED, SimOptions.of(checkpoint_at_line=True, recent_checkpoints=4, divergence_checkpoints=4))
    assert more.report()["fresh_share"] >= res.report()["fresh_share"]


def test_cli_reads_a_shadow_measure_result(tmp_path, capsys):
    ledger = tmp_path / "u.jsonl"
    write_usage(ledger, [rec("a", 0.0, 1.0, 20.0, 8192, 0, 684), rec("a", 30.0, 30.5, 40.0, 9000, 8192, 300)])
    measured = tmp_path / "shadow_measure.json"
    measured.write_text(json.dumps({"device": "NVIDIA H200", "command": "shadow_measure.py", "qse": [
        {"preset": "qwen3.5-0.8b", "ops": "triton", "grid": 512, "ms_per_chunk_by_context": {"0": 28.0, "8192": 27.0}},
        {"preset": "qwen3.5-2b", "ops": "triton", "grid": 512, "ms_per_chunk_by_context": {"0": 21.0}}]}))
    out = tmp_path / "res" / "replay-x.json"
    chart = tmp_path / "res" / "replay-x.png"
    rc = main([str(ledger), "--read-model", str(measured), "--json-out", str(out), "--chart", str(chart),
               "--recent-checkpoints", "2", "--no-progress"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["read_model"]["points"] == [[0, 28.0], [8192, 27.0]]
    assert "preset=qwen3.5-0.8b" in report["read_model"]["source"]
    assert report["command"].startswith("qse replay ") and "--read-model" in report["command"]
    assert report["options"]["recent_checkpoints"] == 2 and report["options"]["checkpoint_at_line"] is True
    assert json.loads(out.read_text())["misses"] == report["misses"]
    assert chart.stat().st_size > 0 and report["chart"] == str(chart)

    assert main([str(ledger), "--read-model", str(measured), "--read-model-preset", "qwen3.5-2b", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["read_model"]["points"] == [[0, 21.0]]
    assert main([str(ledger), "--read-model-preset", "qwen3.5-2b"]) == 2
    assert "need --read-model" in capsys.readouterr().err


def test_a_chunk_in_a_group_takes_the_measured_share_of_its_time_alone():
    from qse.replay.read_model import group_share

    assert group_share(1) == 1.0
    assert group_share(4) == pytest.approx(0.868, abs=1e-3)
    assert group_share(8) == pytest.approx(0.850, abs=1e-3)
    assert group_share(16) == pytest.approx(0.840, abs=1e-3)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="whole number of chunks"):
            group_share(bad)
    with pytest.raises(ValueError, match="idle_group must be a whole number of chunks >= 1, got 0"):
        SimOptions.of(idle_group=0)


def test_idle_groups_read_the_backlog_in_less_device_time():
    """44 chunks of backlog in one idle gap, groups of up to 16: launches of 16, 16, 8 and 4, each chunk at
    its group's share; the next turn starts fresh, as with one chunk a launch."""
    from qse.replay.read_model import group_share

    prompt = 44 * 512
    recs = [rec("s", 0.0, 0.5, 1.0, prompt, 0, 1), rec("s", 3.0, 3.1, 3.2, prompt + 100, prompt, 1)]
    alone = simulate(recs, SEED)
    grouped = simulate(recs, SEED, SimOptions.of(idle_group=16), record_decisions=True)
    assert alone.turn_starts[1].fresh and grouped.turn_starts[1].fresh
    want_us = 44_544 * (32 * group_share(16) + 8 * group_share(8) + 4 * group_share(4))
    assert grouped.ledger.balance().gpu_us[Role.READER_IDLE] == pytest.approx(want_us, abs=4)
    assert alone.ledger.balance().gpu_us[Role.READER_IDLE] == 44 * 44_544
    burst = [d for d in grouped.decisions if d.turn == 1][0]
    assert (burst.num_chunks, burst.stop) == (44, Stop.BACKLOG)


def test_a_waiting_request_waits_at_most_one_group():
    recs = [rec("s", 0.0, 0.5, 1.0, 100 * 512, 0, 1),
            rec("s", 1.5, 1.6, 1.7, 100 * 512 + 10, 100 * 512, 1)]
    res = simulate(recs, SEED, SimOptions.of(idle_group=4), record_decisions=True)
    from qse.replay.read_model import group_share

    group_ms = 4 * CHUNK_MS * group_share(4)
    burst = [d for d in res.decisions if d.turn == 1][0]
    assert burst.stop is Stop.WAITING and burst.num_chunks % 4 == 0
    (wait,) = res.request_waits_ms
    assert 0 < wait <= group_ms
    assert wait == pytest.approx(burst.num_chunks // 4 * group_ms - 500.0)


def test_served_ttft_with_and_without_the_session_cache():
    """The served turn reads from the newest state it holds at or below what the prompt keeps: turn 1 from the
    line turn 0 left (512), turn 2 re-rendered at id 300, below every state held, reads from row 0 like cold."""
    recs = [rec("s", 0.0, 1.0, 2.0, 1000, 0, 36),
            rec("s", 10.0, 10.1, 11.0, 1600, 1000, 36),
            rec("s", 20.0, 20.1, 21.0, 2100, 300, 36)]
    starts = simulate(recs, SEED).turn_starts
    assert [s.served_from for s in starts] == [0, 512, 0]
    # whole chunks up to the last line below the prompt's end, then the tail as its share of a chunk
    cached = [1 + 488 / 512, 2 + 64 / 512, 4 + 52 / 512]
    cold = [1 + 488 / 512, 3 + 64 / 512, 4 + 52 / 512]
    assert [s.served_ttft_cached_ms for s in starts] == pytest.approx([c * CHUNK_MS for c in cached])
    assert [s.served_ttft_cold_ms for s in starts] == pytest.approx([c * CHUNK_MS for c in cold])
    report = simulate(recs, SEED).report()["served_ttft_ms"]
    assert report["cached"]["n"] == report["cold"]["n"] == 2
    assert report["ratio_p50"] == pytest.approx((2 + 64 / 512) / (3 + 64 / 512))


def test_the_shortest_slice_reads_cheap_chunks_in_fewer_slices_for_the_same_share():
    """1.2 ms chunks over a 9.6 s decode (a 2 % share, undelayed): a slice a chunk without a shortest slice,
    about one slice per 10 ms with it; the reader's device time is the same share, and with a fixed 2 ms a
    slice the decode's wall loss falls with the number of slices."""
    cheap = ReadModel.flat(2.34375)  # 1.2 ms a 512 chunk
    recs = [rec("s", 0.0, 1.0, 10.6, 300 * 512, 0, 346)]  # more backlog than the share reads
    every = simulate(recs, cheap, SimOptions.of(ration_after_s=0.0, min_slice_ms=0.0, slice_overhead_ms=2.0),
                     record_decisions=True)
    batched = simulate(recs, cheap, SimOptions.of(ration_after_s=0.0, min_slice_ms=10.0, slice_overhead_ms=2.0),
                       record_decisions=True)
    one, ten = every.report(), batched.report()
    assert all(d.num_chunks == 1 for d in every.decisions if d.window is Window.RATION)
    assert one["num_ration_slices"] == sum(1 for d in every.decisions if d.window is Window.RATION) > 100
    slices = [d for d in batched.decisions if d.window is Window.RATION]
    assert ten["num_ration_slices"] == len(slices) and all(d.num_chunks >= 8 for d in slices[:-1])
    assert ten["num_ration_slices"] * 8 <= one["num_ration_slices"]
    # the same share of device time, within a slice's worth
    assert abs(ten["reader_ms"]["ration"] - one["reader_ms"]["ration"]) <= 10.0
    assert one["decode_loss_wall"] == pytest.approx(one["decode_loss"] + one["num_ration_slices"] * 2.0 / 9600)
    assert ten["decode_loss_wall"] < one["decode_loss_wall"] / 2


def test_a_bad_slice_overhead_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"slice_overhead_ms .* got -1\.0"):
        SimOptions.of(slice_overhead_ms=-1.0)
