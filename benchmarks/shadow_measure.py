#!/usr/bin/env python
"""Read rate of the shadow reader: ms per grid chunk against context, the whole-session read, the
300-token 9-letter question, fork decode, the first long prompt; with the peer in the same run.

The read is timed on the wall clock as the reader reads (`read_all`'s lookahead: the next chunk launched
while the device runs the one before); `..._one_at_a_time_...` keeps the read of one chunk at a time
(each read back before the next launch), the measure of the runs before v10.

    python benchmarks/shadow_measure.py --presets qwen3.5-0.8b,qwen3.5-2b,qwen3.5-4b \
        --tokens 65536 --long-tokens 102400 --ops graph --peer ../shared/anchors/hf_reader_baseline.py

Writes benchmarks/results/shadow_measure-<date>-<device>.json (or --out DIR). The peer runs twice in
fresh processes (its first pass is slower: warm-up) and both passes are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import is_cublas_kernel  # noqa: E402


# ops: naive (torch twins, eager), triton (qse_kernels, eager), graph (qse_kernels under CUDA graphs),
# invariant (the grid-invariant kernels, QSE_KERNELS=invariant, under CUDA graphs)
OPS = {"naive": ("naive", False), "triton": ("triton", False), "graph": ("triton", True), "invariant": ("invariant", True)}


def kernel_table(engine: Engine, reader: ShadowReader, ids: list[int], grid: int, at: int, rows: int = 0,
                 launches: dict | None = None) -> list[list]:
    """Device time per kernel family of one eager forward of `rows` rows (default: a grid chunk) at
    context `at` (torch.profiler); the number of kernels launched goes to launches[f"{rows}@{at}"]."""
    from torch.profiler import ProfilerActivity, profile

    sid = f"prof{at}"
    reader.feed(sid, ids[: at + grid])
    while reader.get(sid).committed < at and reader.read_step(sid) is not None:
        pass
    cache = reader.get(sid).cache
    chunk = engine.ids_tensor(ids[at : at + (rows or grid)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.model.forward(chunk, cache, "none")
        torch.cuda.synchronize()
    reader.close(sid)
    families: dict[str, float] = {}
    count = 0
    for ev in prof.key_averages():
        total_us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if total_us <= 0:
            continue
        count += ev.count
        name = ev.key
        low = name.lower()
        if is_cublas_kernel(name):
            name = "GEMMs (cuBLAS)"
        elif "elementwise" in low or "vectorized" in low or "reduce" in low or "index" in low or "cat" in low:
            name = "torch elementwise/index/reduce"
        families[name] = families.get(name, 0.0) + total_us / 1000
    if launches is not None:
        launches[f"{rows or grid}@{at}"] = count
    return sorted(([k, round(v, 4)] for k, v in families.items()), key=lambda kv: -kv[1])


def graph_equals_eager(engine: Engine, ids: list[int], grid: int, tokens: int) -> dict:
    """Read the same ids with and without graphs on one engine; bit-compare the states."""
    per_token = engine.state_bytes_per_token()
    pool = per_token * (tokens + 4 * grid) + (64 << 20)
    eager = ShadowReader(engine, grid=grid, pool_bytes=pool, graphs=False)
    graph = ShadowReader(engine, grid=grid, pool_bytes=pool, graphs=True)
    for reader in (eager, graph):
        reader.feed("s", ids[:tokens])
        reader.read_all("s")
    equal = eager.state_equal(eager.get("s"), graph.get("s"))
    q = ids[tokens : tokens + 300]
    same_answer = eager.ask("s", q, ["A", "B"]).distribution == graph.ask("s", q, ["A", "B"]).distribution
    graph.graphs.release()
    return {"tokens": tokens, "bit_equal": all(equal.values()), "equal": equal, "same_answer": same_answer}


def measure_preset(name: str, tokens: int, long_tokens: int, grid: int, ops: str, device: torch.device,
                   group: int = 1) -> dict:
    cache_dir = Path(os.environ.get("QSE_CACHE_DIR", "/tmp/qse-bench-cache"))
    kernels, graphs = OPS[ops]
    engine = Engine(resolve(name, device, torch.bfloat16, cache_dir), kernels=kernels)
    total = max(tokens, long_tokens)
    per_token = engine.state_bytes_per_token()
    reader = ShadowReader(engine, grid=grid, pool_bytes=per_token * (total + 32768 + 8 * grid) + (64 << 20), graphs=graphs)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 248000, (total + 1024,), generator=gen).tolist()
    # warm-up: a few chunks on a throw-away session (allocator, cuBLAS handles, Triton compile)
    reader.feed("warm", ids[: 4 * grid])
    reader.read_all("warm")
    reader.close("warm")
    if group > 1 and graphs:  # capture the group shapes a grouped read takes, outside the timing
        reader.chunk_group = group
        reader.warm()
    torch.cuda.synchronize() if device.type == "cuda" else None

    # one chunk at a time (read_step: each chunk read back before the next is launched, as the replay
    # models it), to 64k: the per-chunk device time by context and the read as it was measured before v10
    reader.feed("one", ids[:tokens])
    one_ms = []
    t0 = time.perf_counter()
    while (report := reader.read_step("one")) is not None:
        one_ms.append(report.gpu_ms)
    one_wall_s = time.perf_counter() - t0
    reader.close("one")
    # chunk groups (read_all with group: one group launched ahead of the one read back), to 64k; the bits
    # are those of one chunk at a time (tests)
    grouped = {}
    if group > 1 and graphs:
        reader.feed("g", ids[:tokens])
        t0 = time.perf_counter()
        reports = reader.read_all("g", lookahead=1, group=group)
        grouped_s = time.perf_counter() - t0
        reader.close("g")
        grouped = {f"read_{tokens}_grouped_ms_per_1000_tokens": round(grouped_s * 1e6 / tokens, 3),
                   f"read_{tokens}_grouped_wall_s": round(grouped_s, 3),
                   f"read_{tokens}_grouped_device_ms": round(sum(r.gpu_ms for r in reports), 1),
                   "group_chunks": group, "group_launches": len(reports),
                   "group_sizes": sorted({r.chunks for r in reports})}
    # the reader's own read (read_all's lookahead: the next chunk launched while the device runs the one
    # before): the headline, timed on the wall from the first launch to the chunk that reaches `tokens`
    reader.feed("s", ids[:total])
    chunk_ms, contexts = [], []
    in_flight = deque()
    t0 = time.perf_counter()
    first_40k_s = None
    read_64k_s = None

    def read_back():
        nonlocal first_40k_s, read_64k_s, ms_64k
        report = reader.finish_step(in_flight.popleft())  # noqa: F821 (the closure runs before the del below)
        chunk_ms.append(report.gpu_ms)
        contexts.append(report.context)
        if first_40k_s is None and report.position >= 40960:
            first_40k_s = time.perf_counter() - t0
        if read_64k_s is None and report.position >= tokens:
            read_64k_s = time.perf_counter() - t0
            ms_64k = sum(chunk_ms)

    ms_64k = 0.0
    while (pending := reader.launch_step("s")) is not None:
        in_flight.append(pending)
        while len(in_flight) > 1:
            read_back()
    while in_flight:
        read_back()
    whole_s = time.perf_counter() - t0
    by_context = {}
    for ctx in (0, 4096, 8192, 16384, 32768, 49152, 65024, 99840):
        near = [m for c, m in zip(contexts, chunk_ms) if abs(c - ctx) <= 2 * grid]
        if near:
            by_context[str(ctx)] = round(statistics.median(near), 3)
    row = {
        "preset": name, "ops": ops, "grid": grid, "chunks": len(chunk_ms),
        # device time of one chunk (between its marks, the chunk before still running at its launch)
        "ms_per_chunk_by_context": by_context,
        f"read_{tokens}_from_empty_ms": round(read_64k_s * 1e3, 1),
        f"read_{tokens}_ms_per_1000_tokens": round(read_64k_s * 1e6 / tokens, 3),
        f"read_{tokens}_device_ms": round(ms_64k, 1),
        f"read_{tokens}_one_at_a_time_ms_per_1000_tokens": round(sum(one_ms) * 1000 / tokens, 3),
        f"read_{tokens}_one_at_a_time_wall_s": round(one_wall_s, 3),
        f"read_{tokens}_wall_s": round(read_64k_s, 3),
        "first_40k_read_wall_s": round(first_40k_s, 3) if first_40k_s else None,
        f"read_{total}_wall_s": round(whole_s, 3),
        f"read_{total}_ms_per_1000_tokens": round(whole_s * 1e6 / (len(chunk_ms) * grid), 3),
        **grouped,
    }
    letters = [chr(65 + i) for i in range(9)]
    question = torch.randint(0, 248000, (300,), generator=gen).tolist()
    # the longest first, on the session just read; then a second session committed exactly to 32k
    # (the pool holds both: a session evicted for room would be re-read inside the question)
    for at in sorted({min(32768, total), 102400}, reverse=True):
        if at > total:
            continue
        sid = "s" if at == total else f"q{at}"
        if sid != "s":
            reader.feed(sid, ids[:at])
            reader.read_all(sid)
        results = [reader.ask(sid, question, letters) for _ in range(5)]
        assert all(r.tokens_forwarded == len(question) for r in results), "the question re-read the session"
        row[f"question_300_at_{at}_ms"] = round(statistics.median(r.gpu_ms for r in results[1:]), 3)
        summary = reader.summarize(sid, question[:20], max_tokens=33)
        row[f"fork_decode_at_{at}_ms_per_token"] = round(summary.ms_per_token, 3)
        if sid != "s":
            reader.close(sid)
    row["mode"] = reader.mode
    if kernels != "naive" and device.type == "cuda":
        reader.close("s")
        contexts = sorted({0, min(32768, (total // grid - 1) * grid)})
        launches: dict[str, int] = {}
        row["kernel_table_ms"] = {str(at): kernel_table(engine, reader, ids, grid, at, 0, launches) for at in contexts}
        row["kernel_table_question_320_ms"] = {str(at): kernel_table(engine, reader, ids, grid, at, 320, launches)
                                               for at in contexts}
        row["kernel_table_decode_ms"] = {str(at): kernel_table(engine, reader, ids, grid, at, 1, launches) for at in contexts}
        row["kernel_launches"] = launches  # kernels one forward launches (rows@context)
        if graphs:
            row["graph_equals_eager"] = graph_equals_eager(engine, ids, grid, 8192)
    del reader, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_peer(peer: Path, tokens: int, shapes: str) -> list[dict]:
    passes = []
    for i in range(2):
        env = dict(os.environ, N=str(tokens), SHAPES=shapes, OUT="")
        out = subprocess.run([sys.executable, str(peer)], capture_output=True, text=True, env=env, timeout=900)
        lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
        passes.append(json.loads(lines[-1]) if lines else {"error": out.stderr[-2000:]})
    return passes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="qwen3.5-0.8b,qwen3.5-2b,qwen3.5-4b")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--long-tokens", type=int, default=102400, help="0.8B only: read on to this length")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--group", type=int, default=16, help="chunks a launch in the grouped read (chunk groups: one chunk's "
                   "second half of the layers beside the next one's first half); 1 skips it")
    p.add_argument("--ops", default="graph", help="comma list of naive,triton,graph,invariant")
    p.add_argument("--peer", default="", help="path to hf_reader_baseline.py; run twice in this invocation")
    p.add_argument("--peer-tokens", type=int, default=32768)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        **result_header("triton", "transformers", "fla",
                        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"),
        "qse": [],
    }
    for preset in args.presets.split(","):
        for ops in args.ops.split(","):
            long_tokens = args.long_tokens if "0.8b" in preset else 0
            try:
                row = measure_preset(preset, args.tokens, long_tokens, args.grid, ops, device, args.group)
            except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the rest still run
                row = {"preset": preset, "ops": ops, "error": repr(exc)[:2000]}
            print(json.dumps(row), flush=True)
            result["qse"].append(row)
    if args.peer:
        shapes = ",".join({"qwen3.5-0.8b": "0.8B", "qwen3.5-2b": "2B", "qwen3.5-4b": "4B"}.get(s, s) for s in args.presets.split(","))
        result["peer"] = run_peer(Path(args.peer), args.peer_tokens, shapes)
        best = {}
        for shape in shapes.split(","):
            vals = [ps[shape]["ms_per_1000_tokens"] for ps in result["peer"] if shape in ps]
            if vals:
                best[shape] = min(vals)
        result["peer_best_ms_per_1000_tokens"] = best
    write_result(result, args.out, "shadow_measure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
