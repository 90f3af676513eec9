"""The grammar decode benchmark runs end to end at a tiny size on the CPU (its figures come from the H200)."""

from __future__ import annotations

import json


def test_grammar_decode_benchmark_writes_its_result(tmp_path, cache_dir):
    from benchmarks.grammar_decode import main

    result = main(["--model", "", "--device", "cpu", "--tokens", "12", "--pairs", "1", "--out", str(tmp_path)])
    written = json.loads(next(tmp_path.glob("grammar_decode-*.json")).read_text())
    assert written["ratio"] == result["ratio"] > 0
    assert written["pairs"][0]["grammar"]["tokens"] > 0 and written["pairs"][0]["plain"]["tokens"] == 11
    assert list(written)[:4] == ["command", "date", "device", "versions"]
