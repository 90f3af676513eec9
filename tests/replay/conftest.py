"""Where the public traces are: ../shared/data/traces beside the repository (as in CI)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def shared_traces_dir() -> Path:
    return (REPO / ".." / "shared" / "data" / "traces").resolve()


@pytest.fixture
def traces_dir() -> Path:
    path = shared_traces_dir()
    if not path.is_dir():
        pytest.fail(f"public traces not found at {path} (the shared dir sits beside the clone as ../shared)")
    return path
