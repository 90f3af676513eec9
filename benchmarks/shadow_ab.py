#!/usr/bin/env python
"""Decode-loss A/B: the served model decoding with the reader off and on, arms alternating, paired.

Each run is a new session with one long prompt (so the reader has the whole prompt to read, inside
the turn's 2 % ration and in the idle gap before the next request), `--out-tokens` of output, and
`--gap-s` between requests. Arms alternate (off, on, off, on, ...) and are paired run by run.

    python benchmarks/shadow_ab.py --served qwen3.5-9b --reader qwen3.5-0.8b --prompt-tokens 16350 \
        --out-tokens 346 --pairs 4

Writes benchmarks/results/shadow_ab-<date>-<device>.json (or --json-out PATH). `--served embedded`
(or an empty name) is the embedded tiny model, for a run on CPU end to end:

    python benchmarks/shadow_ab.py --served embedded --reader embedded --prompt-tokens 300 --out-tokens 8 \
        --pairs 1 --grid 64 --gap-s 0.5 --json-out /tmp/shadow_ab-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qse.engine.engine import Engine  # noqa: E402
from qse.engine.sampling import SamplingParams  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.runtime.conductor import served_sessions, Conductor, GenerateRequest, ShadowOptions  # noqa: E402
from qse.policy import Policy  # noqa: E402
from qse.settings import SETTINGS  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402
from benchmarks.engines import on_this_machine  # noqa: E402
from benchmarks.results_io import versions  # noqa: E402


async def one_run(conductor: Conductor, prompt: list[int], out_tokens: int) -> dict:
    records = []
    conductor.on_turn = records.append
    t0 = time.perf_counter()
    n = 0
    stamps = []
    collections = [g["collections"] for g in gc.get_stats()]
    async for _ in conductor.generate(GenerateRequest(prompt, out_tokens, SamplingParams(), stop_ids=())):
        n += 1
        stamps.append(time.perf_counter())
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections)]
    rec = records[-1]
    ttft_s = rec.first_token_s - rec.arrival_s
    decode_s = rec.end_s - rec.first_token_s
    if n < 2 or decode_s <= 0:
        raise RuntimeError(f"the run produced {n} tokens in {decode_s:.6f} s of decode: no decode rate "
                           "(a stop token came early; --out-tokens must be at least 2)")
    return {"output_tokens": n, "ttft_s": round(ttft_s, 4), "decode_tok_s": round((n - 1) / decode_s, 3),
            "decode_device_tok_s": round(rec.decode_tokens_per_s, 3), "reader_ration_ms": round(rec.reader_ration_ms, 3),
            # the slices' wall time: device time plus the host steps around it (thread hops, plan, logs)
            "reader_ration_wall_ms": round(rec.reader_ration_wall_ms, 3), "reader_ration_slices": rec.reader_ration_slices,
            "wall_s": round(time.perf_counter() - t0, 3), **gap_stats(stamps),
            # with QSE_SPECULATE on: what the turn's verifies drafted and kept (0 and 0: plain rounds)
            "draft_tokens": rec.draft_tokens, "accepted_draft_tokens": rec.accepted_draft_tokens,
            # Python's collections by generation during the turn: a full one stalls the decode loop
            "gc_collections": collections}


def gap_stats(stamps: list[float]) -> dict:
    """Wall ms between two streamed tokens: where a slice or a host stall lands, the tail shows it."""
    gaps = sorted((b - a) * 1e3 for a, b in zip(stamps, stamps[1:]))
    if not gaps:
        return {}
    pick = lambda q: round(gaps[min(len(gaps) - 1, int(q * len(gaps)))], 3)  # noqa: E731
    return {"token_gap_ms": {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(gaps[-1], 3),
                             "sum_over_p50": round(sum(g - pick(0.5) for g in gaps if g > pick(0.5)), 3)}}


async def main_async(args) -> dict:
    device, dtype, cache = on_this_machine()
    served = Engine(resolve(model_spec(args.served), device, dtype, cache), kernels=args.ops)
    reader_engine = (served if model_spec(args.reader) == model_spec(args.served)
                     else Engine(resolve(model_spec(args.reader), device, dtype, cache), kernels=args.ops))
    per_token = reader_engine.state_bytes_per_token()
    # one reader for every run (its graphs are captured once); each run is a new session
    # the reader as `qse serve` makes it: checkpoints (and so their copies) from the settings
    reader = ShadowReader(reader_engine, grid=args.grid, pool_bytes=per_token * (2 * args.prompt_tokens + 8192),
                          **Policy.from_settings(SETTINGS).reader_checkpoints())
    reader.warm()
    gen = torch.Generator().manual_seed(0)
    config = Policy.from_settings(SETTINGS, ration=args.ration, ration_after_s=args.ration_after_s)
    config = dataclasses.replace(config, journal_dir=None, served_graphs=args.served_graphs)
    serving = served_sessions(served, config)  # each run is a new session: every turn is read cold
    serving.warm()
    arms = {"off": [], "on": []}
    for i in range(2 * args.pairs + 1):  # run 0 warms up (discarded)
        arm = "on" if i % 2 == 0 else "off"
        chunks_before = reader.stats.chunks
        conductor = Conductor(served, reader, ShadowOptions(mode=arm), config, serving=serving)
        await conductor.start()
        prompt = torch.randint(0, 248000, (args.prompt_tokens,), generator=gen).tolist()
        result = await one_run(conductor, prompt, args.out_tokens)
        await asyncio.sleep(args.gap_s)  # the idle window between requests
        await conductor.stop()  # after the idle burst in flight, so its chunks are counted
        result["reader_chunks"] = reader.stats.chunks - chunks_before
        result["ledger_ms"] = dict(conductor.status()["ledger_ms"])
        print(json.dumps({"run": i, "arm": arm, **result}), flush=True)
        if i > 0:
            arms[arm].append(result)
    pairs = [(on["decode_tok_s"] - off["decode_tok_s"]) / off["decode_tok_s"] * 100 for off, on in zip(arms["off"], arms["on"])]
    med = {a: statistics.median(r["decode_tok_s"] for r in runs) for a, runs in arms.items()}
    return {
        "served": args.served, "reader": args.reader, "served_model": served.name, "reader_model": reader_engine.name,
        "shared_engine": reader_engine is served, "ops": args.ops, "reader_mode": reader.mode, "served_mode": serving.mode, "grid": args.grid,
        "conductor": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
        "speculate": config.speculate, "prompt_tokens": args.prompt_tokens, "out_tokens": args.out_tokens, "pairs": args.pairs, "gap_s": args.gap_s,
        "decode_tok_s_median": med, "decode_loss_pct": round((med["off"] - med["on"]) / med["off"] * 100, 3),
        "paired_deltas_pct": [round(d, 3) for d in pairs],
        "ttft_s_median": {a: statistics.median(r["ttft_s"] for r in runs) for a, runs in arms.items()},
        "runs": arms,
    }


def model_spec(name: str) -> str:
    """What resolve() takes: a preset, a checkpoint dir, or "" (the embedded tiny model, also "embedded")."""
    return "" if name in ("", "embedded") else name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Decode-loss A/B: the served model with the reader off and on, paired.")
    p.add_argument("--served", default="qwen3.5-9b", help="preset, checkpoint dir, or embedded (the tiny model)")
    p.add_argument("--reader", default="qwen3.5-0.8b", help="preset, checkpoint dir, or embedded; same as --served: one engine")
    p.add_argument("--served-graphs", type=int, default=1, help="1: decode the served model under a CUDA graph where it can")
    p.add_argument("--ops", default="auto", help="kernels of both engines: naive, triton, auto (triton on cuda)")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=16350)
    p.add_argument("--out-tokens", type=int, default=346)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--gap-s", type=float, default=1.5)
    p.add_argument("--ration", type=float, default=None, help="the reader's share (default: the settings', 2 %%)")
    p.add_argument("--ration-after-s", type=float, default=None,
                   help="seconds after the first token before the ration counts (default: the settings', 5)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir (a dated file name)")
    p.add_argument("--json-out", type=Path, default=None, help="write the result to this file instead")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.out_tokens < 2:
        p.error("--out-tokens must be at least 2 (the decode rate needs two tokens)")
    if args.prompt_tokens < 1:
        p.error("--prompt-tokens must be at least 1")
    result = asyncio.run(main_async(args))
    given = list(sys.argv[1:] if argv is None else argv)
    result.update({"command": shlex.join([sys.executable, str(Path(__file__).relative_to(ROOT)), *given]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
                   "versions": versions()})
    if args.json_out is not None:
        path = args.json_out
    else:
        tag = "h200" if "H200" in result["device"] else ("cuda" if torch.cuda.is_available() else "cpu")
        path = Path(args.out) / f"shadow_ab-{dt.date.today().isoformat()}-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("decode_tok_s_median", "decode_loss_pct", "paired_deltas_pct", "ttft_s_median")}))
    print(json.dumps({"written": str(path)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
