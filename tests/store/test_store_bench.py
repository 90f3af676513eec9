"""benchmarks/store_bench.py runs (--quick, on CPU) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "store_bench.py"


def test_quick_bench_writes_exact_results(store_cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QSE_CACHE_DIR", str(store_cache_dir))
    spec = importlib.util.spec_from_file_location("store_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--quick", "--tokens", "128,256", "--reps", "1", "--out", str(tmp_path / "results"),
                      "--disk-dir", str(tmp_path / "disk")])
    written = json.loads(Path(out["path"]).read_text())
    assert [r["tokens"] for r in written["results"]] == [128, 256]
    assert all(r["exact"] and r["file_bytes"] > r["state_bytes"] // 2 for r in written["results"])
    assert written["device"]["type"] == "cpu" and "random" in written["state"] and written["versions"]["torch"]
    assert list((tmp_path / "disk").iterdir()) == []  # the run's files are cleaned up
