"""The served benchmarks run end to end on the embedded model on CPU (their H200 runs are in run_h200.sh)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["served_load.py", "served_sessions.py", "served_moves.py"])
def test_a_tiny_run_writes_its_result(script, tmp_path, cache_dir):
    out = subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    written = list(tmp_path.glob("*.json"))
    assert len(written) == 1
    result = json.loads(written[0].read_text())
    assert result["command"] and result["versions"]
    if script == "served_load.py":
        assert [(lv["users"], lv["launch_ahead"]) for lv in result["levels"]] == [(1, True), (2, True), (1, False),
                                                                                   (2, False)]
        assert all(lv["output_tokens"] == 4 * lv["users"] for lv in result["levels"])
        for lv in result["levels"]:  # the measured device time never exceeds the wall it ran in
            assert 0 < lv["share_of_schedule_bound"] <= 1.0
            assert lv["schedule_bound_tokens_per_s"] >= lv["tokens_per_s"]
        assert result["targets"] == []  # the tiny run has no 8- or 32-user level
    elif script == "served_moves.py":
        for rep in result["repeats"]:
            # B's parked session came back from its file, reused, while A decoded every id it asked for
            assert rep["parked"] and rep["b_tier"] == "disk" and rep["b_cached_tokens"] > 0
            assert rep["a_tokens"] == result["out_tokens"] and rep["b_ttft_ms"] > 0
        assert result["store"]["restores"] == len(result["repeats"]) and not result["store"]["misses"]
    else:
        preset = result["presets"][0]
        turns = preset["turns"]
        for tier in ("device", "host", "disk"):
            # each copy of the session is found in its own tier on every turn after the first, and reused
            assert turns[0][tier]["cached_tokens"] == 0
            assert all(t[tier]["cached_tokens"] > 0 and t[tier]["tier"] == tier for t in turns[1:]), tier
            assert preset[f"{tier}_found_in"] == [tier]
        assert preset["ttft_cached_p50_ms"] == preset["ttft_device_p50_ms"]
        # the disk restores read ahead by the loader thread came back from that read, not the file
        prefetched = [r for r in preset["restores"] if r["tier"] == "disk_prefetched"]
        assert prefetched and all(r["moved"] and r["prefetched"] for r in prefetched)
        # the profiled restores name where the engine's thread spent them, the bring-in among them
        profiled = [r for r in preset["restores"] if "profile" in r]
        assert [r["tier"] for r in profiled] == ["disk_prefetched", "host"]
        assert all(any("_bring_in" in c["call"] for c in r["profile"]) for r in profiled)


def test_the_rounds_targets_judge_each_level_of_8_and_32_users():
    from benchmarks.served_load import rounds_targets

    def lv(users, share, x):
        return {"users": users, "round_token_budget": 2048, "launch_ahead": True, "share_of_schedule_bound": share,
                "decode_phase_x_one_user": x}

    got = rounds_targets([lv(1, 0.99, 1.0), lv(8, 0.95, 5.9), lv(32, 0.89, 18.0)])
    assert [(t["users"], t["met_share"], t["met_decode_phase"]) for t in got] == [(8, True, False), (32, False, True)]
    assert rounds_targets([lv(8, None, None)])[0]["met_share"] is None


def test_the_decode_phase_is_the_window_where_every_user_decodes():
    from benchmarks.served_load import decode_phase

    rows = [{"stamps": [1.0, 1.1, 1.2, 1.3, 1.4]},  # first id at 1.0, last at 1.4
            {"stamps": [1.15, 1.25, 1.35, 1.45, 1.55, 1.65]}]  # starts last, ends last
    span, tokens = decode_phase(rows)
    assert span == pytest.approx(0.25)  # from 1.15 (the last first id) to 1.4 (the first last id)
    assert tokens == 5  # 1.2, 1.3, 1.4 of the first; 1.25, 1.35 of the second


def test_token_gaps_are_every_user_s_gaps_between_consecutive_ids():
    from benchmarks.served_load import token_gaps

    rows = [{"stamps": [1.0, 1.01, 1.02, 1.12]},  # gaps 10, 10, 100 ms
            {"stamps": [2.0, 2.02, 2.04]},  # gaps 20, 20 ms
            {"stamps": [3.0]}]  # one id: no gap, no TPOT
    got = token_gaps(rows)
    assert got["itl_p50_ms"] == pytest.approx(20.0) and got["itl_max_ms"] == pytest.approx(100.0)
    assert got["itl_p99_ms"] == pytest.approx(100.0)  # the largest of five gaps
    assert got["tpot_p50_ms"] == pytest.approx((40.0 + 20.0) / 2)  # the median of 40 ms (120/3) and 20 ms
    assert token_gaps([{"stamps": [1.0]}]) == {"itl_p50_ms": None, "itl_p99_ms": None, "itl_max_ms": None,
                                               "tpot_p50_ms": None}


def test_staggered_arrivals_count_each_user_s_ttft_from_its_own_send(tmp_path, cache_dir, capsys):
    out = subprocess.run([sys.executable, "benchmarks/served_load.py", "--tiny", "--arrival-gap-s", "0.05",
                          "--decode-yield-ms", "50", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    two = [lv for lv in result["levels"] if lv["users"] == 2]
    assert two and all(lv["arrival_gap_s"] == 0.05 and 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"] for lv in two)
    assert all(lv["decode_yield_ms"] == 50.0 for lv in result["levels"])
    assert all(lv["output_tokens"] == 8 for lv in two)
    from benchmarks.served_load import main  # the refusal comes before any model loads: in this process

    with pytest.raises(SystemExit) as bad:
        main(["--tiny", "--arrival-gap-s", "-1"])
    assert bad.value.code == 2
    assert "--arrival-gap-s must be a finite number of seconds >= 0, got -1.0" in capsys.readouterr().err


def test_agents_live_drives_a_real_server_through_the_openai_client(tmp_path, cache_dir):
    """The agents benchmark on the embedded model: every phase's turns are served over HTTP, the follow-ups reuse
    their session's state, the cold baseline reuses none, and the server's own counters cover the phase."""
    out = subprocess.run([sys.executable, "benchmarks/agents_live.py", "--tiny", "--ab", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "QSE_CACHE_DIR": str(cache_dir)})
    assert out.returncode == 0, out.stderr[-2000:]
    [written] = list(tmp_path.glob("agents_live-*.json"))
    result = json.loads(written.read_text())
    # uvicorn ends on SIGTERM after its graceful shutdown and re-raises the signal
    assert result["command"] and result["versions"]["openai"] and result["server_exit"] in (0, -signal.SIGTERM)
    from benchmarks.agents_live import agent_shapes

    shapes = agent_shapes(Path(result["trace"]), 3, 3, 60000, 0.2, 4, 0.02)
    for name, plans in (("solo", shapes[:1]), ("agents", shapes[1:])):
        phase = result[name]
        assert phase["failed"] == [] and phase["turns"] == sum(len(s) for _, s in plans), name
        detail = phase["turns_detail"]
        assert all(t["output_tokens"] >= 1 and t["ttft_s"] > 0 for t in detail), name
        follow = [t for t in detail if t["turn"] > 0]
        assert all(t["cached_tokens"] > 0 for t in follow), name  # the session's state came back over HTTP
        assert all(t["cached_tokens"] == 0 for t in detail if t["turn"] == 0), name
        # each turn's stations came from the server's log, joined by the request id the client sent
        assert all(0 <= t["wait_open_s"] and 0 < t["open_to_first_s"] and t["server_ttft_s"] <= t["ttft_s"]
                   and t["tier"] == "device" and t["chunks_read"] >= 0 for t in follow), name
        assert phase["followup_stations"]["open_to_first_s"]["n"] == len(follow), name
        server = phase["server"]
        # the reader saw every follow-up's start (a fresh state dir: no first turn counts), the server counted
        # every prompt token and every cached one the client was told of
        assert server["turn_starts"] == len(follow), name
        assert server["prefix_cache_query_tokens"] == sum(t["prompt_tokens"] for t in detail), name
        assert server["prefix_cache_hit_tokens"] == sum(t["cached_tokens"] for t in detail), name
        assert server["device_ms"]["served_prefill"] > 0 and server["device_ms"]["served_decode"] >= 0
    # the reader's idle reads, from the server's log: each a session's chunks, and the host's time around them
    reads = result["reader_reads"]
    assert reads is not None and reads["reads"] >= 1 and reads["chunks"] >= reads["reads"] and reads["device_ms"] > 0
    assert reads["fixed_ms_a_read"]["n"] == reads["reads"] and reads["gaps_ms_a_chunk"] is not None
    waits = result["followup_waits"]  # the slowest follow-ups' waits by cause, from the same log
    assert waits["turns"] >= 1 and waits["own"] > 0 and len(waits["slowest"]) == waits["turns"]
    assert all(w["ttft_s"] == pytest.approx(w["own"] + w["others"] + w["reader"] + w["rest"], abs=1e-3)
               for w in waits["slowest"])
    events = result["server_events"]  # the log's counts: the reads above came in idle bursts
    assert set(events) == {"round_cut", "idle_burst", "ration_slice"} and events["idle_burst"] >= 1
    cold = result["cold"]
    assert cold["turns"] == 2 and cold["failed"] == [] and cold["cached_tokens"] == 0
    assert cold["server"]["prefix_cache_hit_tokens"] == 0
    assert set(result["goals"]) >= {"followup_p50_le_0.2s", "reader_fresh_ge_0.95", "decode_loss_le_0.01",
                                    "decode_loss_ab_le_0.01"}
    # the A/B's second arm: the same agents on a server without the reader, every turn served, nothing read
    off = result["reader_off"]
    assert off["failed"] == [] and off["turns"] == result["agents"]["turns"]
    assert off["server"]["turn_starts"] == 0 and off["server"]["device_ms"]["reader_idle"] == 0
    ab = result["decode_ab"]
    assert ab["tpot_ms_reader_on"] > 0 and ab["tpot_ms_reader_off"] > 0
    assert ab["decode_loss"] == round(ab["tpot_ms_reader_on"] / ab["tpot_ms_reader_off"] - 1, 5)


def test_followup_waits_split_each_wait_by_what_the_device_did(tmp_path):
    """A follow-up's wait from arrival to first token: its own reads, the other turns' reads prorated over their
    open-to-first spans, the reader's idle bursts in the window, and the rest; the slowest first, and the p90's
    turns summed."""
    import gzip

    from benchmarks.agents_live import followup_waits, waits_summary

    def stamp(s):  # a log line's wall time for the conductor's second s: s + 900 (every turn's end says so)
        return f"1970-01-01T00:{int(s + 900) // 60:02d}:{(s + 900) % 60:09.6f}Z"

    events = [
        # agent 0's follow-up: arrives at 100.0, opens 100.1, first token 100.9; read 0.5 s of its own
        {"event": "turn", "session_id": "x-agent-0", "request_id": "x-agent-0-t1", "arrival_s": 100.0,
         "start_s": 100.1, "first_token_s": 100.9, "end_s": 101.0, "timestamp": stamp(101.0)},
        {"event": "served_turn_start", "request_id": "x-agent-0-t1", "read_ms": 400.0, "tail_ms": 100.0,
         "timestamp": stamp(100.9)},
        # agent 1's: open 99.8 to first token 100.2 (0.4 s), 0.2 s of reads: half its span is in the window
        {"event": "turn", "session_id": "x-agent-1", "request_id": "x-agent-1-t1", "arrival_s": 99.7,
         "start_s": 99.8, "first_token_s": 100.2, "end_s": 100.5, "timestamp": stamp(100.5)},
        {"event": "served_turn_start", "request_id": "x-agent-1-t1", "read_ms": 200.0, "tail_ms": 0.0,
         "timestamp": stamp(100.2)},
        # a first turn (not a follow-up), and the reader's burst 100.3 .. 100.4 (logged at its end)
        {"event": "turn", "session_id": "x-agent-2", "request_id": "x-agent-2-t0", "arrival_s": 90.0,
         "start_s": 90.0, "first_token_s": 91.0, "end_s": 92.0, "timestamp": stamp(92.0)},
        {"event": "idle_burst", "wall_ms": 100.0, "gpu_ms": 90.0, "timestamp": stamp(100.4)},
    ]
    log = tmp_path / "server.log.gz"
    with gzip.open(log, "wt") as f:
        f.write("not json\n" + "".join(json.dumps(e) + "\n" for e in events))
    waits = followup_waits(log)
    assert [w["request_id"] for w in waits] == ["x-agent-0-t1", "x-agent-1-t1"]
    first = waits[0]
    assert first["ttft_s"] == pytest.approx(0.9) and first["own"] == pytest.approx(0.5)
    assert first["others"] == pytest.approx(0.1) and first["reader"] == pytest.approx(0.1, abs=1e-3)
    assert first["rest"] == pytest.approx(0.2, abs=1e-3)
    second = waits[1]  # agent 0 opened at 100.1 and read 0.5 s over 0.8 s: 0.1 s of it falls in 100.0 .. 100.2
    assert second["ttft_s"] == pytest.approx(0.5) and second["others"] == pytest.approx(0.5 * 0.1 / 0.8)
    summary = waits_summary(waits)
    assert summary["turns"] == 1 and summary["slowest"] == [first] and summary["own"] == pytest.approx(0.5)
    assert followup_waits(tmp_path / "server.log.gz", session_mark="-nobody-") == []


def test_agents_live_shapes_follow_the_trace(tmp_path):
    """Each agent's turns keep the trace's order; a turn shares at most its previous prompt; think times capped."""
    from benchmarks.agents_live import agent_shapes, prompts_of

    trace = tmp_path / "t.csv"
    head = "trace_id,agent,idx,t_s,model,in,out,api_time_s,think_time_s,lcp_prev_tokens\n"
    rows = ["a,main,0,0,m,100,10,1.0,0,0", "a,main,1,30,m,150,10,1.0,29,100", "a,main,2,32,m,90,10,1.0,1,64",
            "a,sub,0,0,m,50,10,1.0,0,0", "b,main,0,0,m,500,10,1.0,0,0", "b,main,1,2,m,520,10,1.0,1,500",
            "c,main,0,0,m,80,10,1.0,0,0"]  # b's first prompt is over the limit; c has no follow-up
    trace.write_text(head + "\n".join(rows) + "\n")
    [(sid, turns)] = agent_shapes(trace, 1, 10, 200, 2.0, 8)
    assert sid == "a/main"
    assert [(t.prompt_tokens, t.shared_tokens, t.output_tokens) for t in turns] == [(100, 0, 8), (150, 100, 8),
                                                                                   (90, 64, 8)]
    assert [t.think_s for t in turns] == [0.0, 2.0, 1.0]  # 29 s capped at 2; 32 - 31 = 1
    prompts = prompts_of(turns, __import__("random").Random(0))
    assert [len(p) for p in prompts] == [100, 150, 90]
    assert prompts[1][:100] == prompts[0] and prompts[2][:64] == prompts[1][:64] and prompts[2][64] != prompts[1][64]
    head = list(range(7, 87))  # 80 ids every agent's prompts begin with, whatever the trace shares
    mine, theirs = prompts_of(turns, __import__("random").Random(1), head), prompts_of(turns, __import__("random").Random(2), head)
    assert all(p[:80] == head for p in mine + theirs) and [len(p) for p in mine] == [100, 150, 90]
    assert mine[1][:100] == mine[0] and mine[0][80:] != theirs[0][80:]
    with pytest.raises(SystemExit, match="2 asked"):
        agent_shapes(trace, 2, 10, 200, 2.0, 8)


def test_spec_measure_times_a_verify_against_a_decode_step(tmp_path, cache_dir):
    """The verify-cost benchmark on the embedded model (the graphs' CPU rehearsal): a row a batch and draft
    length, each with its ratio to the decode round, the oracle drafter's loop (its ids plain decoding's: on
    the CPU's torch twins no near-tie turns up here) and, at the published lengths, the projection; and the MTP
    cycle's rows (verify, keep and the rounds' own draft) on a tiny model with an MTP head."""
    out = subprocess.run([sys.executable, "benchmarks/spec_measure.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "QSE_CACHE_DIR": str(cache_dir)})
    assert out.returncode == 0, out.stderr[-2000:]
    [written] = list(tmp_path.glob("spec_measure-*.json"))
    result = json.loads(written.read_text())
    assert [(r["batch"], r["k"]) for r in result["rows"]] == [(b, k) for b in (1, 2) for k in (1, 3)]
    for r in result["rows"]:
        assert r["rows"] == r["k"] + 1 and r["verify_ms"] > 0 and r["decode_round_ms"] > 0
        assert r["x_decode_round"] == round(r["verify_ms"] / r["decode_round_ms"], 4)
        assert r["projected_x_plain"] == round(r["published_tokens_per_step"] / r["x_decode_round"], 3)
        assert r["oracle_ids_equal"] is True
        assert r["oracle_x_plain"] == round(r["oracle_tokens_per_s"] / r["plain_tokens_per_s"], 3)
        assert r["oracle_self_ids_equal"] is True
        assert r["oracle_self_x_plain"] == round(r["oracle_self_tokens_per_s"] / r["plain_tokens_per_s"], 3)
    assert set(result["goals"]) == {"verify_4_rows_le_1.15x_step", "oracle_k3_ge_2.5x_plain_batch_1",
                                    "projected_ge_1.8x_at_2.5", "batch_2_not_slower_at_2.5"}
    assert result["mtp_preset"] == "tiny-mtp"
    assert [(r["batch"], r["k"]) for r in result["mtp_rows"]] == [(b, k) for b in (1, 2) for k in (1, 3)]
    for r in result["mtp_rows"]:
        assert r["verify_ms"] > 0 and r["draft_ms"] > 0 and r["cycle_ms"] > 0 and r["decode_round_ms"] > 0
        assert r["x_decode_round"] == round(r["cycle_ms"] / r["decode_round_ms"], 4)
        assert r["projected_x_plain"] == round(r["published_tokens_per_step"] / r["x_decode_round"], 3)
