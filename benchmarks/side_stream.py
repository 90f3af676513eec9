#!/usr/bin/env python
"""The reader's chunks beside the served model's decode rounds, on streams of their own: what each loses.

    python benchmarks/side_stream.py [--served qwen3.5-9b] [--reader qwen3.5-0.8b] [--batch 8] [--context 20000]
    python benchmarks/side_stream.py --tiny      (the embedded model for both, on CPU: the flow only)

A decode round at batch 8 reads the served weights once and is bound by memory; a reader chunk (512 rows) is
bound by compute. Run side by side on two streams, the question is how much slower the decode gets (the decode
loss) and how much of the reader's rate survives. Each is measured alone, then together: one thread launches
decode rounds back to back (each round waits for the one before it, as the conductor's launch-ahead does), the
other reads grid chunks of a long session, each on its own stream, under each priority pair (--pairs: the
decode stream's and the reader stream's CUDA priority; lower is more urgent). Rounds hold random KV rows (the
cost does not depend on the values); the reader's session is random ids.

Writes benchmarks/results/side_stream-<date>-<device>.json: per pair the decode's ms a round alone and beside
the reader, the reader's ms a chunk alone and beside the decode, and the decode loss.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import on_this_machine  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.engine.kv import KVPool, PagedKV  # noqa: E402
from qse.engine.rounds import DecodeRounds  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402

PAGE_ROWS = 512


def decode_setup(engine: Engine, batch: int, context: int, rounds_needed: int):
    cfg, device, dtype = engine.cfg, engine.device, engine.dtype
    pages_each = -(-(context + rounds_needed + 8) // PAGE_ROWS)
    pool = KVPool(batch * pages_each + 1, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads,
                  cfg.head_dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (pool.k, pool.v):
        t.normal_(0.0, 0.5, generator=gen)
    rounds = DecodeRounds(engine, pool, batch)
    rounds.warm()
    caches = []
    for _ in range(batch):
        cache = engine.new_cache(kv=PagedKV(pool))
        assert cache.kv.ensure(context + rounds_needed + 4)
        cache.length = context
        for t in cache.stacked:
            t.normal_(0.0, 0.1, generator=gen)
        caches.append(cache)
    slots = [rounds.admit(c) for c in caches]
    first = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=gen)
    return rounds, caches, slots, first


class DecodeLoop:
    """Decode rounds back to back on `stream`, each launched before the one before it is waited for."""

    def __init__(self, rounds: DecodeRounds, caches, slots, first, context: int):
        self.rounds, self.caches, self.slots, self.first, self.context = rounds, caches, slots, first, context

    def run(self, stream, num_rounds: int | None = None, stop: threading.Event | None = None) -> dict:
        for cache in self.caches:
            cache.length = self.context
        done = 0
        sync = self.rounds.engine.device.type == "cuda"
        with torch.cuda.stream(stream) if sync else _null():
            ids = self.first
            prev = None
            t0 = time.perf_counter()
            while (num_rounds is None or done < num_rounds) and not (stop is not None and stop.is_set()):
                ids = self.rounds.run(self.slots, ids).argmax(-1)
                ev = torch.cuda.Event() if sync else None
                if ev is not None:
                    ev.record(stream)
                if prev is not None:
                    prev.synchronize()
                prev = ev
                done += 1
                if done >= 400 and num_rounds is None:  # the KV room each sequence was given
                    break
            if prev is not None:
                prev.synchronize()
            wall = time.perf_counter() - t0
        return {"rounds": done, "ms_per_round": round(wall * 1e3 / max(1, done), 4)}


class ReadLoop:
    """Grid chunks of one long session on `stream`, one in flight while the next launches."""

    def __init__(self, reader: ShadowReader, tokens: int, seed: int = 0):
        rng = random.Random(seed)
        self.reader, self.ids, self.n = reader, [rng.randrange(150_000) for _ in range(tokens)], 0

    def run(self, stream, num_chunks: int, stop: threading.Event | None = None) -> dict:
        self.n += 1
        sid = f"s{self.n}"
        self.reader.feed(sid, self.ids)
        cuda = self.reader.engine.device.type == "cuda"
        done, gpu_ms, pending = 0, 0.0, None
        with torch.cuda.stream(stream) if cuda else _null():
            t0 = time.perf_counter()
            while done < num_chunks and not (stop is not None and stop.is_set()):
                nxt = self.reader.launch_step(sid)
                if pending is not None:
                    gpu_ms += self.reader.finish_step(pending).gpu_ms
                    done += 1
                if nxt is None:
                    pending = None
                    break
                pending = nxt
            if pending is not None:
                gpu_ms += self.reader.finish_step(pending).gpu_ms
                done += 1
            wall = time.perf_counter() - t0
        self.reader.close(sid)
        return {"chunks": done, "ms_per_chunk": round(wall * 1e3 / max(1, done), 4),
                "device_ms_per_chunk": round(gpu_ms / max(1, done), 4)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def together(decode: DecodeLoop, read: ReadLoop, d_stream, r_stream, num_chunks: int) -> tuple[dict, dict]:
    """The reader reads num_chunks chunks while the decode runs rounds until it is done."""
    stop = threading.Event()
    out: dict = {}

    def decoder():
        out["decode"] = decode.run(d_stream, None, stop)

    t = threading.Thread(target=decoder)
    t.start()
    time.sleep(0.05)
    out["read"] = read.run(r_stream, num_chunks)
    stop.set()
    t.join()
    return out["decode"], out["read"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--served", default="qwen3.5-9b")
    p.add_argument("--reader", default="qwen3.5-0.8b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=20000)
    p.add_argument("--chunks", type=int, default=48, help="reader chunks a measurement")
    p.add_argument("--pairs", default="0:0,-1:0,-2:0", help="decode:reader stream priorities, comma separated")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    device, dtype, cache_dir = on_this_machine()
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        args.served = args.reader = ""
        args.context, args.chunks, args.batch, args.pairs = 64, 3, 2, "0:0"
    served = Engine(resolve(args.served, device, dtype, cache_dir))
    reader_engine = Engine(resolve(args.reader, device, dtype, cache_dir))
    grid = 512 if not args.tiny else 64
    rounds, caches, slots, first = decode_setup(served, args.batch, args.context, 400)
    decode = DecodeLoop(rounds, caches, slots, first, args.context)
    per_token = reader_engine.cost(1) - reader_engine.cost(0)
    tokens = (args.chunks + 2) * grid
    reader = ShadowReader(reader_engine, grid=grid, pool_bytes=per_token * (tokens + 4 * grid) + (64 << 20),
                          graphs=device.type == "cuda")
    reader.warm()
    read = ReadLoop(reader, tokens)
    rows = []
    for pair in args.pairs.split(","):
        dp, rp = (int(x) for x in pair.split(":"))
        d_stream = torch.cuda.Stream(device, priority=dp) if device.type == "cuda" else None
        r_stream = torch.cuda.Stream(device, priority=rp) if device.type == "cuda" else None
        decode.run(d_stream, 20)  # warm, on this stream
        alone_d = decode.run(d_stream, 200)
        alone_r = read.run(r_stream, args.chunks)
        both_d, both_r = together(decode, read, d_stream, r_stream, args.chunks)
        row = {"decode_priority": dp, "reader_priority": rp, "decode_alone": alone_d, "reader_alone": alone_r,
               "decode_beside": both_d, "reader_beside": both_r,
               "decode_loss": round(both_d["ms_per_round"] / alone_d["ms_per_round"] - 1, 4),
               "reader_rate_kept": round(alone_r["ms_per_chunk"] / both_r["ms_per_chunk"], 4)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {**result_header("triton", device=None if device.type == "cuda" else "cpu"), "served": args.served,
              "reader": args.reader, "batch": args.batch, "context": args.context, "grid": grid, "rows": rows}
    write_result(result, args.out, "side_stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
