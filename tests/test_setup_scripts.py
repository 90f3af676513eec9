"""scripts/torch_plan: which torch a fresh machine gets. A machine without a GPU gets the CPU build (PyPI's
default torch is the CUDA build with its CUDA libraries: half a gigabyte of no use there), a GPU machine the
pinned release, and QSE_TORCH_SPEC wins over both."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, gpu: bool | None, spec: str | None = None) -> list[str]:
    """The plan's tries on a PATH whose nvidia-smi lists a GPU (True), lists none (False) or is absent (None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu is not None:
        listing = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"' if gpu else "echo 'No devices were found'; exit 6"
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{listing}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "QSE_TORCH_SPEC"}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    if spec is not None:
        env["QSE_TORCH_SPEC"] = spec
    done = subprocess.run(["bash", str(REPO / "scripts" / "torch_plan")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("gpu", [None, False], ids=["no-nvidia-smi", "nvidia-smi-lists-none"])
def test_a_machine_without_a_gpu_gets_the_cpu_build(tmp_path, gpu):
    assert _plan(tmp_path, gpu) == ["--no-index --no-deps torch==2.13.0 ; torch==2.13.0",
                                    "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0"]


def test_a_gpu_machine_gets_the_pinned_release(tmp_path):
    assert _plan(tmp_path, gpu=True) == ["torch==2.13.0"]


@pytest.mark.parametrize("gpu", [True, None], ids=["gpu", "cpu"])
def test_the_switch_wins_and_skip_installs_nothing(tmp_path, gpu):
    assert _plan(tmp_path, gpu, spec="torch==2.11.0") == ["torch==2.11.0"]
    assert _plan(tmp_path, gpu, spec="skip") == []
