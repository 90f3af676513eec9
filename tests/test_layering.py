"""Layering rules of DESIGN.md that a test can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILY_NAMES = re.compile(r"qwen|Qwen|QWEN|qwen3_5|Qwen35")
# a family's chat format spelt out (its turn and thought markers): the chat format object renders those
FORMAT_MARKERS = re.compile(r"im_start|im_end|<think>|</think>|<\|endoftext\|>")


def test_server_and_runtime_never_name_a_model_family():
    offenders = []
    for package in ("qse/server", "qse/runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, line in enumerate(path.read_text().splitlines(), start=1):
                if FAMILY_NAMES.search(line) or FORMAT_MARKERS.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "code under qse/server or qse/runtime names a model family or its format:\n" + "\n".join(offenders)


def test_kernels_import_nothing_of_qse():
    for path in (ROOT / "qse_kernels").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+qse(\.|\s|$)", text, re.M), f"{path} imports qse"


def test_core_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import qse.core, qse.settings; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# the entry points build the policy from the settings and hand it down; these read the switches themselves
ENTRY_POINTS = {"qse/cli.py", "qse/server/cli.py", "qse/replay/cli.py", "qse/settings.py", "qse/policy.py"}
BELOW_THE_ENTRY_POINTS = ("qse/runtime", "qse/core", "qse/sessions", "qse/store", "qse/shadow", "qse/engine",
                          "qse/replay", "qse/models")


def test_nothing_below_the_entry_points_reads_the_process_settings():
    """One policy object, built at the entry point: no module below it imports SETTINGS (the process's switches)
    or names it, so a default or a switch cannot be read in two places."""
    offenders = []
    for package in BELOW_THE_ENTRY_POINTS:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in ENTRY_POINTS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and any(a.name == "SETTINGS" for a in node.names):
                    offenders.append(f"{rel}:{node.lineno}: imports SETTINGS")
                elif isinstance(node, ast.Name) and node.id == "SETTINGS":
                    offenders.append(f"{rel}:{node.lineno}: names SETTINGS")
    assert not offenders, "below the entry points, only the policy handed down may be read:\n" + "\n".join(offenders)
