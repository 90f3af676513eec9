"""Layering rules of DESIGN.md that a test can hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILY_NAMES = re.compile(r"qwen|Qwen|QWEN|qwen3_5|Qwen35")


def test_server_and_runtime_never_name_a_model_family():
    offenders = []
    for package in ("qse/server", "qse/runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, line in enumerate(path.read_text().splitlines(), start=1):
                if FAMILY_NAMES.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "code under qse/server or qse/runtime names a model family:\n" + "\n".join(offenders)


def test_kernels_import_nothing_of_qse():
    for path in (ROOT / "qse_kernels").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+qse(\.|\s|$)", text, re.M), f"{path} imports qse"


def test_core_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import qse.core, qse.settings; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
