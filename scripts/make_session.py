#!/usr/bin/env python
"""Build a shadow-check session file (JSONL, one turn a line) from a real coding-agent trace's shapes.

Each turn of the trace's main agent gives the prompt length (`in`), how much of the previous prompt
it shares (`lcp_prev_tokens`) and the output length (`out`). The ids are random (the random-weight
presets do not care what the text says); the shapes, the shared prefixes and the divergences are
the trace's. Usage:
    python scripts/make_session.py --trace ../shared/data/traces/weka_cc_sessions_dev.csv \
        --session trace_0022 --out session.jsonl [--max-tokens 60000] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys


def build(rows: list[dict], max_tokens: int, seed: int, vocab: int = 248000) -> list[dict]:
    rng = random.Random(seed)
    turns, prev = [], []
    for row in rows:
        n_in, n_out = int(row["in"]), min(int(row["out"]), 2048)
        if n_in > max_tokens:
            break
        shared = min(int(row["lcp_prev_tokens"] or 0), len(prev), n_in)
        prompt = prev[:shared] + [rng.randrange(vocab) for _ in range(n_in - shared)]
        output = [rng.randrange(vocab) for _ in range(n_out)]
        turns.append({"prompt_ids": prompt, "output_ids": output})
        prev = prompt + output
    return turns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", required=True)
    p.add_argument("--session", required=True, help="trace_id of the session (main agent turns)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=70000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = [r for r in csv.DictReader(open(args.trace)) if r["trace_id"] == args.session and r["agent"] == "main"]
    if not rows:
        sys.stderr.write(f"no main-agent rows for session {args.session!r} in {args.trace}\n")
        return 2
    rows.sort(key=lambda r: int(r["idx"]))
    turns = build(rows, args.max_tokens, args.seed)
    with open(args.out, "w") as f:
        for t in turns:
            f.write(json.dumps(t) + "\n")
    final = len(turns[-1]["prompt_ids"]) + len(turns[-1]["output_ids"])
    print(json.dumps({"session": args.session, "turns": len(turns), "final_ids": final, "out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
