#!/usr/bin/env python
"""What verifying k drafted tokens costs against one decode step: the number that says whether drafting pays.

    python benchmarks/spec_measure.py [--preset qwen3.5-9b] [--context 8000] [--ks 1,2,3,4,5,6,7,8] [--out DIR]
    python benchmarks/spec_measure.py --tiny --out DIR      (the embedded model on CPU: the flow only)

A verify reads the row's token and its k drafts in one forward of k + 1 rows, logits at every row; a decode step
reads one row. Both run as CUDA graphs on one KV pool (qse/engine/graphs.py: one graph per rows-and-logits
shape) over a sequence of --context tokens (random KV rows and GDN state: the cost does not depend on the
values), on the working state, back to back, timed by device events. Per k: the verify's ms, its ratio to one
decode step, and what a step would bring at the published acceptance lengths (tokens a step, the bonus token
included: 1.87, 2.50, 3.06 at k = 1, 2, 3 on a 27B-class hybrid; SGLang reports ~3.1-3.3 at k = 3 on
Qwen3.5-397B and Qwen3-Next), as tokens per decode step's time, the drafter's own cost left out (the MTP
head is one decoder layer: about 1/32 of the 9B a token). Batch 1 only: the rounds do not verify yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import on_this_machine  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import DeviceClock, Engine  # noqa: E402
from qse.engine.graphs import ForwardGraphs  # noqa: E402
from qse.engine.kv import KVPool, PagedKV  # noqa: E402
from qse.models import resolve  # noqa: E402

PAGE_ROWS = 512
PUBLISHED_ACCEPTANCE = {1: 1.87, 2: 2.50, 3: 3.06}  # tokens a step, bonus included (the sources)


def time_rows(graphs: ForwardGraphs, cache, rows: int, logits: str, context: int, reps: int, clock: DeviceClock,
              gen: torch.Generator) -> float:
    """Device ms a replay of the `rows`-row forward at position `context` (its graph captured first)."""
    entry = graphs._prepare(rows, logits)
    ids = torch.randint(0, 150_000, (rows,), generator=gen).tolist()
    graphs._stage(ids, context)
    graphs._load(cache)
    for _ in range(3):
        graphs._replay(entry)
    start = clock.mark()
    t0 = time.perf_counter()
    for _ in range(reps):
        graphs._replay(entry)
    end = clock.mark()
    ms = clock.ms(start, end)
    return ms / reps if graphs.capture else (time.perf_counter() - t0) * 1e3 / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="draft lengths k: verifies of k + 1 rows")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU (graphs' CPU rehearsal)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if any(k < 1 for k in ks):
        p.error(f"--ks: draft lengths must be >= 1, got {args.ks}")
    device, dtype, cache_dir = on_this_machine()
    spec = args.preset
    if args.tiny:
        device, dtype, spec = torch.device("cpu"), torch.float32, ""
        args.context, args.reps, ks = 100, 2, [k for k in ks if k <= 3]
    engine = Engine(resolve(spec, device, dtype, cache_dir))
    cfg = engine.cfg
    longest = max(ks) + 1
    pages = -(-(args.context + longest + 8) // PAGE_ROWS)
    scratch = -(-1024 // PAGE_ROWS)
    pool = KVPool(pages + scratch + 2, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                  dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (pool.k, pool.v):
        t.normal_(0.0, 0.5, generator=gen)
    cache = engine.new_cache(kv=PagedKV(pool))
    assert cache.kv.ensure(args.context + longest)
    cache.length = args.context
    for t in cache.stacked:
        t.normal_(0.0, 0.1, generator=gen)
    graphs = ForwardGraphs(engine.model, pool)
    clock = DeviceClock(device)
    host_gen = torch.Generator().manual_seed(1)
    # every figure derived from the recorded (rounded) ones, so a result reads the same when recomputed
    decode_ms = round(time_rows(graphs, cache, 1, "last", args.context, args.reps, clock, host_gen), 4)
    rows = []
    for k in ks:
        verify_ms = round(time_rows(graphs, cache, k + 1, "all", args.context, args.reps, clock, host_gen), 4)
        ratio = round(verify_ms / decode_ms, 4)
        row = {"k": k, "rows": k + 1, "verify_ms": verify_ms, "x_decode_step": ratio}
        if k in PUBLISHED_ACCEPTANCE:  # tokens a step over the step's cost in decode steps, drafts not counted
            row["published_tokens_per_step"] = PUBLISHED_ACCEPTANCE[k]
            row["projected_x_plain"] = round(PUBLISHED_ACCEPTANCE[k] / ratio, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    by_k = {r["k"]: r for r in rows}
    goals = {"verify_4_rows_le_1.15x_step": (by_k[3]["x_decode_step"] <= 1.15) if 3 in by_k else None,
             "projected_ge_1.8x_at_2.5": (2.5 / by_k[3]["x_decode_step"] >= 1.8) if 3 in by_k else None}
    result = {**result_header("triton", device=None if device.type == "cuda" else "cpu"), "preset": spec or "embedded",
              "kernels": engine.kernels, "graphs": graphs.capture, "context": args.context, "reps": args.reps,
              "decode_step_ms": decode_ms, "rows": rows, "goals": goals}
    write_result(result, args.out, "spec_measure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
