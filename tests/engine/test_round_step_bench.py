"""benchmarks/round_step.py end to end on the tiny model on CPU: it writes the result JSON it promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import round_step  # noqa: E402


def test_round_step_writes_a_row_per_batch_size(tmp_path, cache_dir):
    assert round_step.main(["--preset", "embedded", "--batches", "1,2,3", "--context", "40", "--rounds", "2",
                            "--kernels", "naive", "--graphs", "static", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("round_step-*-cpu.json")
    result = json.loads(path.read_text())
    assert list(result)[:4] == ["command", "date", "device", "versions"] and result["device"] == "cpu"
    assert result["buckets"] == [1, 2, 3] and result["graphs"] is False
    assert [(r["batch"], r["bucket"], r["rounds"]) for r in result["rows"]] == [(1, 1, 2), (2, 2, 2), (3, 3, 2)]
    assert all(r["device_ms_per_round"] > 0 and r["tokens_per_s"] > 0 for r in result["rows"])


def test_round_step_runs_each_pdl_mode_it_is_asked_for(tmp_path, cache_dir):
    """--pdl off,wait: a row a batch size and mode, each naming its mode (PDL itself is never active on a CPU);
    an unknown mode is refused by name."""
    import pytest

    assert round_step.main(["--preset", "embedded", "--batches", "1", "--context", "20", "--rounds", "1",
                            "--kernels", "naive", "--graphs", "static", "--pdl", "off,wait",
                            "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("round_step-*-cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["pdl"], r["batch"], r["pdl_active"]) for r in rows] == [("off", 1, False), ("wait", 1, False)]
    with pytest.raises(SystemExit):
        round_step.main(["--preset", "embedded", "--pdl", "wait+sometimes", "--out", str(tmp_path)])
    from qse_kernels import pdl

    assert (round_step.parse_pdl("release"), round_step.parse_pdl("default")) == (pdl.RELEASE_FIRST, pdl.ORDER)


def test_round_step_sets_the_knobs_it_is_given_and_refuses_unknown_ones(tmp_path, cache_dir, monkeypatch):
    from qse_kernels import attention

    monkeypatch.setattr(attention, "DECODE_MIN_SPLIT_ROWS", attention.DECODE_MIN_SPLIT_ROWS)
    assert round_step.main(["--preset", "embedded", "--batches", "1", "--context", "20", "--rounds", "1",
                            "--kernels", "naive", "--graphs", "static",
                            "--knob", "attention.DECODE_MIN_SPLIT_ROWS=64", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("round_step-*-cpu.json")
    assert json.loads(path.read_text())["knobs"] == {"attention.DECODE_MIN_SPLIT_ROWS": 64}
    assert attention.DECODE_MIN_SPLIT_ROWS == 64
    import pytest

    for bad in ("attention.NO_SUCH_KNOB=1", "nomodule.X=1", "attention.DECODE_MIN_SPLIT_ROWS=lots"):
        with pytest.raises(SystemExit):
            round_step.main(["--preset", "embedded", "--knob", bad, "--out", str(tmp_path)])


def test_round_step_times_each_arm_in_turn_and_puts_its_knobs_back(tmp_path, cache_dir, monkeypatch):
    """--arms '- moe.ROUTER_SPLIT_K=4,moe.PAIRS_ROUTE_FIRST=True' --repeats 2: a row an arm, a repeat and a batch
    size, in order, each naming its arm; every knob as it was after the run (and after a refused arm)."""
    import pytest

    from qse_kernels import moe

    monkeypatch.setattr(moe, "ROUTER_SPLIT_K", 2)
    monkeypatch.setattr(moe, "PAIRS_ROUTE_FIRST", False)
    arm = "moe.ROUTER_SPLIT_K=4,moe.PAIRS_ROUTE_FIRST=True"
    assert round_step.main(["--preset", "embedded", "--batches", "1", "--context", "20", "--rounds", "1",
                            "--kernels", "naive", "--graphs", "static", "--arms", f"- {arm}", "--repeats", "2",
                            "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("round_step-*-cpu.json")
    result = json.loads(path.read_text())
    rows = result["rows"]
    assert [r["arm"] for r in rows] == ["-", arm] * 2
    for name in ("-", arm):  # each arm's mean over its two repeats (JSON keys: the batch as text)
        ms = [r["device_ms_per_round"] for r in rows if r["arm"] == name]
        assert result["by_arm"][name]["default"]["1"] == round(sum(ms) / 2, 4)
    assert (moe.ROUTER_SPLIT_K, moe.PAIRS_ROUTE_FIRST) == (2, False)
    seen = []
    ran = {"graphs": False, "buckets": [1], "warm_s": 0.0}
    monkeypatch.setattr(round_step, "decode_rows",
                        lambda *a, **k: (seen.append((moe.ROUTER_SPLIT_K, moe.PAIRS_ROUTE_FIRST)) or [], ran))
    round_step.main(["--preset", "embedded", "--batches", "1", "--kernels", "naive", "--arms", f"{arm} -",
                     "--out", str(tmp_path)])
    assert seen == [(4, True), (2, False)]
    with pytest.raises(SystemExit):
        round_step.main(["--preset", "embedded", "--arms", "- moe.NO_SUCH=1", "--out", str(tmp_path)])
    assert (moe.ROUTER_SPLIT_K, moe.PAIRS_ROUTE_FIRST) == (2, False)
