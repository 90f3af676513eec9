#!/usr/bin/env python
"""What the host link carries: host-to-device and device-to-host copies of pinned and pageable buffers, one
buffer at a time and split over several tensors, so the host tier's restore rate (a session's state is many
tensors) can be read against the link's own rate; and with --stall, how long a launching thread stalls while
another thread allocates pinned memory, reads a file or copies (what a decoder sees while a session loads).

    python benchmarks/host_copy.py --out DIR            (CUDA only)
    python benchmarks/host_copy.py --stall --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
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


def launch_gaps(stop: threading.Event, size: int = 2048) -> list[float]:
    """A decoder's stand-in: launch a small matmul, wait for it, again, until `stop`; the gaps in ms."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    stamps = []
    while not stop.is_set():
        (a @ a).sum().item()
        stamps.append(time.perf_counter())
    return [(t1 - t0) * 1e3 for t0, t1 in zip(stamps, stamps[1:])]


def stall(what: str, total_mib: int, scratch: Path) -> dict:
    """The launching thread's largest gap while another thread does `what` once, against its median gap."""
    nbytes = total_mib * MIB
    if what == "pinned_reuse":  # torch's host allocator keeps a freed pinned block: the second ask reuses it
        del_me = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        del del_me
    if what.startswith("read"):
        path = scratch / "stall.bin"
        if not path.exists() or path.stat().st_size != nbytes:
            path.write_bytes(os.urandom(MIB) * total_mib)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if what == "h2d_side_stream" else None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if what == "h2d_side_stream" else None
    side = torch.cuda.Stream()

    def work() -> None:
        if what in ("pinned_alloc", "pinned_reuse"):
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        elif what == "pageable_alloc":
            torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        elif what in ("read_pinned", "read_pageable"):
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=what == "read_pinned")
            with open(scratch / "stall.bin", "rb", buffering=0) as f:
                f.readinto(memoryview(buf.numpy()))
        elif what == "h2d_side_stream":
            with torch.cuda.stream(side):
                dev.copy_(host, non_blocking=True)
            side.synchronize()

    stop = threading.Event()
    box: list = []
    decoder = threading.Thread(target=lambda: box.append(launch_gaps(stop)))
    decoder.start()
    time.sleep(0.3)  # the decoder's own rhythm first
    t0 = time.perf_counter()
    work()
    took = time.perf_counter() - t0
    time.sleep(0.1)
    stop.set()
    decoder.join()
    gaps = box[0]
    return {"stall": what, "total_mib": total_mib, "work_ms": round(took * 1e3, 3),
            "gap_p50_ms": round(statistics.median(gaps), 3), "gap_max_ms": round(max(gaps), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="256,2048")
    p.add_argument("--pieces", default="1,64,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stall", action="store_true", help="a launching thread's gaps while another moves memory")
    p.add_argument("--stall-mib", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_copy: no CUDA device", file=sys.stderr)
        return 2
    rows = []
    if args.stall:
        with tempfile.TemporaryDirectory(prefix="qse-stall-") as tmp:
            for what in ("pinned_alloc", "pinned_reuse", "pageable_alloc", "read_pageable", "read_pinned",
                         "h2d_side_stream"):
                rows.append(stall(what, args.stall_mib, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
        write_result({**result_header(), "rows": rows}, args.out, "host_stall")
        return 0
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
