#!/usr/bin/env python
"""Chunk groups' shape: a 64k session read from empty, one group launched ahead of the one read back, for
group sizes, layer ranges (streams) and the attention's program target for chunks, on the wall as the reader reads.

    python benchmarks/chunk_groups.py [--preset qwen3.5-0.8b] [--tokens 65536] [--out DIR]

Each variant gets a reader of its own (its graphs captured with the variant's constants) and reads twice;
the better read counts. Writes benchmarks/results/chunk_groups-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qse.engine.graphs as graphs_module  # noqa: E402
import qse_kernels.attention as attention  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402

# name: (chunks a launch, layer ranges, attention PREFILL_TARGET_PROGRAMS). Sweeps 2-5 also bounded how far
# first ranges run ahead, gave later ranges higher stream priorities and shifted the splits: none paid, and
# those knobs left the engine (commit c2e9448 is the last that has them)
VARIANTS = {
    "one_chunk": (1, 2, 132),
    "one_chunk_attn264": (1, 2, 264),
    "g8_s2_attn264": (8, 2, 264),
    "g8_s2": (8, 2, 132),
    "g8_s3": (8, 3, 132),
    "g8_s4": (8, 4, 132),
    "g8_s6": (8, 6, 132),
    "g8_s8": (8, 8, 132),
    "g4_s3": (4, 3, 132),
    "g4_s4": (4, 4, 132),
    "g16_s2": (16, 2, 132),
    "g16_s3": (16, 3, 132),
    "g16_s4": (16, 4, 132),
    "g16_s5": (16, 5, 132),
    "g16_s6": (16, 6, 132),
    "g16_s8": (16, 8, 132),
    "g32_s6": (32, 6, 132),
    "g8_s3_attn96": (8, 3, 96),
    "g8_s3_attn64": (8, 3, 64),
}


def read_once(reader: ShadowReader, ids: list[int], group: int) -> tuple[float, int]:
    """Wall seconds to read `ids` from empty, and the launches it took."""
    reader.feed("s", ids)
    t0 = time.perf_counter()
    launches = len(reader.read_all("s", lookahead=1, group=group))
    wall = time.perf_counter() - t0
    reader.close("s")
    return wall, launches


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--variants", default="", help="comma-separated names (default: all)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v] or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; expected some of {sorted(VARIANTS)}")
    device = torch.device("cuda")
    cache_dir = Path(os.environ.get("QSE_CACHE_DIR", "/tmp/qse-bench-cache"))
    engine = Engine(resolve(args.preset, device, torch.bfloat16, cache_dir), kernels="triton")
    ids = torch.randint(0, 248000, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = engine.state_bytes_per_token() * (args.tokens + 24 * args.grid) + (64 << 20)
    saved = (graphs_module.GROUP_STAGES, attention.PREFILL_TARGET_PROGRAMS)
    rows = {}
    for name in chosen:
        group, stages, programs = VARIANTS[name]
        graphs_module.GROUP_STAGES, attention.PREFILL_TARGET_PROGRAMS = stages, programs
        reader = ShadowReader(engine, grid=args.grid, pool_bytes=pool, graphs=True, chunk_group=group)
        reader.warm()  # every graph this variant takes, captured outside the timing
        reader.feed("warm", ids[: 2 * group * args.grid])
        reader.read_all("warm")
        reader.close("warm")
        walls = []
        for _ in range(2):
            wall, launches = read_once(reader, ids, group)
            walls.append(wall)
        best = min(walls)
        rows[name] = {"chunks_a_launch": group, "layer_ranges": stages, "attention_target_programs": programs,
                      "launches": launches, "read_ms": round(best * 1e3, 1),
                      "ms_per_1000_tokens": round(best * 1e6 / args.tokens, 3),
                      "reads_ms": [round(w * 1e3, 1) for w in walls]}
        print(json.dumps({name: rows[name]}), flush=True)
        del reader
        torch.cuda.empty_cache()
    graphs_module.GROUP_STAGES, attention.PREFILL_TARGET_PROGRAMS = saved
    result = {**result_header("triton"), "preset": args.preset,
              "tokens": args.tokens, "grid": args.grid, "variants": rows}
    write_result(result, args.out, "chunk_groups")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
