#!/usr/bin/env python
"""Why the batch-1 MoE kernels stream slower than the device copies: the 35B-A3B's T = 1 block (router, gate_up,
down, combine; the pairs path decode takes) and the decode GEMV on matrices of the same bytes and larger, each
launched eagerly on its own copy of the weights, for Nsight Compute to read the hardware counters of (DRAM
throughput, achieved occupancy, warp stall reasons). Only the launches inside the NVTX range "probe" are meant to
be profiled; the ones before it compile and warm.

    ncu --nvtx --nvtx-include "probe/" --section SpeedOfLight ... --csv --page details \
        python benchmarks/decode_ncu.py > ncu.csv                        (run_h200.sh's `ncu` step)
    python benchmarks/decode_ncu.py --summarize ncu.csv --out DIR        (the figures: DIR/ncu-<date>-<device>.json)
    python benchmarks/decode_ncu.py --tiny                               (CPU, interpreted: the flow only)

--knob MODULE.NAME=VALUE (repeatable, as round_step.py's): a qse_kernels constant set before the launches, so a
variant's counters can be read beside the defaults' (run the probe once for each).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.moe_block_bench import SHAPE_35B, SHAPE_TINY, draw_block  # noqa: E402

# the figures kept from ncu's details page, by its metric names (ncu 2025's section metrics)
KEPT = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Theoretical Occupancy",
        "Registers Per Thread", "Grid Size", "Block Size", "Dynamic Shared Memory Per Block",
        "Static Shared Memory Per Block", "Waves Per SM", "Warp Cycles Per Issued Instruction",
        "Issue Slots Busy", "Eligible Warps Per Scheduler", "Active Warps Per Scheduler", "L2 Hit Rate",
        "Mem Busy", "Max Bandwidth")


def probe(tiny: bool) -> None:
    import torch

    from qse_kernels import gemv, moe

    device = "cpu" if tiny else "cuda"
    shape = SHAPE_TINY if tiny else SHAPE_35B
    dtype = torch.float32 if tiny else torch.bfloat16
    copies = 1 if tiny else 3  # each launch below on its own copy: nothing it reads is in the L2 from before
    blocks = [draw_block(shape, device, dtype, seed) for seed in range(copies)]
    hidden, inter = shape["hidden"], shape["inter"]
    x = torch.randn(1, hidden, device=device).to(dtype)
    # GEMV matrices: the routed gate_up's bytes (top_k experts' [2I, H]), the 35B's GDN in-proj, an attention o
    rows = {"gemv_gate_up_bytes": shape["top_k"] * 2 * inter, "gemv_in_proj": 12352 if not tiny else 96,
            "gemv_o_proj": hidden}
    mats = {name: [torch.randn(n, hidden, device=device).to(dtype) for _ in range(copies)] for name, n in rows.items()}
    nvtx = torch.cuda.nvtx if not tiny else None

    def one_pass(i: int) -> None:
        for ms in mats.values():
            gemv.gemv(x, ms[i % copies])
        moe.moe_block(x, **blocks[i % copies], top_k=shape["top_k"], path="pairs")

    for i in range(2 * copies):  # compile, warm
        one_pass(i)
    if nvtx is not None:
        torch.cuda.synchronize()
        nvtx.range_push("probe")
    for i in range(copies):
        one_pass(i)
    if nvtx is not None:
        torch.cuda.synchronize()
        nvtx.range_pop()
    print(json.dumps({"probed": copies, "device": torch.cuda.get_device_name() if not tiny else "cpu"}))


def summarize(csv_path: Path) -> list[dict]:
    """ncu's --csv --page details output -> one dict a profiled launch: its kernel, grid, and the KEPT figures
    (with their units)."""
    text = csv_path.read_text()
    start = text.find('"ID"')  # ncu prints its own lines (==PROF==) and the program's before the table
    if start < 0:
        raise ValueError(f"{csv_path} holds no ncu details table (no '\"ID\"' header)")
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("ID") is None or row.get("Metric Name") is None:
            continue
        entry = launches.setdefault(row["ID"], {"kernel": row.get("Kernel Name", "")[:60]})
        if row["Metric Name"] in KEPT or row["Metric Name"].startswith(("smsp__average_warps_issue_stalled", "dram__")):
            unit = row.get("Metric Unit") or ""
            entry[row["Metric Name"] + (f" ({unit})" if unit else "")] = row.get("Metric Value")
    return list(launches.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--summarize", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--knob", action="append", default=[], metavar="MODULE.NAME=VALUE")
    args = p.parse_args()
    if args.summarize is None:
        if args.tiny:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from benchmarks.round_step import set_knob

        for knob in args.knob:
            set_knob(knob)
        probe(args.tiny)
        return
    from benchmarks.results_io import result_header, write_result

    launches = summarize(args.summarize)
    short = {"Duration (ns)": "ns", "DRAM Throughput (%)": "dram%", "Active Warps Per Scheduler (warp)": "warps",
             "Warp Cycles Per Issued Instruction (cycle)": "cpi", "Grid Size": "grid"}
    for entry in launches:  # one line a launch; the JSON keeps every figure
        print(json.dumps({"kernel": entry["kernel"][:24], **{v: entry.get(k) for k, v in short.items()}}))
    if args.out is not None:
        write_result({**result_header(), "ncu_csv": args.summarize.name, "launches": launches}, args.out,
                     args.summarize.stem)  # the CSV's name: one JSON a probe


if __name__ == "__main__":
    main()
