#!/usr/bin/env python
"""Served sessions on an agent's turns: time to the first token with the session cache and cold (today's
path before the cache: the whole prompt read again) in the same run, per tier the reused state came from,
and the time to bring a long session back from the host and from the disk.

    python benchmarks/served_sessions.py --session s.jsonl --presets qwen3.5-9b,qwen3.5-27b --out DIR
    python benchmarks/served_sessions.py --tiny --out DIR        (the embedded model on CPU: a smoke run)

The session file is shadow-check's format (scripts/make_session.py shapes one from the agent traces). Three
copies of the session are fed the same turns: "device" stays resident between turns, as an agent's session does
on a server with room for it (the headline: ttft_cached_p50_ms); "host" is moved to pinned host memory and
"disk" parked on disk before each of its turns, so each turn measures every tier, and the cold arm (the whole
prompt read again, today's path before the cache) runs once a turn in the same run. TTFT here is the wall time
of the turn's start on the served executor (reuse, the chunks read, the tail, the first token's logits and its
argmax), synchronised; each row also splits a cached turn's start into restore_ms, evict_ms, read_ms and
tail_ms. The restores bring the long session back from the host, from the disk on the engine's thread, and from
the disk read ahead by the store's loader thread ("disk_prefetched": `ms` is what the engine's thread holds,
`load_ms` the read beside it). The served model is warmed with a tail of every length class first (ServedSessions.warm), as `qse
serve` does on CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.runtime.conductor import served_sessions  # noqa: E402
from qse.sessions.check import load_turns  # noqa: E402
from qse.policy import Policy  # noqa: E402
from qse.settings import SETTINGS  # noqa: E402
from qse.store import ShadowStore  # noqa: E402

TIERS = ("device", "host", "disk")  # the three copies of the session, named for the tier each turn finds it in
PHASES = ("restore_ms", "evict_ms", "read_ms", "tail_ms")


def ttft_s(served, sid: str, prompt: list[int]) -> tuple[float, object]:
    served.engine.synchronize()
    t0 = time.perf_counter()
    turn, logits = served.begin(sid, prompt)
    int(torch.argmax(logits[-1]))  # the first token on the host
    elapsed = time.perf_counter() - t0
    served.finish(turn)
    return elapsed, turn.start


def top_calls(profile: cProfile.Profile, n: int = 25) -> list[dict]:
    """The n calls that held the thread longest (cumulative ms, own ms, calls): where a restore's time went."""
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:n]  # type: ignore[attr-defined]
    return [{"call": f"{Path(file).name}:{line}:{name}", "cum_ms": round(cum * 1e3, 3), "own_ms": round(own * 1e3, 3),
             "calls": calls} for (file, line, name), (_, calls, own, cum, _) in rows]


def restore_s(served, store: ShadowStore, sid: str, tier: str, profile: bool = False) -> dict:
    book = served.book
    session = book.get(sid)
    nbytes = session.nbytes
    moved = store.move_to_host(book, session) if tier == "host" else store.park(book, session)
    if not moved:
        return {"tier": tier, "moved": False}
    load_ms = None
    if tier == "disk_prefetched":  # the file read ahead on the loader thread: what the engine's thread then holds
        t0 = time.perf_counter()
        load = store.prefetch(book, sid)
        if load is not None:
            load.result()
        store.safe_point(book)
        load_ms = round((time.perf_counter() - t0) * 1e3, 3)
    served.engine.synchronize()
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    book.ensure_resident(session)
    served.engine.synchronize()
    if profiler is not None:
        profiler.disable()
    row = {"tier": tier, "moved": True, "ms": round((time.perf_counter() - t0) * 1e3, 3), "nbytes": nbytes,
           "committed": session.committed, "load_ms": load_ms,
           "prefetched": store.counts.last_restore_ms.get("prefetch_ms", 0.0) > 0}
    if profiler is not None:
        row["profile"] = top_calls(profiler)
    return row


def summary(long_rows: list[dict]) -> dict:
    """p50s over the long turns: the device copy's is the headline (an agent's session stays resident), each
    tier's beside it, and where a tier's turns went (restore, evict, read, tail)."""
    out = {"ttft_cold_p50_ms": statistics.median(r["ttft_cold_ms"] for r in long_rows)}
    for tier in TIERS:
        arm = [r[tier] for r in long_rows]
        out[f"ttft_{tier}_p50_ms"] = statistics.median(a["ttft_ms"] for a in arm)
        out[f"{tier}_found_in"] = sorted({a["tier"] for a in arm})  # where the served path found the state
        for phase in PHASES:
            out[f"{tier}_{phase}_p50"] = statistics.median(a[phase] for a in arm)
    out["ttft_cached_p50_ms"] = out["ttft_device_p50_ms"]
    out["ratio_p50"] = round(out["ttft_cached_p50_ms"] / out["ttft_cold_p50_ms"], 4)
    out["ratio_host_p50"] = round(out["ttft_host_p50_ms"] / out["ttft_cold_p50_ms"], 4)
    return out


