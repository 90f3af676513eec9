"""Device time of one call, for the kernel benchmarks: the best of a few timed batches (CUDA events)."""

from __future__ import annotations

from typing import Callable

import torch


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
