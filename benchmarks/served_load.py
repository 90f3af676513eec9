#!/usr/bin/env python
"""Many users at once through the conductor's round loop: aggregate and per-user output tokens/s, TTFT p50/p99.

    python benchmarks/served_load.py --preset qwen3.5-9b --users 1,8,32 --prompt-tokens 6000 --out-tokens 256
    python benchmarks/served_load.py --tiny --out DIR          (the embedded model on CPU: a smoke run)

Each level starts N turns at once, each on a session of its own with a random prompt (every prompt read cold),
greedy, no stop id, and times them on the wall from the moment they are handed to the conductor: TTFT to the
first id, the turn's end, and output tokens over the wall time of the whole level (prefill included), counted
the same way for one user and for many. The reader is off: this measures the served model's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.runtime.conductor import (Conductor, GenerateRequest, ShadowOptions,  # noqa: E402
                                   served_sessions)
from qse.policy import Policy  # noqa: E402
from qse.settings import SETTINGS  # noqa: E402


async def one_user(conductor: Conductor, prompt: list[int], out_tokens: int, sid: str, t0: float) -> dict:
    req = GenerateRequest(prompt_ids=prompt, max_tokens=out_tokens, session_id=sid)
    first = None
    n = 0
    async for _ in conductor.generate(req):
        n += 1
        if first is None:
            first = time.perf_counter() - t0
    return {"ttft_s": first, "end_s": time.perf_counter() - t0, "tokens": n}


async def level(conductor: Conductor, users: int, prompt_tokens: int, out_tokens: int, gen: torch.Generator,
                tag: str) -> dict:
    prompts = [torch.randint(0, 248000, (prompt_tokens,), generator=gen).tolist() for _ in range(users)]
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one_user(conductor, p, out_tokens, f"{tag}-{users}-{i}", t0)
                                  for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"users": users, "wall_s": round(wall, 4), "output_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "per_user_tokens_per_s": round(statistics.median(r["tokens"] / r["end_s"] for r in rows), 2),
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(round(0.99 * (len(ttft) - 1))))], 4)}


async def run(args) -> dict:
    if args.tiny:
        device, dtype, spec = torch.device("cpu"), torch.float32, ""
    else:
        device, dtype, spec = torch.device("cuda"), torch.bfloat16, args.preset
    policy = Policy.from_settings(SETTINGS)  # the benchmark is an entry point: it reads the switches once
    engine = Engine(resolve(spec, device, dtype, SETTINGS.cache_dir()), kernels=policy.kernels)
    users = [int(u) for u in args.users.split(",")]
    config = dataclasses.replace(policy, max_running=max(users), journal_dir=None, served_kv_gb=args.kv_gb)
    serving = served_sessions(engine, config)  # no store: sessions past the pool are dropped
    serving.warm()
    conductor = Conductor(engine, None, ShadowOptions(mode="off"), config, serving=serving)
    await conductor.start()
    gen = torch.Generator().manual_seed(0)
    await level(conductor, 1, min(args.prompt_tokens, 1024), 8, gen, "warm")  # first calls compile
    levels = []
    for n in users:
        levels.append(await level(conductor, n, args.prompt_tokens, args.out_tokens, gen, "load"))
        print(json.dumps({"preset": spec, **levels[-1]}), flush=True)
        for sid in [s for s in serving.book.sessions if s.startswith("load-")]:
            serving.book.close(sid)
    await conductor.stop()
    one = next((lv for lv in levels if lv["users"] == 1), None)
    for lv in levels:
        lv["x_one_user"] = round(lv["tokens_per_s"] / one["tokens_per_s"], 3) if one else None
    return {"preset": spec or "embedded", "model": engine.name, "kernels": engine.kernels, "mode": serving.mode,
            "prompt_tokens": args.prompt_tokens, "out_tokens": args.out_tokens, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--users", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--out-tokens", type=int, default=256)
    p.add_argument("--kv-gb", type=float, default=24.0, help="the served KV pool: every user's prompt fits")
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU, small shapes")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.tiny:
        args.users, args.prompt_tokens, args.out_tokens, args.kv_gb = "1,2", 40, 4, 0.05
    result = {**result_header(device=None if not args.tiny else "cpu"), **asyncio.run(run(args))}
    write_result(result, args.out, "served_load" + ("-tiny" if args.tiny else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
