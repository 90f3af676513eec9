"""benchmarks/moe_measure.py end to end on a tiny MoE on CPU: it writes the result JSON it promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import moe_measure  # noqa: E402

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_moe_measure_tiny_writes_every_figure(tmp_path):
    out = tmp_path / "moe.json"
    assert moe_measure.main(["--tiny", "--batches", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:4] == ["command", "date", "device", "versions"] and result["device"] == "cpu"
    assert result["preset"] == "tiny" and result["kernels"] == "naive" and result["graphs"] is False
    assert [r["batch"] for r in result["decode"]] == [1, 2] == [f["batch"] for f in result["floor"]]
    assert all(r["tokens_per_s"] > 0 and r["x_floor_nominal"] > 0 for r in result["decode"])
    one, two = result["floor"]
    assert 0 < one["experts_touched_a_layer"] < two["experts_touched_a_layer"] <= 8
    assert one["total_nbytes"] < result["weights_nbytes"] and one["floor_tokens_per_s_nominal"] > 0
    assert result["prefill"] and all(r["prompt"] == 48 and r["tokens_per_s"] > 0 for r in result["prefill"])
    peer = result["transformers"]
    assert peer["tokens_per_s"] > 0 and peer["steps"] == 2 and peer["prefill_argmax_equal"] is True
    assert peer["prefill_max_abs_logit_diff"] < 1e-3
    goals = result["goals"]
    assert set(goals) == {"decode_b1_x_floor_nominal", "decode_b1_ge_0.5_floor", "decode_b1_x_transformers",
                          "decode_b1_ge_10x_transformers"}
    assert goals["decode_b1_x_transformers"] > 0 and isinstance(goals["decode_b1_ge_10x_transformers"], bool)


def test_prefill_ab_runs_each_configuration_and_puts_the_switches_back(tmp_path, monkeypatch):
    """benchmarks/prefill_ab.py on the tiny MoE: a row a configuration and chunk size; PDL's switch and the
    model's fused block are as they were found afterwards, also when a configuration raises."""
    from benchmarks import prefill_ab
    from qse_kernels import pdl

    monkeypatch.setattr(prefill_ab, "resolve", lambda spec, device, dtype, cache_dir, seed: moe_measure.tiny_model(
        cache_dir))
    monkeypatch.setattr(pdl, "ON", False)
    assert prefill_ab.main(["tiny", "--prompt", "40", "--chunks", "16,40", "--out", str(tmp_path)]) == 0
    assert pdl.ON is False
    (path,) = tmp_path.glob("prefill_ab-*-cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["config"], r["chunk"]) for r in rows] == [(name, c) for name, _, _ in prefill_ab.CONFIGS
                                                          for c in (16, 40)]
    assert all(r["prompt"] == 40 and r["tokens_per_s"] > 0 and r["pdl_active"] is False for r in rows)
    calls = []

    def second_fails(engine, prompt, chunks):
        calls.append(pdl.ON)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return []

    monkeypatch.setattr(prefill_ab, "prefill_rows", second_fails)
    with pytest.raises(RuntimeError):
        prefill_ab.main(["tiny", "--out", str(tmp_path / "failed")])
    assert calls == [False, True] and pdl.ON is False
