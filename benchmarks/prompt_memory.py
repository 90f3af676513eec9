#!/usr/bin/env python
"""Peak device memory of a long prompt read from row 0: the served turn's start (every grid chunk, then the
tail, as `ServedSessions.begin` reads it) and a reader's question on a session that far behind (its backlog read
on the grid and kept, the tail and the question on a fork), at each --lengths, on a preset's random weights.

    python benchmarks/prompt_memory.py [--preset qwen3.5-9b] [--reader qwen3.5-0.8b] [--lengths 16384,65536,131072]
    python benchmarks/prompt_memory.py --preset embedded --reader embedded --lengths 1024,2048 --grid 256  (CPU)

On CUDA the measure is torch.cuda.max_memory_allocated above what the engine and its pools held before the
prompt; on the CPU the process's VmHWM above the same point (one process: the later lengths' growth is counted
above the earlier peaks, so list them shortest first). Writes prompt_memory-<date>-<device>.json.
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
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.sessions.grid import GridSessions  # noqa: E402
from qse.sessions.served import ServedSessions  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return peak_bytes(device)


def engine_for(spec: str, device: torch.device, dtype: torch.dtype, cache_dir: Path, kernels: str) -> Engine:
    return Engine(resolve("" if spec in ("", "embedded") else spec, device, dtype, cache_dir), kernels=kernels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b", help="the served model: preset, checkpoint dir, or embedded")
    p.add_argument("--reader", default="qwen3.5-0.8b", help="the reader's model (none: no question)")
    p.add_argument("--lengths", default="16384,65536,131072", help="prompt tokens, comma separated, shortest first")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    device, dtype, cache_dir = on_this_machine()
    served = engine_for(args.preset, device, dtype, cache_dir, args.kernels)
    reader_engine = None if args.reader == "none" else engine_for(args.reader, device, dtype, cache_dir, args.kernels)
    most = max(lengths) + args.grid
    rows = []
    for length in lengths:
        ids = torch.randint(0, served.cfg.vocab_size - 1000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        book = GridSessions(served, grid=args.grid, pool_bytes=most * served.state_bytes_per_token() + (64 << 20),
                            graphs=None if device.type == "cuda" else False, who="the served model")
        sessions = ServedSessions(book)
        base = reset_peak(device)
        t0 = time.perf_counter()
        turn, _ = sessions.begin("s", ids)
        served.synchronize()
        row = {"prompt_tokens": length, "served_mode": sessions.mode, "served_chunks": turn.start.chunks_read,
               "served_peak_growth_bytes": peak_bytes(device) - base, "served_wall_s": round(time.perf_counter() - t0, 3),
               "served_kv_bytes": length * served.state_bytes_per_token()}
        sessions.finish(turn)
        del sessions, book
        if reader_engine is not None:
            reader = ShadowReader(reader_engine, grid=args.grid,
                                  pool_bytes=most * reader_engine.state_bytes_per_token() + (64 << 20))
            reader.feed("q", ids)
            question = ids[:40]
            base = reset_peak(device)
            t0 = time.perf_counter()
            answer = reader.ask("q", question, ["A", "B"])
            reader_engine.synchronize()
            row.update({"reader_mode": reader.mode, "reader_read_tokens": answer.read_tokens,
                        "reader_fork_tokens": answer.tokens_forwarded,
                        "reader_peak_growth_bytes": peak_bytes(device) - base,
                        "reader_wall_s": round(time.perf_counter() - t0, 3)})
            del reader
        print(json.dumps(row), flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {**result_header("triton", device=None if device.type == "cuda" else "cpu"), "preset": args.preset,
              "reader": args.reader, "grid": args.grid, "kernels": served.kernels, "rows": rows}
    write_result(result, args.out, "prompt_memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
