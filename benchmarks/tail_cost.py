"""What a served prompt's tail costs: the forward of its 1..grid rows above the last grid line (the first
token's logits), eagerly and in its class's graph (the served path), by the wall and on the device, against a
whole chunk read the same way.

    python benchmarks/tail_cost.py [--preset qwen3.5-9b] [--context 30000] [--rows 4,64,256,511,512] [--out DIR]

Read eagerly, a tail's launches come slower than the device runs them, so a tail of a few rows cost about as
much as one of a few hundred (the stream time between the forward's first and last event is the host's pace);
the served sessions now read it in the graph of its 64-row class (ForwardGraphs.run_tail). The agents replay
(benchmarks/agents_replay.py) charges a tail a fixed cost on top of its rows' share of a chunk: this measures it.
The sequence is random (a pool of random KV rows and a random GDN state: the cost does not depend on values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import PAGE_ROWS, random_pool, random_sequences, served_engine  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Stopwatch  # noqa: E402
from qse.engine.graphs import ForwardGraphs  # noqa: E402


def time_tail(engine, cache, context: int, rows: int, reps: int, graphs=None) -> dict:
    """Median wall and device ms of reading `rows` ids on top of `context` rows (the cache set back each time):
    eagerly, or with `graphs` in the tail's class graph (ForwardGraphs.run_tail, what the served sessions run)."""
    vocab = engine.cfg.vocab_size
    walls, devices = [], []
    for i in range(reps + 1):
        ids = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(i)).tolist()
        cache.length = context
        engine.synchronize()
        t0 = time.perf_counter()
        if graphs is None:
            _, ms = engine.forward(cache, engine.host_ids(ids), "last")
        else:
            watch = Stopwatch(engine.device)
            with watch.measure():
                graphs.run_tail(cache, ids, context)  # (logits, None)
            ms = watch.gpu_ms
        engine.synchronize()
        if i:  # the first is a warm-up (what there is to compile or autotune for this shape)
            walls.append((time.perf_counter() - t0) * 1e3)
            devices.append(ms)
    return {"rows": rows, "path": "eager" if graphs is None else f"graph of {graphs.tail_rows(rows)} rows",
            "wall_ms": round(statistics.median(walls), 3),
            "device_ms": round(statistics.median(devices), 3),
            "host_share_ms": round(statistics.median(w - d for w, d in zip(walls, devices)), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=30000, help="rows the sequence holds before the tail")
    p.add_argument("--rows", default="4,64,256,511,512", help="tail lengths (512: a whole chunk, for scale)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="the embedded model on the CPU: the flow only")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    context = 600 if args.tiny else args.context
    engine, _ = served_engine(args.preset, args.tiny)
    pages = -(-(context + max(rows) + 1) // PAGE_ROWS) + 1 + -(-max(1024, max(rows)) // PAGE_ROWS)  # + the graphs' scratch
    pool, gen = random_pool(engine, pages)
    (cache,) = random_sequences(engine, pool, 1, context, gen)
    assert cache.kv.ensure(context + max(rows) + 1)
    graphs = ForwardGraphs(engine.model, pool, capture=not args.tiny, max_tokens=max(1024, max(rows)))
    points = []
    for n in rows:
        for path in (None, graphs):
            points.append(time_tail(engine, cache, context, n, 1 if args.tiny else args.reps, path))
            print(points[-1], flush=True)
    result = {**result_header(device="cpu" if args.tiny else None), "preset": args.preset, "context": context,
              "kernels": engine.kernels, "tails": points}
    write_result(result, args.out, "tail_cost" + ("-tiny" if args.tiny else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
