"""Device time of one call, for the benchmarks: the best of a few timed batches (CUDA events), the median of
a CUDA graph's replays, a DeviceClock's ms, or the wall clock on the CPU; and the --out/--tiny options the kernel
benchmarks share."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]


# what a profiler's kernel name says when cuBLAS (or the CUTLASS kernels it picks) ran it
CUBLAS_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "cublas")


def is_cublas_kernel(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in CUBLAS_MARKERS)


def cuda_us(fn: Callable[[], object], reps: int = 20, graphed: bool = False, tries: int = 3) -> float:
    """Microseconds a call of `fn`; graphed: the `reps` calls replay as one CUDA graph, so that launch gaps
    stay out of the figure (for calls of a few microseconds)."""
    fn()
    torch.cuda.synchronize()
    run = lambda: [fn() for _ in range(reps)]  # noqa: E731
    if graphed:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                run()
        torch.cuda.synchronize()
        run = graph.replay
    best = float("inf")
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def wall_us(fn: Callable[[], object], warm: bool = True) -> float:
    """Microseconds one call of `fn` by the wall clock: the CPU flow checks (interpreted kernels); warm: one
    untimed call first (what there is to compile or allocate)."""
    if warm:
        fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def graph_us(fns: Sequence[Callable[[], object]], calls: int | None = None, tries: int = 7) -> float:
    """Microseconds a call: `calls` (default len(fns)) back-to-back calls fns[i % len(fns)], i = 0.., captured as
    one CUDA graph, the median over `tries` replays after one untimed replay. Each fn is called once first,
    outside the capture (compiled, cuBLAS's handle made, the allocator warm)."""
    calls = len(fns) if calls is None else calls
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(times)


def device_ms(step: Callable[[], object], reps: int, clock) -> float:
    """Device ms a call of step() by a DeviceClock (qse/engine/engine.py): three calls first (kernels compiled,
    graphs captured, caches warm), then `reps` timed back to back."""
    for _ in range(3):
        step()
    start = clock.mark()
    for _ in range(reps):
        step()
    return clock.ms(start, clock.mark()) / reps


def kernel_bench_args(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, str]:
    """(the parsed args, the device) of a kernel benchmark whose parser `p` holds its own options: adds --out and
    --tiny (small shapes on the CPU through Triton's interpreter, set here before the caller imports a kernel)."""
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU through Triton's interpreter")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    return args, "cpu" if args.tiny else "cuda"
