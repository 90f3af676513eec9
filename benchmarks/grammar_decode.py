"""Decode speed with a grammar on the logits against the same request without one (issue 19's goal: a
json_schema answer at >= 95 % of the plain request's tokens/s on the 9B).

The served model's own turn path (a served session's turn + decode, CUDA graphs where it can) with the server's
Sampler, temperature 0.7, the same seed on both sides; pairs alternate plain / grammar. tokens/s counts every
step of the turn: the forward, the mask (a worker thread, overlapped with the step) and the draw.

    python benchmarks/grammar_decode.py --model qwen3.5-9b --tokens 256 --pairs 5 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "required": ["title", "items"], "properties": {
    "title": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "required": ["name", "n"],
                                                                     "properties": {"name": {"type": "string"},
                                                                                    "n": {"type": "integer"}}}}}}


def run_turn(engine, serving, ids: list[int], params, max_tokens: int, device) -> tuple[int, float]:
    """One turn: prefill, then decode until a stop id or max_tokens; (tokens decoded, decode seconds)."""
    import torch

    from qse.engine.sampling import Sampler

    sampler = Sampler(params, vocab_limit=engine.chat.tokenizer.vocab_size)
    seq, logits = serving.begin("bench", ids)
    token = sampler(logits[-1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    try:
        while token not in engine.chat.stop_ids and n < max_tokens - 1:
            logits, _ = serving.decode(seq, token)
            token = sampler(logits[-1])
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        serving.finish(seq)
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3.5-9b", help="preset or checkpoint dir ('' for the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    from dataclasses import replace

    from benchmarks.results_io import result_header, write_result
    from qse.engine.engine import Engine
    from qse.engine.grammar import Grammar, json_rule
    from qse.engine.sampling import SamplingParams
    from qse.runtime.conductor import ConductorConfig, served_sessions
    from qse.models import pick_device, pick_dtype, resolve
    from qse.settings import SETTINGS

    device = pick_device(args.device)
    engine = Engine(resolve(args.model, device, pick_dtype(args.dtype, device), SETTINGS.cache_dir()))
    serving = served_sessions(engine, ConductorConfig.from_settings(SETTINGS))
    serving.warm()
    chat = engine.chat
    prompt = chat.render([{"role": "user", "content": "List the build's parts as JSON."}], None, True, False)
    ids = chat.tokenizer.encode(prompt)
    grammar = Grammar.compile(chat.answer_grammar(prompt, "answer: " + json_rule(SCHEMA) + "\n", 0),
                              chat.tokenizer.grammar_tokenizer().warm(device), args.tokens)
    plain = SamplingParams(temperature=0.7, seed=1)
    held = replace(plain, grammar=grammar)
    run_turn(engine, serving, ids, plain, 8, device)  # warm: graphs, the worker thread
    run_turn(engine, serving, ids, held, 8, device)
    rows = []
    for pair in range(args.pairs):
        row = {"pair": pair}
        for name, params in (("plain", plain), ("grammar", held)):
            n, seconds = run_turn(engine, serving, ids, params, args.tokens, device)
            row[name] = {"tokens": n, "seconds": round(seconds, 6), "tokens_per_s": round(n / seconds, 3)}
        rows.append(row)
        print(json.dumps(row))
    plain_rate = sorted(r["plain"]["tokens_per_s"] for r in rows)[len(rows) // 2]
    held_rate = sorted(r["grammar"]["tokens_per_s"] for r in rows)[len(rows) // 2]
    result = {**result_header("llguidance", device=None if device.type == "cuda" else device.type),
              "model": engine.name, "mode": serving.mode, "max_tokens": args.tokens, "schema": SCHEMA,
              "pairs": rows, "plain_tokens_per_s_median": plain_rate, "grammar_tokens_per_s_median": held_rate,
              "ratio": round(held_rate / plain_rate, 4), "goal_ratio": 0.95}
    print(json.dumps({k: result[k] for k in ("model", "mode", "plain_tokens_per_s_median",
                                              "grammar_tokens_per_s_median", "ratio")}))
    write_result(result, args.out, "grammar_decode")
    return result


if __name__ == "__main__":
    main()
