"""Layering rules of DESIGN.md that a test can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


# ---- families stay on the adapter path ----------------------------------------------------------------------
def family_packages() -> set[str]:
    """Every family on the adapter path: a package directory of its own under qse/models/."""
    return {f"qse.models.{p.parent.name}" for p in (ROOT / "qse/models").glob("*/__init__.py")}


def module_name(path: Path) -> tuple[str, bool]:
    """A source file's dotted name under ROOT, and whether it is a package's __init__."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `source` imports as module `module`, relative imports resolved; a
    `from X import Y` yields X and X.Y (Y may be a submodule), and importlib.import_module("...") of a constant
    counts too."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append((node.lineno, node.args[0].value))
    return names


def family_imports(source: str, module: str, families: set[str], is_package: bool = False) -> list[str]:
    """'module:line: imports name' for each line that imports a family package or anything inside one (its
    first such name: `from X import Y` names X where X is inside the family, else X.Y)."""
    found: dict[int, str] = {}
    for line, name in imported_names(source, module, is_package):
        if any(name == f or name.startswith(f + ".") for f in families):
            found.setdefault(line, f"{module}:{line}: imports {name}")
    return list(found.values())


def test_nothing_outside_the_models_imports_a_family():
    """DESIGN.md: a family is a package under qse/models/ plus one registry entry, nothing else changes to add
    one. So no module outside qse/models/ imports a family: it reaches models through the registry
    (qse/models/__init__.py, which may import them) and the family-neutral modules beside it."""
    families = family_packages()
    assert "qse.models.qwen3_5" in families, families  # an empty set would let any tree pass
    offenders = []
    for path in sorted((ROOT / "qse").rglob("*.py")):
        if (ROOT / "qse/models") in path.parents:
            continue
        module, is_package = module_name(path)
        offenders += family_imports(path.read_text(), module, families, is_package)
    assert not offenders, "outside qse/models/, a module imports a model family:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source,module,is_package", [
    ("from ..models.qwen3_5.model import Step", "qse.engine.fake", False),
    ("from ..models.qwen3_5 import layout", "qse.engine.fake", False),
    ("from ..models import qwen3_5", "qse.engine.fake", False),
    ("import qse.models.qwen3_5.layout", "qse.engine.fake", False),
    ("from qse.models.qwen3_5 import Qwen35Model", "qse.engine.fake", False),
    ("def f():\n    from ..models.qwen3_5.model import Qwen35Model", "qse.engine.fake", False),
    ("import importlib\nfamily = importlib.import_module('qse.models.qwen3_5')", "qse.engine.fake", False),
    ("from ..models.qwen3_5 import load", "qse.engine", True),  # a package's __init__: one level names the package
], ids=["relative-submodule", "relative-package", "registry-attribute", "absolute-import", "absolute-from",
        "function-local", "import_module", "package-init"])
def test_the_family_check_catches_an_offending_import(source, module, is_package):
    """The detector finds each way of spelling a family import (a check that found nothing would pass any tree),
    and names the module and what it imports."""
    found = family_imports(source, module, {"qse.models.qwen3_5"}, is_package)
    assert found and all(f.startswith(f"{module}:") and "imports qse.models.qwen3_5" in f for f in found), found


@pytest.mark.parametrize("source,module,is_package", [
    ("from ..models.inputs import Step", "qse.engine.fake", False),
    ("from ..models import resolve, family_module", "qse.server.fake", False),
    ("from .models.refcheck import run_refcheck", "qse.cli", False),
    ("from .models import resolve", "qse", True),  # qse/__init__.py: one level names qse itself
    ("import qse.models.qwen3_5x", "qse.engine.fake", False),  # a prefix of a family name is not the family
], ids=["neutral-module", "registry", "top-level-cli", "package-init", "name-prefix"])
def test_the_family_check_passes_family_neutral_imports(source, module, is_package):
    assert family_imports(source, module, {"qse.models.qwen3_5"}, is_package) == []
