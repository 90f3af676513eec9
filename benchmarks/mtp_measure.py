#!/usr/bin/env python
"""What the MTP head's drafts cost against one decode step: the drafter's side of whether speculation pays.

    python benchmarks/mtp_measure.py [--preset qwen3.5-9b] [--context 8000] [--ks 1,2,3] [--reps 50]
    python benchmarks/mtp_measure.py --tiny --out DIR      (a tiny model with an MTP head on CPU: the flow only)

The head (qse/models/qwen3_5/mtp.py, the model's mtp_head()) holds --context rows of its own KV in pages of a pool
(random values: the cost does not depend on them). Per draft length k, timed by device events, one sequence:
- draft_ms: head.draft(k), as the drafter runs it today (eager: one launch after another);
- draft_graph_ms: the same draft replayed from a CUDA graph captured at that position (the device's own cost,
  what a graphed drafter would pay; CUDA only);
- extend_ms, extend_graph_ms: the head's forward of the rows a verify hands back, 1 (no draft kept) to k + 1 (all
  kept), eager and replayed from a graph;
- x_decode_round: (draft + the extend of k + 1 rows) over one decode round of the served model at batch 1
  (DecodeRounds.run, graphed where the device allows), eager and graphed.
The head's weights are recorded beside: one decoder layer and fc, and the model's output head, read once a
draft (at the 9B the head's 248,320 x 4,096 matrix is most of a draft step's bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import PAGE_ROWS, on_this_machine, random_pool, random_sequences  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import device_ms  # noqa: E402
from qse.engine.engine import DeviceClock, Engine  # noqa: E402
from qse.engine.kv import PagedKV  # noqa: E402
from qse.engine.rounds import DecodeRounds  # noqa: E402
from qse.models import ResolvedModel, resolve  # noqa: E402

def graphed(step):
    """step captured as a CUDA graph: its replay (warmed on a side stream first, as DecodeRounds captures)."""
    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            step()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


def decode_round_ms(engine: Engine, context: int, reps: int, clock: DeviceClock) -> float:
    """One decode round of one sequence at `context` rows (random KV and GDN state)."""
    pool, gen = random_pool(engine, -(-(context + 3 * reps + 16) // PAGE_ROWS) + 2)
    rounds = DecodeRounds(engine, pool, max_running=1, buckets=(1,))
    (cache,) = random_sequences(engine, pool, 1, context, gen)
    slot = rounds.admit(cache)
    tokens = torch.tensor([7], device=engine.device)
    ms = device_ms(lambda: rounds.run([slot], tokens), reps, clock)
    rounds.release(slot)
    rounds.release_all()
    return ms


def measure(model, ks: list[int], context: int, reps: int, clock: DeviceClock, decode_ms: float) -> list[dict]:
    head, cfg, device = model.mtp_head(), model.cfg, model.device
    width = max(ks) + 1
    # the head's rows in pages of a pool of its own (read and written through the page table on the device: a
    # graph captured at a position holds no host copy)
    pool, gen = random_pool(model, -(-(context + width + 1) // PAGE_ROWS), 1, seed=1)
    cache = head.new_cache(kv=PagedKV(pool))
    assert cache.kv.ensure(context + width)
    cache.length = context
    start_hidden = torch.randn(1, cfg.hidden_size, generator=gen, device=device).to(model.dtype)
    cache.last_hidden = start_hidden
    ids = torch.randint(0, cfg.vocab_size, (width,), generator=gen, device=device)
    hidden = torch.randn(width, cfg.hidden_size, generator=gen, device=device).to(model.dtype)

    def extend(n: int) -> None:
        head.forward(ids[:n], hidden[:n], cache)
        cache.rollback_to(context)
        cache.last_hidden = start_hidden

    drafts = {}
    for k in ks:
        draft_ms = round(device_ms(lambda: head.draft(cache, k), reps, clock), 4)
        graph_ms, graph_ids_equal = None, None
        if device.type == "cuda":
            out = {}
            replay = graphed(lambda: out.__setitem__("ids", head.draft(cache, k)))
            graph_ms = round(device_ms(replay, reps, clock), 4)
            graph_ids_equal = out["ids"].tolist() == head.draft(cache, k).tolist()  # the replay's drafts are eager's
        drafts[k] = (draft_ms, graph_ms, graph_ids_equal)
    extend_ms = {n: round(device_ms(lambda n=n: extend(n), reps, clock), 4) for n in range(1, width + 1)}
    extend_graph_ms = {n: (round(device_ms(graphed(lambda n=n: extend(n)), reps, clock), 4)
                           if device.type == "cuda" else None) for n in range(1, width + 1)}
    rows = []
    for k in ks:
        draft_ms, graph_ms, graph_ids_equal = drafts[k]
        row = {"k": k, "draft_ms": draft_ms, "draft_graph_ms": graph_ms, "graph_ids_equal": graph_ids_equal,
               "extend_ms": {str(n): extend_ms[n] for n in range(1, k + 2)},
               "extend_graph_ms": {str(n): extend_graph_ms[n] for n in range(1, k + 2)}, "decode_round_ms": decode_ms,
               "x_decode_round": round((draft_ms + extend_ms[k + 1]) / decode_ms, 4)}
        if graph_ms is not None:
            row["x_decode_round_graphed"] = round((graph_ms + extend_graph_ms[k + 1]) / decode_ms, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def head_nbytes(model) -> dict:
    layer = sum(t.numel() * t.element_size() for n, t in model.w.items() if n.startswith("mtp."))
    layer += sum(lin.nbytes_per_use for n, lin in model.lin.items() if n.startswith("mtp."))
    out = model.lm_head.weight
    return {"mtp_layer_and_fc_nbytes": layer, "output_head_nbytes": out.numel() * out.element_size()}


def tiny_engine() -> Engine:
    """A tiny Qwen3.5 with an MTP head, fp32 on the CPU (the embedded default has none)."""
    from qse.models.qwen3_5 import Qwen35Model, parse_config
    from qse.models.qwen3_5.presets import random_weights, tiny_mtp_config_dict

    cfg = parse_config(tiny_mtp_config_dict())
    model = Qwen35Model(cfg, random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    return Engine(ResolvedModel(model, None, "tiny-mtp", "random", model.family, "tiny-mtp-seed-0"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--ks", default="1,2,3", help="draft lengths k")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="a tiny model with an MTP head on CPU (the flow only)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if any(k < 1 for k in ks):
        p.error(f"--ks must be >= 1, got {args.ks!r}")
    device, dtype, cache_dir = on_this_machine()
    if args.tiny:
        args.context, args.reps = 100, 2
        engine = tiny_engine()
    else:
        engine = Engine(resolve(args.preset, device, dtype, cache_dir))
    clock = DeviceClock(engine.device)
    decode_ms = round(decode_round_ms(engine, args.context, args.reps, clock), 4)
    rows = measure(engine.model, ks, args.context, args.reps, clock, decode_ms)
    result = {**result_header("triton", device=None if engine.device.type == "cuda" else "cpu"),
              "preset": "tiny-mtp" if args.tiny else args.preset, "kernels": engine.kernels,
              "context": args.context, "reps": args.reps, **head_nbytes(engine.model), "rows": rows}
    write_result(result, args.out, "mtp_measure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
