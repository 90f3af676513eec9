#!/usr/bin/env python
"""Qwen3.5-MoE's sparse block alone (qse_kernels/moe.py) at the 35B-A3B shapes, on one GPU: device us a call
at T = 1 .. 4096 tokens for the old block (OLD_COMMIT, this file's `--old`) and the new one, each with its own
pick by T ("old", "new") and each of its paths ("new_direct", "new_pairs", "new_grouped", "old_direct", ...),
against the byte floor. Times are CUDA events over a CUDA graph of back-to-back calls that rotate among
copies of the weights and among inputs (the copies' touched experts together several times the L2), so every
call streams its experts from memory as a decode step's 40 layers do.

    python benchmarks/moe_block_bench.py [--out DIR] [--old FILE] [--sweep [--knobs A,B]] [--tokens 1,2,4]
    python benchmarks/moe_block_bench.py --tiny --out DIR     (CPU, interpreted kernels, small shapes: the flow only)

--old FILE: the old block's source (`git show 951dda5:qse_kernels/moe.py > FILE`); without it the script
asks git itself, and where there is no git (the device machine) the old block is left out and says why.
--sweep: the schedule knobs, which change no bits (moe.ROUTER_STAGES, moe.DIRECT_DOWN_STAGES,
moe.DIRECT_GATE_UP_STAGES, moe.WIDE_TILES, moe.GROUP_WIDE_BLOCK_T, pdl.ON: programmatic dependent launch), each at a
few values on the
path it moves, with its bits against the pinned value's (a value that fails to run records its error); and the
pinned tiles (moe.ROUTER_BLOCK_K, GATE_UP_BLOCK_N, DOWN_BLOCK_N, NUM_WARPS), whose bit_equal says whether a
row's bits survive a change of them on this device. --knobs: only those (named as in _sweep).

The floor: the bytes a call must read at least, over the bandwidth of a device copy measured here (and the
H200's nominal 4.8 TB/s): the router and shared gate rows, every distinct expert the call's tokens route to
(counted from the routing itself), the shared expert, x and out. Each row also records whether every path of
both blocks gave the new block's bits (bit_equal, all_bit_equal), whether a call's rows equal the same rows
alone, and the fastest of the new block's paths (what moe.path_for should pick).
Writes benchmarks/results/moe_block_bench-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import graph_us, kernel_bench_args, wall_us  # noqa: E402

OLD_COMMIT = "951dda5"  # Kernels: the MoE block's direct path for 2 to 4 tokens only
NOMINAL_HBM_TBPS = 4.8
SHAPE_35B = dict(hidden=2048, num_experts=256, top_k=8, inter=512, inter_s=512)
SHAPE_TINY = dict(hidden=64, num_experts=8, top_k=2, inter=32, inter_s=48)
TOKENS, TOKENS_TINY = (1, 2, 4, 8, 16, 32, 64, 512, 4096), (1, 17)  # 4096: a one-shot 4k prefill's block
LAYERS_35B = 40  # blocks a 35B-A3B decode step runs
NUM_COPIES = 4  # weight copies a timing rotates among (a copy's experts: 1.6 GB; a T=1 call touches 55 MB)
CALLS = 16  # calls in a timed graph, each on its own input
TRIES = 7
SWEEP_STAGES, SWEEP_TOKENS = (2, 3, 4, 6, 8, 12), (1, 2, 4)


def draw_block(shape: dict, device: str, dtype: torch.dtype, seed: int) -> dict:
    """One layer's block weights, as moe_block takes them (tests/kernels/test_moe.py's scale)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, e, i, i_s = shape["hidden"], shape["num_experts"], shape["inter"], shape["inter_s"]

    def draw(*dims):
        return (torch.randn(*dims, generator=gen, device=device) * dims[-1] ** -0.5).to(dtype)

    return dict(router_w=draw(e, h), gate_up=draw(e, 2 * i, h), down=draw(e, h, i), shared_gate_up=draw(2 * i_s, h),
                shared_down=draw(h, i_s), shared_gate_w=draw(1, h))


