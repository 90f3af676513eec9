#!/usr/bin/env python
"""Where a graph-replayed chunk's time goes between its kernels: the kernels' own time against the span
they cover and the reader's stopwatch, the gaps between kernels by what precedes and follows them, the
stopwatch window phase by phase (working-state load, replay, store), and what programmatic dependent
launch (PDL) saves a boundary in a graph of small Triton kernels.

    python benchmarks/graph_gaps.py [--preset qwen3.5-0.8b] [--out DIR]

Writes benchmarks/results/graph_gaps-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import cuda_us, is_cublas_kernel  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402

def kind(name: str) -> str:
    low = name.lower()
    if is_cublas_kernel(name):
        return "cublas"
    if low.startswith("_") and "kernel" in low:
        return "triton"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "torch"


def replay_profile(reader: ShadowReader, sid: str) -> dict:
    """One read_step under torch.profiler: its kernels in time order, their sum, span and gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        report = reader.read_step(sid)
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    busy = sum(end - start for start, end, _ in kernels)
    by_name: dict[str, list[float]] = {}
    for start, end, name in kernels:
        by_name.setdefault(name, []).append(end - start)
    # each kernel's share of the chunk, the largest first: where a faster chunk would have to come from
    table = sorted(((sum(v), len(v), n) for n, v in by_name.items()), reverse=True)
    gaps: dict[str, list[float]] = {}
    for (s0, e0, n0), (s1, _, n1) in zip(kernels, kernels[1:]):
        gaps.setdefault(f"{kind(n0)}->{kind(n1)}", []).append(max(0.0, s1 - e0))
    return {
        "context": report.context, "stopwatch_ms": round(report.gpu_ms, 4), "kernels": len(kernels),
        "kernel_sum_ms": round(busy / 1000, 4), "span_ms": round((kernels[-1][1] - kernels[0][0]) / 1000, 4),
        "gaps_us": {k: {"n": len(v), "sum": round(sum(v), 1), "median": round(statistics.median(v), 2),
                        "max": round(max(v), 1)} for k, v in sorted(gaps.items())},
        "kernels_ms": [{"kernel": n[:120], "kind": kind(n), "calls": c, "ms": round(t / 1000, 4)}
                       for t, c, n in table[:25]],
        "kinds_ms": {k: round(sum(t for t, _, n in table if kind(n) == k) / 1000, 4)
                     for k in sorted({kind(n) for _, _, n in table})},
    }


def window_phases(reader: ShadowReader, sid: str, reps: int = 8) -> dict:
    """The stopwatch window of a graph chunk, phase by phase: device ms (events) and host ms (wall). (It
    times the steps ForwardGraphs.run_chunks keeps inside, so it calls them one by one.)"""
    graphs, session = reader.graphs, reader.get(sid)
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        start = session.committed
        ids = session.ids[start : start + reader.grid]
        entry = graphs._prepare(len(ids), "none")
        session.kv.ensure(start + len(ids))
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        host = []
        t = time.perf_counter()
        marks[0].record()
        graphs._load(session.cache)
        host.append(time.perf_counter() - t)
        marks[1].record()
        graphs._stage(ids, start)
        graphs._replay(entry)
        host.append(time.perf_counter() - t)
        marks[2].record()
        graphs._store(session.cache)
        host.append(time.perf_counter() - t)
        marks[3].record()
        torch.cuda.synchronize()
        session.cache.length = start + len(ids)
        session.committed = start + len(ids)
        for i, phase in enumerate(("load", "run", "store")):
            out.setdefault(f"{phase}_device_ms", []).append(marks[i].elapsed_time(marks[i + 1]))
            out.setdefault(f"{phase}_host_done_ms", []).append(host[i] * 1e3)
    return {k: round(statistics.median(v), 4) for k, v in out.items()}


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m) + 1.0, mask=m)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_chain(kernels: int = 300, numel: int = 1 << 16) -> dict:
    """A chain of small dependent Triton kernels (an even count) replayed as one graph, without and with PDL."""
    a = torch.zeros(numel, device="cuda")
    b = torch.zeros(numel, device="cuda")
    block = 1024
    grid = (triton.cdiv(numel, block),)
    out = {}
    for pdl in (False, True):
        def chain(pdl=pdl):
            x, y = a, b
            for _ in range(kernels):
                _step_kernel[grid](x, y, numel, PDL=pdl, BLOCK=block, launch_pdl=pdl)
                x, y = y, x

        try:
            us = cuda_us(chain, reps=1, graphed=True) / kernels  # the chain replayed as one graph
            a.zero_()
            chain()  # an even count of steps, each y = x + 1, ends in a
            torch.cuda.synchronize()
            out["pdl" if pdl else "plain"] = {"us_per_kernel": round(us, 3), "result_ok": bool(torch.all(a == kernels))}
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: PDL needs sm_90 and a recent driver
            out["pdl" if pdl else "plain"] = {"error": repr(exc)[:300]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cache_dir = Path(os.environ.get("QSE_CACHE_DIR", "/tmp/qse-bench-cache"))
    engine = Engine(resolve(args.preset, device, torch.bfloat16, cache_dir), kernels="triton")
    tokens = 40 * args.grid
    reader = ShadowReader(engine, grid=args.grid, pool_bytes=engine.state_bytes_per_token() * 2 * tokens + (64 << 20),
                          graphs=True)
    ids = torch.randint(0, 248000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    reader.feed("s", ids)
    for _ in range(3):  # capture and warm
        reader.read_step("s")
    row = {"preset": args.preset, "grid": args.grid}
    row["replay_at_start"] = replay_profile(reader, "s")
    row["window_phases"] = window_phases(reader, "s")
    while reader.get("s").committed < 32 * args.grid:
        reader.read_step("s")
    row["replay_at_16k"] = replay_profile(reader, "s")
    row["pdl_chain_300"] = pdl_chain()
    print(json.dumps(row), flush=True)
    result = {
        **result_header("triton"),
        "row": row,
    }
    write_result(result, args.out, "graph_gaps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
