"""Lint: pyflakes' rules (ruff's F) over the whole tree. An undefined name is a crash waiting for the one path
that reaches it (qse/server/app.py once turned every unexpected error into a reset connection that way);
an unused import or variable hides what a module really needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINTED = ["qse", "qse_kernels", "tests", "benchmarks", "scripts"]


def _ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # the venv's ruff (a test extra), with pyproject.toml's [tool.ruff] settings
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_has_no_pyflakes_findings():
    done = _ruff(*LINTED)
    assert done.returncode == 0, f"ruff check found:\n{done.stdout}{done.stderr}"


def test_the_lint_fails_on_an_undefined_name(tmp_path):
    """The rule set catches what it is here for (a config that selected nothing would pass any tree)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def answer():\n    return internal_error(42)\n")
    done = _ruff("--config", str(REPO / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert done.returncode == 1
    assert "F821" in done.stdout and "internal_error" in done.stdout
