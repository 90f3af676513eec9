#!/usr/bin/env python
"""A decoding user while another user's session comes back from the disk: the decoder's gaps between tokens,
and the returning turn's time to its first token.

    python benchmarks/served_moves.py --preset qwen3.5-9b --prompt-tokens 60000 --out DIR
    python benchmarks/served_moves.py --tiny --out DIR          (the embedded model on CPU: a smoke run)

User B's session is read once (a long prompt), then parked on disk (the store's disk tier, no host tier). User
A starts a long decode on a short prompt; after A's `--arrive-after` tokens, B sends its next turn (the same
prompt and a few new ids). The store reads B's file on its loader thread while A's rounds go on, and B joins
the rounds once the file has landed: A's largest gap between two tokens should stay near a round plus the
prompt pieces B reads beside it, not the file read. Each repeat reports A's gaps (median, largest, the largest
while B was loading), B's TTFT, the tier B's state came from and its cached tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.engines import served_engine  # noqa: E402
from qse.runtime.conductor import (Conductor, GenerateRequest, ShadowOptions,  # noqa: E402
                                   served_sessions)
from qse.store import ShadowStore  # noqa: E402


async def decode_times(conductor: Conductor, req: GenerateRequest, started: asyncio.Event, after: int) -> list[float]:
    """The wall time of every id of A's turn; `started` is set once `after` ids have come."""
    times = []
    async for _ in conductor.generate(req):
        times.append(time.perf_counter())
        if len(times) == after:
            started.set()
    return times


async def returning_turn(conductor: Conductor, req: GenerateRequest, started: asyncio.Event) -> dict:
    await started.wait()
    t0 = time.perf_counter()
    first = None
    async for _ in conductor.generate(req):
        if first is None:
            first = time.perf_counter()
    return {"arrived": t0, "first": first}


async def one_repeat(conductor: Conductor, store: ShadowStore, records: list, prompt_b: list[int],
                     new_ids: list[int], prompt_a: list[int], args, no: int) -> dict:
    sid_b = f"b-{no}"
    await drain(conductor, GenerateRequest(prompt_ids=prompt_b, max_tokens=1, session_id=sid_b))
    book = conductor.serving.book
    parked = await conductor.served_exec.run(store.park, book, book.get(sid_b))  # on the served thread: its owner
    started = asyncio.Event()
    req_a = GenerateRequest(prompt_ids=prompt_a, max_tokens=args.out_tokens, session_id=f"a-{no}")
    req_b = GenerateRequest(prompt_ids=prompt_b + new_ids, max_tokens=4, session_id=sid_b)
    times, b = await asyncio.gather(decode_times(conductor, req_a, started, args.arrive_after),
                                    returning_turn(conductor, req_b, started))
    gaps = [(t1 - t0) * 1e3 for t0, t1 in zip(times, times[1:])]
    during = [(t1 - t0) * 1e3 for t0, t1 in zip(times, times[1:]) if t1 > b["arrived"] and t0 < (b["first"] or t1)]
    record = next((r for r in reversed(records) if r.session_id == sid_b), None)
    return {"repeat": no, "parked": bool(parked), "a_tokens": len(times),
            "a_gap_p50_ms": round(statistics.median(gaps), 3), "a_gap_max_ms": round(max(gaps), 3),
            "a_gap_max_while_b_starts_ms": round(max(during), 3) if during else None,
            "b_ttft_ms": round((b["first"] - b["arrived"]) * 1e3, 3) if b["first"] else None,
            "b_tier": record.cache_tier if record else None, "b_cached_tokens": record.cached_tokens if record else None,
            "b_prompt_tokens": len(req_b.prompt_ids)}


async def drain(conductor: Conductor, req: GenerateRequest) -> None:
    async for _ in conductor.generate(req):
        pass


async def run(args, disk: Path) -> dict:
    engine, policy = served_engine(args.preset, args.tiny)
    spec = "" if args.tiny else args.preset
    config = dataclasses.replace(policy, journal_dir=None, served_grid=args.grid,
                                 served_kv_gb=engine.state_bytes_per_token() * 4 * args.prompt_tokens / (1 << 30) + 0.05)
    # no host tier (a parked session is on disk only); as the server's store: files written and removed by its
    # mover thread, the parks' copies through a pinned arena
    store = ShadowStore(1 << 62, disk, host_cap_nbytes=0, background_writes=True,
                        host_arena_nbytes=engine.state_bytes_per_token() * 3 * args.prompt_tokens + 16 * engine.cost(0))
    serving = served_sessions(engine, config, residency=store)
    store.attach(serving.book)
    serving.warm()
    records: list = []  # each turn's record: where B's state came from
    conductor = Conductor(engine, None, ShadowOptions(mode="off"), config, serving=serving, on_turn=records.append)
    await conductor.start()
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 248000, (n,), generator=gen).tolist()  # noqa: E731
    await drain(conductor, GenerateRequest(prompt_ids=ids(min(args.prompt_tokens, 3 * args.grid)), max_tokens=4,
                                           session_id="warm"))  # first calls compile
    repeats = []
    for no in range(args.repeats):
        repeats.append(await one_repeat(conductor, store, records, ids(args.prompt_tokens), ids(args.new_tokens),
                                        ids(args.grid // 2), args, no))
        print(json.dumps({"preset": spec, **repeats[-1]}), flush=True)
    await conductor.stop()
    return {"preset": spec or "embedded", "model": engine.name, "kernels": engine.kernels, "mode": serving.mode,
            "grid": args.grid, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "out_tokens": args.out_tokens, "arrive_after": args.arrive_after, "repeats": repeats,
            "store": {"restores": store.counts.restores, "misses": dict(store.misses),
                      "arena_fallbacks": store.stats()["host_arena_fallbacks"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--prompt-tokens", type=int, default=60000, help="B's session before its returning turn")
    p.add_argument("--new-tokens", type=int, default=1300, help="the ids B's returning turn adds")
    p.add_argument("--out-tokens", type=int, default=512, help="A's decode")
    p.add_argument("--arrive-after", type=int, default=32, help="A's ids before B's turn arrives")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU, small shapes")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompt_tokens, args.new_tokens, args.out_tokens, args.arrive_after = 100, 20, 24, 4
        args.grid, args.repeats = 32, 2
    with tempfile.TemporaryDirectory(prefix="qse-served-moves-") as tmp:
        result = {**result_header(device=None if not args.tiny else "cpu"), **asyncio.run(run(args, Path(tmp)))}
    write_result(result, args.out, "served_moves" + ("-tiny" if args.tiny else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
