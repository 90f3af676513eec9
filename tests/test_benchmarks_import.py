"""Every benchmark script imports on a machine without a GPU (its GPU work runs only under main())."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_imports_without_running(path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (a dataclass looks its module up there)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    if path.stem not in ("results_io", "timing", "engines", "stats", "__init__"):
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_results_record_the_versions_asked_for():
    from benchmarks.results_io import versions

    got = versions("torch", "no_such_package_qse")
    assert set(got) == {"python", "torch", "no_such_package_qse"}
    assert got["no_such_package_qse"] == "missing: ModuleNotFoundError"
    import torch

    assert got["torch"] == torch.__version__


def test_every_result_opens_with_the_command_date_device_and_versions():
    from benchmarks.results_io import result_header

    got = result_header("no_such_package_qse", device="cpu")
    assert list(got) == ["command", "date", "device", "versions"]
    assert got["device"] == "cpu" and got["versions"]["no_such_package_qse"].startswith("missing:")
    assert got["command"].split()[0] == sys.executable
