"""Decode speed with a grammar on the logits against the same request without one (issue 19's goal: a
json_schema answer at >= 95 % of the plain request's tokens/s on the 9B).

The served path itself: Conductor.generate (the round loop, its executor thread, the asyncio hops between
rounds, the served session's turn, CUDA graphs where it can) with the server's Sampler, temperature 0.7, the same
seed on both sides; pairs alternate plain / grammar, the order swapped every other pair. tokens/s counts from
the turn's first token to its last: every step's forward, the mask (built on the grammar's worker while the
device runs the step), its application and the draw.

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


async def run_turn(conductor, ids: list[int], params, max_tokens: int, stop_ids) -> tuple[int, float]:
    """One served turn through the round loop; (tokens after the first, seconds from the first to the last)."""
    from qse.runtime.conductor import GenerateRequest

    req = GenerateRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=params, stop_ids=tuple(stop_ids),
                          session_id="bench")
    t0 = t1 = None
    n = -1
    async for _ in conductor.generate(req):
        t1 = time.perf_counter()
        t0 = t0 if t0 is not None else t1
        n += 1
    return n, (t1 - t0) if n > 0 else 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3.5-9b", help="preset or checkpoint dir ('' for the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    import asyncio
    from dataclasses import replace

    from benchmarks.results_io import result_header, write_result
    from qse.engine.engine import Engine
    from qse.engine.grammar import Grammar, json_rule
    from qse.engine.sampling import SamplingParams
    from qse.runtime.conductor import Conductor, ShadowOptions, served_sessions
    from qse.models import pick_device, pick_dtype, resolve
    from qse.policy import Policy
    from qse.settings import SETTINGS

    device = pick_device(args.device)
    config = Policy.from_settings(SETTINGS)
    engine = Engine(resolve(args.model, device, pick_dtype(args.dtype, device), SETTINGS.cache_dir()),
                    kernels=config.kernels)
    serving = served_sessions(engine, config)
    serving.warm()
    chat = engine.chat
    prompt = chat.render([{"role": "user", "content": "List the build's parts as JSON."}], None, True, False)
    ids = chat.tokenizer.encode(prompt)
    grammar = Grammar.compile(chat.answer_grammar(prompt, "answer: " + json_rule(SCHEMA) + "\n", 0),
                              chat.tokenizer.grammar_tokenizer().warm(device), args.tokens)
    plain = SamplingParams(temperature=0.7, seed=1)
    held = replace(plain, grammar=grammar)
    sides = (("plain", plain), ("grammar", held))

    async def measure() -> list[dict]:
        conductor = Conductor(engine, None, ShadowOptions(mode="off"), config, serving=serving)
        await conductor.start()
        try:
            for _, params in sides:  # warm: graphs, the grammar's worker, the session's cached prompt
                await run_turn(conductor, ids, params, 8, chat.stop_ids)
            rows = []
            for pair in range(args.pairs):
                row = {"pair": pair}
                for name, params in (sides if pair % 2 == 0 else sides[::-1]):
                    n, seconds = await run_turn(conductor, ids, params, args.tokens, chat.stop_ids)
                    row[name] = {"tokens": n, "seconds": round(seconds, 6),
                                 "tokens_per_s": round(n / seconds, 3) if seconds > 0 else 0.0}
                rows.append(row)
                print(json.dumps(row))
            return rows
        finally:
            await conductor.stop()

    rows = asyncio.run(measure())
    plain_rate = sorted(r["plain"]["tokens_per_s"] for r in rows)[len(rows) // 2]
    held_rate = sorted(r["grammar"]["tokens_per_s"] for r in rows)[len(rows) // 2]
    result = {**result_header("llguidance", device=None if device.type == "cuda" else device.type),
              "model": engine.name, "mode": serving.mode, "path": "Conductor.generate (the round loop)",
              "max_tokens": args.tokens, "schema": SCHEMA, "launch_ahead": config.launch_ahead,
              "pairs": rows, "plain_tokens_per_s_median": plain_rate, "grammar_tokens_per_s_median": held_rate,
              "ratio": round(held_rate / plain_rate, 4), "goal_ratio": 0.95}
    print(json.dumps({k: result[k] for k in ("model", "mode", "plain_tokens_per_s_median",
                                              "grammar_tokens_per_s_median", "ratio")}))
    write_result(result, args.out, "grammar_decode")
    return result


if __name__ == "__main__":
    main()
