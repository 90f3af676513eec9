#!/usr/bin/env python
"""Device time of one decode round (qse/engine/rounds.py) at B = 1, 8 and 32 running sequences, each at
--context tokens of its own, on a preset's random weights (default the served 9B), under the CUDA graph of
the round's bucket. Each sequence's KV rows are filled with random values instead of a prefill (decode cost
does not depend on the values); rounds are launched back to back, each taking the previous round's
on-device argmax as its tokens (no read-back between rounds), as a greedy conductor would.

    python benchmarks/round_step.py [--preset qwen3.5-9b] [--batches 1,8,32] [--context 6000] [--out DIR]
                                    [--profile 10]   (also each batch's device time per kernel, over 10 rounds)
    python benchmarks/round_step.py --preset embedded --context 40 --rounds 3      (the tiny model, on CPU)
    python benchmarks/round_step.py --preset qwen3.5-35b-a3b --arms "moe.ROUTER_SPLIT_K=1 -" --repeats 2
                                    (an A/B of kernel knobs on one engine: rows by arm, ABAB)

Writes benchmarks/results/round_step-<date>-<device>.json: per batch size the device ms a round (CUDA events
around --rounds rounds), the host's wall ms a round, and tokens/s over the round's rows.
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

from benchmarks.engines import PAGE_ROWS, on_this_machine, random_pool, random_sequences  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import is_cublas_kernel  # noqa: E402
from qse.engine.engine import DeviceClock, Engine  # noqa: E402
from qse.engine.rounds import DecodeRounds  # noqa: E402
from qse.models import resolve  # noqa: E402

WARM_ROUNDS = 3


def measure(rounds: DecodeRounds, slots: list[int], first: torch.Tensor, num_rounds: int) -> dict:
    """num_rounds rounds of `slots` launched back to back; device ms (events) and wall ms per round."""
    clock = DeviceClock(rounds.device)
    ids = first
    for _ in range(WARM_ROUNDS):
        ids = rounds.run(slots, ids).argmax(-1)
    rounds.engine.synchronize()
    t0 = time.perf_counter()
    start = clock.mark()
    for _ in range(num_rounds):
        ids = rounds.run(slots, ids).argmax(-1)
    end = clock.mark()
    device_ms = clock.ms(start, end)
    wall_ms = (time.perf_counter() - t0) * 1e3
    num_rows = len(slots)
    per_round = device_ms / num_rounds
    return {"batch": num_rows, "bucket": rounds.bucket(num_rows), "rounds": num_rounds,
            "device_ms_per_round": round(per_round, 4), "wall_ms_per_round": round(wall_ms / num_rounds, 4),
            "tokens_per_s": round(num_rows * 1e3 / per_round, 1)}


def kernel_times(rounds: DecodeRounds, slots: list[int], first: torch.Tensor, num_rounds: int) -> list[dict]:
    """Device us a round per kernel (cuBLAS's GEMMs as one family) over num_rounds rounds under torch.profiler,
    the longest first: where a round's time grows with its rows."""
    from torch.profiler import ProfilerActivity, profile

    ids = first
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_rounds):
            ids = rounds.run(slots, ids).argmax(-1)
        rounds.engine.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = "GEMMs (cuBLAS)" if is_cublas_kernel(ev.name) else ev.name
        entry = totals.setdefault(name[:90], [0.0, 0])
        entry[0] += ev.time_range.end - ev.time_range.start
        entry[1] += 1
    return [{"kernel": k, "us_per_round": round(us / num_rounds, 2), "calls_per_round": round(n / num_rounds, 2)}
            for k, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]


