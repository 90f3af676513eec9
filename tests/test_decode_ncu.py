"""benchmarks/decode_ncu.py: its summary of a kept Nsight Compute run, and its probe's flow on the CPU."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import decode_ncu

ROOT = Path(__file__).resolve().parents[1]
KEPT_CSV = ROOT / "benchmarks" / "results" / "ncu-decode-2026-12-07-h100.csv.gz"


def test_summarize_reads_a_kept_run(tmp_path):
    """The 2026-12-07 H100 probe (three passes of the GEMVs and the pairs block): one entry a launch, its kernel
    and the kept figures with their units, the lines ncu and the program print before the table skipped."""
    csv_path = tmp_path / "ncu.csv"
    csv_path.write_text(gzip.open(KEPT_CSV, "rt").read())
    launches = decode_ncu.summarize(csv_path)
    kernels = [entry["kernel"] for entry in launches]
    assert sum(name.startswith("_gemv_kernel") for name in kernels) == 9  # three matrices, three passes
    assert any(name.startswith("_dense_kernel") for name in kernels)
    for entry in launches:
        assert float(entry["Duration (ns)"].replace(",", "")) > 0
        assert 0 < float(entry["DRAM Throughput (%)"]) <= 100
        assert entry["Grid Size"]


def test_summarize_names_a_file_without_a_table(tmp_path):
    csv_path = tmp_path / "not-ncu.csv"
    csv_path.write_text("==PROF== Disconnected\n")
    with pytest.raises(ValueError, match=r"not-ncu.csv holds no ncu details table"):
        decode_ncu.summarize(csv_path)


def test_the_probe_runs_interpreted_on_the_cpu():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_ncu.py"), "--tiny"], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"probed": 1, "device": "cpu"}