def load_old(path: str | None):
    """(the old block's module, None), or (None, why not): its source from FILE or from git at OLD_COMMIT,
    imported inside qse_kernels (its relative import) from a file of its own (Triton reads a kernel's source)."""
    try:
        if path:
            source = Path(path).read_text()
        else:
            source = subprocess.run(["git", "show", f"{OLD_COMMIT}:qse_kernels/moe.py"], cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, (f"no old source ({type(exc).__name__}): pass --old FILE, from "
                      f"git show {OLD_COMMIT}:qse_kernels/moe.py")
    import qse_kernels

    file = Path(tempfile.mkdtemp(prefix="moe_old_")) / "moe_old.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location("qse_kernels._moe_old_bench", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.__package__ == qse_kernels.__name__
    return module, None


def _timer(device: str):
    """us a call of fns[i], i = 0.. (each on its own weights copy and input); on the CPU (the flow check:
    interpreted kernels, nothing to compile) the wall clock of fns[0], unwarmed."""
    if device != "cuda":
        return lambda fns: wall_us(fns[0], warm=False)
    return lambda fns: graph_us(fns, tries=TRIES)


def hbm_tbps(device: str, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """TB/s of a device copy of nbytes (read plus write), the best of reps; None on the CPU."""
    if device != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / best / 1e12


def floor_nbytes(shape: dict, num_tokens: int, distinct_experts: float, itemsize: int) -> float:
    """The bytes a call reads at least (the module docstring)."""
    h, e, i, i_s = shape["hidden"], shape["num_experts"], shape["inter"], shape["inter_s"]
    return itemsize * ((e + 1) * h + distinct_experts * 3 * i * h + 3 * i_s * h + 2 * num_tokens * h)


def count_kernels(fn) -> int | None:
    """Device kernels one eager call launches (the profiler's CUDA kernel events), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for ev in prof.events() if ev.device_type.name == "CUDA" and "memcpy" not in ev.name.lower()
               and "memset" not in ev.name.lower())


def _path_impls(module, top_k: int, prefix: str) -> dict:
    """{name: fn(x, weights)}: the module's own pick by T, then each of its paths (prefix_<path>)."""
    impls = {prefix: lambda x, w: module.moe_block(x, **w, top_k=top_k)}
    for path in getattr(module, "PATHS", ()):
        impls[f"{prefix}_{path}"] = lambda x, w, path=path: module.moe_block(x, **w, top_k=top_k, path=path)
    return impls


def old_path_for(old, num_tokens: int) -> str:
    """The path the old block picks by T (a block older than its paths has one: "grouped")."""
    if hasattr(old, "path_for"):
        return old.path_for(num_tokens)
    uses_direct = getattr(old, "uses_direct", None)
    return "direct" if uses_direct is not None and uses_direct(num_tokens) else "grouped"


def _runs_at(name: str, module, num_tokens: int) -> bool:
    """Whether impl `name` runs at num_tokens: a path for at most BLOCK_M tokens only there."""
    path = name.split("_", 1)[1] if "_" in name else None
    return path in (None, "grouped") or num_tokens <= module.BLOCK_M


def sweep_knobs(tiny: bool) -> dict:
    """The sweep's knobs: name -> (values, the path it moves, the T it is timed at)."""
    return {"ROUTER_STAGES": (SWEEP_STAGES, "new_pairs", (1,) if tiny else SWEEP_TOKENS),
             "DIRECT_DOWN_STAGES": (SWEEP_STAGES, "new_direct", (2,) if tiny else SWEEP_TOKENS),
             "DIRECT_GATE_UP_STAGES": (SWEEP_STAGES, "new_pairs", (1,) if tiny else SWEEP_TOKENS),
             "WIDE_TILES": ((1, 2, 4, 8), "new_grouped", (17,) if tiny else (512, 4096)),
             "GROUP_WIDE_BLOCK_T": ((64, 128, 256, 512), "new_grouped", (17,) if tiny else (4096,)),
             "pdl.ON": ((False, True), "new", (1,) if tiny else (1, 2, 4, 8, 32, 512)),
             "PAIRS_ROUTE_FIRST": ((False, True), "new_pairs", (1,) if tiny else (1, 2, 4, 8)),
             # the router's K in slices: other bits than 1 (bit_equal False there is expected), invariant in T
             "ROUTER_SPLIT_K": ((1, 2, 4, 8), "new", (1,) if tiny else (1, 2, 8, 512)),
             # tile shapes: pinned for batch invariance, but a row's dot products may keep their bits across them
             # (the K loop's order is the same); bit_equal says whether they do on this device
             "ROUTER_BLOCK_K": ((128, 256, 512, 1024), "new_pairs", (1,) if tiny else SWEEP_TOKENS),
             "GATE_UP_BLOCK_N": ((16, 32, 64), "new_pairs", (1,) if tiny else SWEEP_TOKENS),
             "DOWN_BLOCK_N": ((16, 32, 64), "new_pairs", (1,) if tiny else SWEEP_TOKENS),
             # the K step: fewer, larger steps a program (16 of 128 for the gate_up's 2048-wide rows) shorten a
             # decode program's chain of dependent loads if that, not the bytes, bounds it
             # (every path reads them: "new" picks pairs up to 8 tokens and the grouped path for a chunk)
             "GATE_UP_BLOCK_K": ((64, 128, 256), "new", (1,) if tiny else (1, 8, 512)),
             "DOWN_BLOCK_K": ((64, 128, 256), "new", (1,) if tiny else (1, 8, 512)),
             "NUM_WARPS": ((2, 4, 8), "new_pairs", (1,) if tiny else SWEEP_TOKENS)}


def _sweep(moe, impls, copies, gen, device, time_us, shape, calls, num_copies, tiny: bool, only=()) -> list:
    """Each schedule knob of moe (they change no bits) at a few values: the affected path timed at a few T,
    and its bits against the pinned value's (tiny: one small T each, the flow only); only: those knobs."""
    from qse_kernels import pdl

    knobs = {k: v for k, v in sweep_knobs(tiny).items() if not only or k in only}
    sweep = []
    for knob, (values, name, tokens) in knobs.items():
        owner, attr = (pdl, knob[4:]) if knob.startswith("pdl.") else (moe, knob)
        pinned = getattr(owner, attr)
        xs = {t: [torch.randn(t, shape["hidden"], generator=gen, device=device).to(torch.bfloat16)
                  for _ in range(calls)] for t in tokens}
        want = {}
        for t in tokens:
            want[t] = impls[name](xs[t][0], copies[0])
        for value in values:
            setattr(owner, attr, value)
            entry = {"knob": knob.lower(), "value": value, "pinned": value == pinned, "path": name}
            try:
                for t in tokens:
                    fns = [lambda i=i, t=t: impls[name](xs[t][i], copies[i % num_copies]) for i in range(calls)]
                    entry[f"us_t{t}"] = round(time_us(fns), 2)
                    entry[f"bit_equal_t{t}"] = bool(torch.equal(impls[name](xs[t][0], copies[0]), want[t]))
            except Exception as exc:  # a value this Triton or device cannot run (pdl.ON): say so, go on
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(entry), flush=True)
            sweep.append(entry)
        setattr(owner, attr, pinned)
        if device == "cuda":
            torch.cuda.empty_cache()
    return sweep


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--old", default=None, help=f"the old block's source (git show {OLD_COMMIT}:qse_kernels/moe.py)")
    p.add_argument("--sweep", action="store_true", help="also time the schedule knobs (stages, tiles a program)")
    p.add_argument("--tokens", default="", help="comma-separated T (default: all)")
    p.add_argument("--knobs", default="", help="with --sweep: comma-separated knobs to sweep (default: all)")
    args, device = kernel_bench_args(p, argv)
    only = tuple(k for k in args.knobs.split(",") if k)
    unknown = sorted(set(only) - set(sweep_knobs(args.tiny)))
    if unknown:  # before any timing: a device run should not spend its minutes to learn of a typo
        p.error(f"--knobs: unknown {unknown}; the sweep's knobs are {sorted(sweep_knobs(args.tiny))}")
    from qse_kernels import moe, pdl

    old, old_missing = load_old(args.old)
    if old_missing:
        print(json.dumps({"old": old_missing}), flush=True)
    shape, all_tokens = (SHAPE_TINY, TOKENS_TINY) if args.tiny else (SHAPE_35B, TOKENS)
    if args.tokens:
        all_tokens = tuple(int(t) for t in args.tokens.split(","))
    dtype = torch.bfloat16
    top_k = shape["top_k"]
    num_copies, calls = (1, 1) if args.tiny else (NUM_COPIES, CALLS)
    copies = [draw_block(shape, device, dtype, seed) for seed in range(num_copies)]
    time_us = _timer(device)
    measured_tbps = hbm_tbps(device)

    # "new": moe_block's own pick by T; new_<path>: each path; "old" and old_<path> the same of the old block
    impls = _path_impls(moe, top_k, "new")
    owner = {name: moe for name in impls}
    if old is not None:
        old_impls = _path_impls(old, top_k, "old")
        impls.update(old_impls)
        owner.update({name: old for name in old_impls})
    rows = []
    gen = torch.Generator(device=device).manual_seed(1234)
    for num_tokens in all_tokens:
        xs = [(torch.randn(num_tokens, shape["hidden"], generator=gen, device=device)).to(dtype)
              for _ in range(calls)]
        row = {"T": num_tokens, "path": moe.path_for(num_tokens)}
        if old is not None:
            row["old_path"] = old_path_for(old, num_tokens)
        distinct = [moe.moe_route(moe.router_logits(x, copies[i % num_copies]["router_w"]), top_k)[0].unique().numel()
                    for i, x in enumerate(xs)]
        row["distinct_experts"] = statistics.mean(distinct)
        nbytes = floor_nbytes(shape, num_tokens, row["distinct_experts"], dtype.itemsize)
        row["floor_nbytes"] = round(nbytes)
        row["floor_us_nominal"] = round(nbytes / (NOMINAL_HBM_TBPS * 1e6), 2)
        if measured_tbps:
            row["floor_us_measured"] = round(nbytes / (measured_tbps * 1e6), 2)
        ran = [name for name in impls if _runs_at(name, owner[name], num_tokens)]
        for name in ran:
            fns = [lambda i=i, impl=impls[name]: impl(xs[i], copies[i % num_copies]) for i in range(calls)]
            row[f"{name}_us"] = round(time_us(fns), 2)
            if measured_tbps:
                row[f"{name}_x_floor"] = round(row["floor_us_measured"] / row[f"{name}_us"], 3)
        outs = {name: impls[name](xs[0], copies[0]) for name in ran}
        new = outs["new"]
        # every path of either block against the new block's own pick: the same bits
        row["bit_equal"] = {name: bool(torch.equal(out, new)) for name, out in outs.items() if name != "new"}
        row["all_bit_equal"] = all(row["bit_equal"].values())
        new_paths = [name for name in ran if name.startswith("new_")]
        row["fastest_new_path"] = min(new_paths, key=lambda n: row[f"{n}_us"]).split("_", 1)[1]
        if "old_us" in row:
            row["new_over_old"] = round(row["new_us"] / row["old_us"], 3)
            row["saved_us"] = round(row["old_us"] - row["new_us"], 2)
        row["rows_bit_equal_alone"] = all(torch.equal(impls["new"](xs[0][t:t + 1], copies[0]), new[t:t + 1])
                                          for t in {0, num_tokens - 1})
        print(json.dumps(row), flush=True)
        rows.append(row)
        xs = outs = new = None  # (freed before the next T draws its inputs)
        if device == "cuda":
            torch.cuda.empty_cache()
    kernels = {}
    for num_tokens in sorted({all_tokens[0], all_tokens[-1]}):
        x = torch.randn(num_tokens, shape["hidden"], generator=gen, device=device).to(dtype)
        kernels[str(num_tokens)] = {name: count_kernels(lambda impl=impls[name]: impl(x, copies[0]))
                                    for name in impls if _runs_at(name, owner[name], num_tokens)}
    print(json.dumps({"kernels_a_call": kernels}), flush=True)
    sweep = (_sweep(moe, impls, copies, gen, device, time_us, shape, calls, num_copies, args.tiny, only)
             if args.sweep else [])
    # a 35B-A3B decode step at batch 1 runs LAYERS_35B blocks of T = 1
    decode = {}
    one = next((r for r in rows if r["T"] == 1), None)
    if one is not None:
        decode = {f"{name}_ms": round(LAYERS_35B * one[f"{name}_us"] / 1e3, 3) for name in impls if f"{name}_us" in one}
        if "old_us" in one:
            decode["saved_ms"] = round(LAYERS_35B * (one["old_us"] - one["new_us"]) / 1e3, 3)
    result = {**result_header("triton", device="cpu (interpreted)" if args.tiny else None),
              "shape": shape, "dtype": str(dtype), "old_commit": OLD_COMMIT, "old_missing": old_missing,
              "pairs_max_tokens": moe.PAIRS_MAX_TOKENS,
              "wide": {"min_tokens": moe.WIDE_MIN_TOKENS, "tiles": moe.WIDE_TILES,
                       "group_min_tokens": moe.GROUP_WIDE_MIN_TOKENS, "group_block_t": moe.GROUP_WIDE_BLOCK_T},
              "router_stages": moe.ROUTER_STAGES, "direct_down_stages": moe.DIRECT_DOWN_STAGES,
              "direct_gate_up_stages": moe.DIRECT_GATE_UP_STAGES, "pdl": pdl.active(),
              "weight_copies": num_copies, "calls_a_graph": calls, "tries": TRIES,
              "hbm_tbps": {"nominal": NOMINAL_HBM_TBPS, "measured": measured_tbps and round(measured_tbps, 3)},
              "rows": rows, "kernels_a_call": kernels,
              "all_bit_equal": all(r["all_bit_equal"] and r["rows_bit_equal_alone"] for r in rows),
              "fastest_new_path": {r["T"]: r["fastest_new_path"] for r in rows},
              "decode_35b_batch1_blocks": decode, "sweep": sweep}
    write_result(result, args.out, "moe_block_bench")
    names = [n for n in ("old", "new", "new_direct", "new_pairs", "new_grouped") if n in impls]
    print(f"{'T':>5}{'floor':>8}" + "".join(f"{n + ' us':>15}" for n in names) + f"{'x floor':>9}{'bits':>6}")
    for r in rows:
        cells = "".join(f"{r.get(n + '_us', ''):>15}" for n in names)
        print(f"{r['T']:>5}{r.get('floor_us_measured', r['floor_us_nominal']):>8}{cells}"
              f"{r.get('new_x_floor', ''):>9}{str(r['all_bit_equal'] and r['rows_bit_equal_alone'])[0]:>6}")
    print(json.dumps({"decode_35b_batch1_blocks": decode, "all_bit_equal": result["all_bit_equal"],
                      "fastest_new_path": result["fastest_new_path"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
