"""The served benchmarks run end to end on the embedded model on CPU (their H200 runs are in run_h200.sh)."""

from __future__ import annotations

import json
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


def test_staggered_arrivals_count_each_user_s_ttft_from_its_own_send(tmp_path, cache_dir):
    out = subprocess.run([sys.executable, "benchmarks/served_load.py", "--tiny", "--arrival-gap-s", "0.05",
                          "--decode-yield-ms", "50", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    two = [lv for lv in result["levels"] if lv["users"] == 2]
    assert two and all(lv["arrival_gap_s"] == 0.05 and 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"] for lv in two)
    assert all(lv["decode_yield_ms"] == 50.0 for lv in result["levels"])
    assert all(lv["output_tokens"] == 8 for lv in two)
    bad = subprocess.run([sys.executable, "benchmarks/served_load.py", "--tiny", "--arrival-gap-s", "-1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--arrival-gap-s must be a finite number of seconds >= 0, got -1.0" in bad.stderr