def decode_rows(engine: Engine, batches: list[int], context: int, num_rounds: int, graphs: str | None = None,
                profile: int = 0) -> tuple[list[dict], dict]:
    """A row a batch size (measure's, and with `profile` on CUDA its kernel_times over that many rounds), every
    sequence at `context` tokens of random KV rows and GDN state; and how the rounds ran (their graphs, buckets
    and warm-up seconds). graphs: DecodeRounds' (None: CUDA graphs where the device and kernels allow)."""
    max_running = max(batches)
    length = context + 2 * WARM_ROUNDS + num_rounds + profile + 1
    pool, gen = random_pool(engine, max_running * -(-length // PAGE_ROWS) + 1)
    rounds = DecodeRounds(engine, pool, max_running, graphs=graphs)
    t0 = time.perf_counter()
    rounds.warm()
    warm_s = time.perf_counter() - t0
    caches = random_sequences(engine, pool, max_running, context, gen)
    rows = []
    for num_rows in batches:
        for cache in caches[:num_rows]:  # every batch size starts at the same context
            cache.length = context
        slots = [rounds.admit(cache) for cache in caches[:num_rows]]
        first = torch.randint(0, engine.cfg.vocab_size, (num_rows,), device=engine.device, generator=gen)
        row = measure(rounds, slots, first, num_rounds)
        print(json.dumps(row), flush=True)
        if profile and engine.device.type == "cuda":
            row["kernels"] = kernel_times(rounds, slots, first, profile)
        rows.append(row)
        for slot in slots:
            rounds.release(slot)
    ran = {"graphs": rounds.capture, "buckets": list(rounds.buckets), "warm_s": round(warm_s, 3)}
    rounds.release_all()
    return rows, ran


def parse_pdl(mode: str) -> int:
    """A --pdl mode as qse_kernels.pdl's ORDER (0: off): off, release (RELEASE_FIRST), wait (WAIT_FIRST), or
    default (the module's pinned ORDER)."""
    from qse_kernels import pdl

    orders = {"off": 0, "release": pdl.RELEASE_FIRST, "wait": pdl.WAIT_FIRST, "default": pdl.ORDER}
    if mode not in orders:
        raise ValueError(f"--pdl modes are {', '.join(orders)}; got {mode!r}")
    return orders[mode]


def set_pdl(mode: str) -> None:
    """qse_kernels.pdl's switches for a --pdl mode (parse_pdl)."""
    from qse_kernels import pdl

    order = parse_pdl(mode)
    pdl.ON = order != 0
    pdl.ORDER = order or pdl.ORDER


def parse_knob(knob: str) -> tuple[object, str, object]:
    """MODULE.NAME=VALUE -> (qse_kernels.MODULE, NAME, VALUE), NAME an existing constant of the module; raises a
    ValueError naming a bad one."""
    import importlib

    name, _, raw = knob.partition("=")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(f"qse_kernels.{module_name}")
    except ImportError:
        module = None
    if module is None or not attr or not hasattr(module, attr) or not raw:
        raise ValueError(f"--knob takes MODULE.NAME=VALUE for an existing qse_kernels constant; got {knob!r}")
    value = {"True": True, "False": False}.get(raw)
    if value is None:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"--knob's value must be an int, a float, True or False; got {raw!r}") from None
    return module, attr, value


def set_knob(knob: str) -> tuple[str, object]:
    """MODULE.NAME=VALUE: qse_kernels.MODULE's constant NAME (which must exist) set to VALUE; returns
    (MODULE.NAME, VALUE)."""
    module, attr, value = parse_knob(knob)
    setattr(module, attr, value)
    return knob.partition("=")[0], value


def parse_arms(text: str) -> list[tuple[str, list[tuple[object, str, object]]]]:
    """--arms: [(the arm's name, its settings as parse_knob gives them)], each checked as --knob checks it, none
    set yet; none given: one arm, '-' (the knobs as they are)."""
    return [(arm, [] if arm == "-" else [parse_knob(knob) for knob in arm.split(",")])
            for arm in text.split() or ["-"]]


def arm_means(rows: list[dict]) -> dict:
    """{arm: {pdl mode: {batch: mean device ms a round over the arm's repeats}}}, in the rows' order."""
    runs: dict = {}
    for row in rows:
        runs.setdefault(row["arm"], {}).setdefault(row["pdl"], {}).setdefault(row["batch"], []).append(
            row["device_ms_per_round"])
    return {arm: {mode: {batch: round(sum(ms) / len(ms), 4) for batch, ms in batches.items()}
                  for mode, batches in modes.items()} for arm, modes in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b", help="preset, checkpoint dir, or embedded (the tiny model)")
    p.add_argument("--batches", default="1,8,32", help="running sequences a round, comma separated")
    p.add_argument("--context", type=int, default=6000, help="tokens each sequence holds when the timing starts")
    p.add_argument("--rounds", type=int, default=50, help="timed rounds a batch size")
    p.add_argument("--kernels", default="auto", help="naive, triton, invariant, auto (triton on cuda)")
    p.add_argument("--graphs", default="auto", choices=["auto", "static"],
                   help="auto: CUDA graphs where the device and kernels allow; static: the same flow uncaptured")
    p.add_argument("--profile", type=int, default=0, help="rounds a batch size under torch.profiler (0: none)")
    p.add_argument("--blas", default="default", choices=["default", "cublas", "cublaslt"],
                   help="torch's preferred BLAS library for the rounds' 2-32-row GEMMs (an experiment: which one "
                        "reads the weights nearer the one-row GEMV's rate)")
    p.add_argument("--pdl", default="default", help="programmatic dependent launch, comma separated for an A/B in "
                   "one run: default, off, release (release first), wait (wait first)")
    p.add_argument("--knob", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a qse_kernels module constant before the rounds are built (an int, float or "
                        "True/False; repeatable), e.g. attention.DECODE_MIN_SPLIT_ROWS=128")
    p.add_argument("--arms", default="", help="knob settings timed in turn on one engine (an A/B in one process): "
                   "space separated, each '-' (as --knob leaves them) or MODULE.NAME=VALUE joined by commas; each "
                   "row names its arm")
    p.add_argument("--repeats", type=int, default=1, help="times the --arms list runs, in order (ABAB...)")
    p.add_argument("--pdl-tag", default="", help="a word in the result's file name (several runs a day)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    from qse_kernels import pdl

    try:
        knobs = dict(set_knob(knob) for knob in args.knob)
        arms = parse_arms(args.arms)
    except ValueError as exc:
        p.error(str(exc))
    pdl_modes = args.pdl.split(",")
    before = pdl.ON, pdl.ORDER
    try:
        for mode in pdl_modes:
            parse_pdl(mode)
    except ValueError as exc:
        p.error(str(exc))
    device, dtype, cache_dir = on_this_machine()
    if args.blas != "default" and device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(args.blas)
    spec = "" if args.preset in ("", "embedded") else args.preset
    engine = Engine(resolve(spec, device, dtype, cache_dir), kernels=args.kernels)
    rows = []
    for _ in range(args.repeats):
        for arm, settings in arms:
            restore = [(module, attr, getattr(module, attr)) for module, attr, _ in settings]
            for module, attr, value in settings:
                setattr(module, attr, value)
            if args.arms:
                print(json.dumps({"arm": arm}), flush=True)
            for mode in pdl_modes:
                set_pdl(mode)
                mode_rows, ran = decode_rows(engine, batches, args.context, args.rounds,
                                             graphs=None if args.graphs == "auto" else "static", profile=args.profile)
                rows += [{"arm": arm, "pdl": mode, "pdl_active": pdl.active(), **row} for row in mode_rows]
            for module, attr, value in restore:
                setattr(module, attr, value)
    pdl.ON, pdl.ORDER = before
    result = {**result_header("triton", device=None if device.type == "cuda" else "cpu"),
              "preset": args.preset, "blas": str(torch.backends.cuda.preferred_blas_library()) if device.type == "cuda"
              else None, "kernels": engine.kernels, "graphs": ran["graphs"], "context": args.context,
              "page_rows": PAGE_ROWS, "knobs": knobs, "buckets": ran["buckets"], "warm_s": ran["warm_s"], "rows": rows}
    if args.arms:
        result["by_arm"] = arm_means(rows)
    write_result(result, args.out, f"round_step-{args.pdl_tag}" if args.pdl_tag else "round_step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
