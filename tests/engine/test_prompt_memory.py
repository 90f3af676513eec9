"""Memory bounded by the chunk, not the prompt: a 64k-token prompt on the embedded model, on the CPU, peaks
under 2 GB above the model's own memory, through the served turn's start and a reader's question (see
prompt_memory_run.py for what is read and why). The measure is the process's VmHWM, in a process of its own
so that nothing else this session's tests allocated is counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).with_name("prompt_memory_run.py")
PROMPT, GRID = 65536 + 100, 512  # 64Ki tokens and a tail under one chunk
LIMIT = 2 << 30

pytestmark = pytest.mark.slow


def test_a_64k_prompt_peaks_under_2_gb_above_the_model(cache_dir):
    line = (PROMPT // GRID) * GRID
    parked = line - GRID  # the served turn and the question each read one chunk and the tail over the 64k
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QSE_TEST_PROMPT": str(PROMPT),
           "PYTHONPATH": os.pathsep.join([str(RUN.parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(RUN), str(cache_dir), str(parked)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == PROMPT
    assert out["served_chunks_read"] == 1 and out["served_tail_tokens"] == PROMPT - line  # over 64k rows of context
    assert out["reader_read_tokens"] == GRID and out["reader_committed"] == line  # read and kept
    assert PROMPT - line < out["fork_tokens"] < GRID  # the fork: the tail and the question, never the backlog
    assert 0 < out["peak_growth_bytes"] < LIMIT, out


def test_the_prompt_memory_benchmark_runs_tiny(tmp_path, cache_dir):
    """In this process (a process of its own costs more than the run: torch's import and the model's load)."""
    from benchmarks.prompt_memory import main as bench

    assert bench(["--preset", "embedded", "--reader", "embedded", "--lengths", "300", "--grid", "128",
                  "--out", str(tmp_path)]) == 0
    [written] = tmp_path.glob("prompt_memory-*.json")
    row = json.loads(written.read_text())["rows"][0]
    assert row["prompt_tokens"] == 300 and row["served_chunks"] == 2 and row["reader_read_tokens"] == 256
    assert row["reader_fork_tokens"] == 300 - 256 + 40 and row["served_peak_growth_bytes"] >= 0
