"""benchmarks/shadow_ab.py runs end to end on the CPU at a tiny scale and writes its JSON (before a GPU run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _shadow_ab():
    spec = importlib.util.spec_from_file_location("shadow_ab", REPO / "benchmarks" / "shadow_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_shadow_ab_tiny_on_cpu(cache_dir, tmp_path, capsys):
    out = tmp_path / "ab" / "shadow_ab.json"
    shadow_ab = _shadow_ab()
    # the ration counts from 5 s past the first token by default, and this tiny decode is over long before:
    # the harness's ration path is checked undelayed
    rc = shadow_ab.main(["--served", "embedded", "--reader", "embedded", "--prompt-tokens", "200",
                            "--out-tokens", "24", "--pairs", "1", "--grid", "32", "--gap-s", "0.3",
                            "--ration", "0.5", "--ration-after-s", "0", "--json-out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["served"] == result["reader"] == "embedded" and result["shared_engine"] is True
    assert result["conductor"]["ration"] == 0.5 and result["conductor"]["ration_after_s"] == 0.0
    assert [len(result["runs"][a]) for a in ("off", "on")] == [1, 1]
    assert len(result["paired_deltas_pct"]) == 1 and isinstance(result["decode_loss_pct"], float)
    on, off = result["runs"]["on"][0], result["runs"]["off"][0]
    assert on["output_tokens"] == off["output_tokens"] == 24
    assert off["reader_chunks"] == 0 and on["reader_chunks"] > 0  # the reader read in the on arm only
    assert on["ledger_ms"]["reader_ration"] > 0  # a half share earns slices between the rounds
    # the decode waited at least the slices' measured time; the off arm never waited on a slice
    assert on["reader_ration_wall_ms"] >= on["reader_ration_ms"] > 0 and off["reader_ration_wall_ms"] == 0
    # each slice read at least one chunk; the off arm took none
    assert 0 < on["reader_ration_slices"] <= on["reader_chunks"] and off["reader_ration_slices"] == 0
    gaps = on["token_gap_ms"]
    assert 0 < gaps["p50"] <= gaps["p90"] <= gaps["p99"] <= gaps["max"] and gaps["sum_over_p50"] >= 0
    assert len(on["gc_collections"]) == 3 and all(c >= 0 for c in on["gc_collections"])
    assert "--json-out" in result["command"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"written": str(out)}


def test_shadow_ab_refuses_a_run_without_a_decode_rate(capsys):
    with pytest.raises(SystemExit):
        _shadow_ab().main(["--out-tokens", "1"])
    assert "--out-tokens must be at least 2" in capsys.readouterr().err
