"""benchmarks/agents_replay.py on a small agents run: the live policy's replay, the others beside it, and the
bounds (faster chunks, each session alone) on the side the replay's own model says they must be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def turn(agent, no, sent, prompt, cached, out=8):
    return {"agent": agent, "turn": no, "sent_s": sent, "ttft_s": 0.1, "end_s": sent + 0.5, "prompt_tokens": prompt,
            "cached_tokens": cached, "output_tokens": out, "server_ttft_s": 0.09, "error": None,
            "reader_behind_tokens": None if no == 0 else 600 * (agent == 2)}


def test_replays_an_agents_run_under_each_policy(tmp_path):
    # three agents whose first prompts arrive together and whose follow-ups overlap
    turns = []
    for a in range(3):
        turns += [turn(a, 0, 0.1 * a, 6000 + 1000 * a, 0), turn(a, 1, 2.0 + 0.05 * a, 9000 + 900 * a, 5632 + 512 * a),
                  turn(a, 2, 4.0 + 0.05 * a, 12000 + 900 * a, 8704 + 512 * a)]
    run = tmp_path / "agents_live-x.json"
    run.write_text(json.dumps({"agents": {"turns_detail": turns}}))
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "benchmarks/agents_replay.py", str(run), "--chunk-scales", "0.5",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = {r["policy"]: r for r in result["policies"]}
    assert {"live", "budget_1024", "yield_50ms", "live_chunks_x0.5", "each_session_alone"} <= set(rows)
    live = rows["live"]
    assert live["followups"] == 6 and live["first_p50_s"] > 0
    # half the chunk cost cannot make a follow-up wait longer; neither can having the device alone
    assert rows["live_chunks_x0.5"]["followup_p90_s"] <= live["followup_p90_s"]
    assert rows["each_session_alone"]["followup_p50_s"] <= live["followup_p50_s"]
    assert result["live_measured"]["client"]["followups"] == 6
    # the reader's rows: its idle window between the turns under each order, fresh shares of the 6 follow-ups
    assert result["kept_from"] == "cached_tokens"  # no trace in this run: the served cache's reuse stands in
    assert result["live_measured"]["reader"] == {"fresh_share": round(4 / 6, 4), "turn_starts": 6,
                                                 "stale": ["agent-2/t1", "agent-2/t2"]}
    for name in ("reader_oldest_polled", "reader_shortest_woken"):
        row = rows[name]
        assert row["turn_starts"] == 6 and 0 <= row["fresh_share"] <= 1 and row["reader_chunks"] > 0
        assert len(row["stale"]) == round((1 - row["fresh_share"]) * 6)


def test_the_ids_each_prompt_keeps_come_from_the_runs_own_trace():
    """kept_prefixes rebuilds the client's plan from the trace the run names: each follow-up keeps its previous
    prompt (its output ids are not the trace's), and where the trace re-renders a session the prompt keeps only
    its head. The 12-04 run's server measured agent 5's turn 1 14,656 ids behind a reader that had read nothing
    of it: the head the trace keeps there."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.agents_replay import kept_prefixes, records_of

    trace = ROOT.parent / "shared" / "data" / "traces" / "weka_cc_sessions_dev.csv"
    assert trace.is_file(), f"{trace} is not present (../shared is laid beside the checkout in CI)"
    run = json.loads((ROOT / "benchmarks/results/agents_live-pdl-2026-12-04-h200.json").read_text())
    kept = kept_prefixes(run, trace)
    detail = {(t["agent"], t["turn"]): t for t in run["agents"]["turns_detail"]}
    assert set(kept) == set(detail)
    assert all(kept[(a, 0)] == 0 for a in range(8))
    assert kept[(0, 1)] == detail[(0, 0)]["prompt_tokens"] == 15161
    assert kept[(5, 1)] == detail[(5, 1)]["reader_behind_tokens"] == 14656
    records = records_of(run, "agents", kept)
    assert [r.shared_prefix_tokens for r in records] == [kept[(t["agent"], t["turn"])] for t in
                                                         run["agents"]["turns_detail"]]
    assert kept_prefixes(run, ROOT / "no-such-trace.csv") == {}


def test_base_overrides_are_parsed_by_each_fields_setting():
    from benchmarks.agents_replay import policy_changes

    assert policy_changes(["first_token_early=off", "round_token_budget=1024", "decode_yield_ms=50"]) == {
        "first_token_early": False, "round_token_budget": 1024, "decode_yield_ms": 50.0}
    with pytest.raises(ValueError, match="'budget=1': expected FIELD=VALUE"):
        policy_changes(["budget=1"])
    with pytest.raises(ValueError, match="QSE_ROUND_CUT='maybe' is not a valid bool"):
        policy_changes(["cut_rounds=maybe"])