def run_preset(spec: str, turns: list[dict], device: torch.device, dtype: torch.dtype, grid: int, disk: Path,
               min_prompt: int) -> dict:
    policy = Policy.from_settings(SETTINGS)  # the benchmark is an entry point: it reads the switches once
    engine = Engine(resolve(spec, device, dtype, SETTINGS.cache_dir()), kernels=policy.kernels)
    longest = max(len(t["prompt_ids"]) for t in turns)
    # room for the three copies of the session, a cold one and a turn's rows; the copies hold the same ids, and
    # each must find its state in its own tier, not start from another copy's (QSE_SHARE_HEADS off)
    config = dataclasses.replace(policy, served_grid=grid, share_heads=False,
                                 served_kv_gb=engine.state_bytes_per_token() * (4 * longest + 8 * grid) / (1 << 30))
    # as the server's store: files written and removed by its mover thread (without one, a restore unlinks the
    # session's file on the engine's thread), the host tier's copies in a pinned arena (room for the host copy
    # and a parked one)
    store = ShadowStore(1 << 62, disk / engine.name.replace("/", "_"), host_cap_nbytes=1 << 62, journal=True,
                        background_writes=True, host_arena_nbytes=engine.state_bytes_per_token() * 3 * longest + 16 * engine.cost(0))
    served = served_sessions(engine, config, residency=store)
    store.attach(served.book)
    t_warm = time.perf_counter()
    served.warm(tails=True)  # every tail length class compiled before the first timed turn
    ttft_s(served, "warm", turns[0]["prompt_ids"][: 2 * grid + 5])  # first calls compile and capture
    served.book.close("warm")
    warm_s = time.perf_counter() - t_warm
    rows = []
    for n, turn in enumerate(turns):
        prompt = turn["prompt_ids"]
        row = {"turn": n, "prompt_tokens": len(prompt)}
        for tier in TIERS:
            if n:  # the first turn has nothing to reuse: every copy starts from its own prefill
                session = served.book.get(tier)
                if tier == "host":
                    store.move_to_host(served.book, session)
                elif tier == "disk":
                    store.park(served.book, session)
            cached, start = ttft_s(served, tier, prompt)
            row[tier] = {"tier": start.tier, "cached_tokens": start.cached_tokens, "chunks_read": start.chunks_read,
                         "tail": start.tail_tokens, "rolled_back_to": start.rolled_back_to,
                         "ttft_ms": round(cached * 1e3, 3),
                         # where the cached turn's start went: the state back, room made, whole chunks, the tail
                         **{k: round(getattr(start, k), 3) for k in PHASES}}
        cold, _ = ttft_s(served, "cold", prompt)
        served.book.close("cold")
        row["ttft_cold_ms"] = round(cold * 1e3, 3)
        rows.append(row)
        print(json.dumps({"preset": spec, **row}), flush=True)
    restores = [restore_s(served, store, "host", tier)
                for tier in ("host", "disk", "disk_prefetched", "host", "disk", "disk_prefetched")]
    # once more each under cProfile (its ms then include the profiler's): where the engine's thread spends them
    restores += [restore_s(served, store, "host", tier, profile=True) for tier in ("disk_prefetched", "host")]
    long_rows = [r for r in rows if r["prompt_tokens"] >= min_prompt and r["turn"] > 0]
    out = {"preset": spec, "model": engine.name, "kernels": engine.kernels, "mode": served.mode, "grid": grid,
           "warm_s": round(warm_s, 3), "turns": rows, "restores": restores,
           "host_arena_fallbacks": store.stats()["host_arena_fallbacks"], "long_turns": len(long_rows),
           "min_prompt_tokens": min_prompt}
    if long_rows:
        out.update(summary(long_rows))
    del served, store, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def tiny_session(path: Path, grid: int) -> None:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 248000, (3 * grid + 7,), generator=gen).tolist()
    lines = []
    for n in range(4):
        prompt = prompt + torch.randint(0, 248000, (grid // 2 + n,), generator=gen).tolist()
        lines.append(json.dumps({"prompt_ids": prompt}))
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--session", help="JSONL turns (shadow-check's format)")
    p.add_argument("--presets", default="qwen3.5-9b,qwen3.5-27b")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=55000, help="turns at least this long make the p50s")
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU, a generated session")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qse-served-bench-") as tmp:
        if args.tiny:
            device, dtype, grid, presets = torch.device("cpu"), torch.float32, 32, [""]
            session = Path(tmp) / "tiny.jsonl"
            tiny_session(session, grid)
            min_prompt = 0
        else:
            device, dtype, grid, presets = torch.device("cuda"), torch.bfloat16, args.grid, args.presets.split(",")
            session, min_prompt = Path(args.session), args.min_prompt
        # the embedded model's tokenizer is the presets' (every Qwen3.5 shares the vocabulary): it reads the turns
        turns = load_turns(session, Engine(resolve("", torch.device("cpu"), torch.float32, SETTINGS.cache_dir())))
        results = []
        for spec in presets:
            results.append(run_preset(spec, turns, device, dtype, grid, Path(tmp) / "disk", min_prompt))
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("turns", "restores")}), flush=True)
    result = {**result_header(device=None if device.type == "cuda" else "cpu"), "session": str(args.session),
              "presets": results}
    write_result(result, args.out, "served_sessions" + ("-tiny" if args.tiny else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
