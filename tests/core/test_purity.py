"""qse/core is pure policy: no torch, no asyncio, no clock; it and qse/replay import without torch."""

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "qse" / "core"
FORBIDDEN = {"torch", "asyncio", "time", "threading", "datetime", "random"}


def test_core_modules_import_nothing_impure():
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_core_and_replay_import_with_torch_blocked():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import qse.core, qse.replay, qse.replay.cli, qse.replay.simulator, qse.replay.traces, qse.replay.chart\n"
        "assert 'asyncio' not in sys.modules, 'asyncio was imported'\n"
        "from qse.replay import simulate, UsageRecord\n"
        "r = simulate([UsageRecord(session='s', arrival_s=0, first_token_s=1, end_s=2, prompt_tokens=2048,\n"
        "              shared_prefix_tokens=0, output_tokens=36)]).report()\n"
        "assert r['num_turns'] == 1\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
