#!/usr/bin/env python
"""What the host link carries: host-to-device and device-to-host copies of pinned and pageable buffers, one
buffer at a time and split over several tensors, so the host tier's restore rate (a session's state is many
tensors) can be read against the link's own rate.

    python benchmarks/host_copy.py --out DIR            (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import result_header, write_result  # noqa: E402

MIB = 1 << 20


def timed_copy(dst: list[torch.Tensor], src: list[torch.Tensor], repeats: int) -> float:
    """Best wall seconds over `repeats` of copying every src into its dst (non-blocking, one sync at the end)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(total_mib: int, pieces: int, pinned: bool, direction: str, repeats: int) -> dict:
    each = total_mib * MIB // pieces
    host = [torch.empty(each, dtype=torch.uint8, pin_memory=pinned) for _ in range(pieces)]
    dev = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(pieces)]
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    seconds = timed_copy(dst, src, repeats)
    return {"direction": direction, "pinned": pinned, "total_mib": total_mib, "pieces": pieces,
            "ms": round(seconds * 1e3, 3), "gb_per_s": round(total_mib * MIB / seconds / 1e9, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="256,2048")
    p.add_argument("--pieces", default="1,64,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_copy: no CUDA device", file=sys.stderr)
        return 2
    rows = []
    for total in (int(x) for x in args.sizes_mib.split(",")):
        for pieces in (int(x) for x in args.pieces.split(",")):
            for pinned in (True, False):
                for direction in ("h2d", "d2h"):
                    if not pinned and pieces > 1:
                        continue  # pageable copies are staged by the driver: one buffer says enough
                    rows.append(measure(total, pieces, pinned, direction, args.repeats))
                    print(json.dumps(rows[-1]), flush=True)
    write_result({**result_header(), "rows": rows}, args.out, "host_copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
