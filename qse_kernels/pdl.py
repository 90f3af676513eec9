"""Programmatic dependent launch (PDL, sm90+): the decode step's kernels overlap their launch and their first
weight loads with the end of the kernel before them.

A decode round at batch 1 is some 450 small launches, most of them bound by memory latency rather than by
bandwidth: each one's programs reach the device, issue their first loads and wait for them while the device
has nothing else to do. Launched with PDL (Triton's launch_pdl), a kernel's programs may be placed on the
device as soon as every program of the kernel before it has started, and the contract that keeps that
correct is the same in every kernel here, in this order:

    release(PDL)    the next launch may start placing its programs (they wait, below, before anything
                    that depends on this one)
    ...             loads of what no kernel of the step writes (weights), so that they are in flight early
    wait(PDL)       until the kernel before this one has finished and its writes are visible; by
                    induction every earlier kernel of the stream has too
    ...             everything else: activations, state, caches, and every store

A kernel that reads nothing before wait() (most of them) only hides its launch. PDL changes no arithmetic:
a kernel's bits are the same on or off (the GPU tests run on, the interpreter off: it has no grid
dependency control). A launch without PDL (a torch op, cuBLAS) waits for the whole kernel before it as
always, and the kernel after it finds wait() already satisfied.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from . import interpreting

try:  # grid dependency control (sm90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without it: PDL stays off
    gdc_launch_dependents = gdc_wait = None

# on wherever the device and Triton allow it; PREFETCH: the kernels that can also ask L2 for their weights
# before wait() do (benchmarks/round_step.py --pdl off|launch|prefetch times the three)
ON = True
PREFETCH = True


@functools.cache
def _device_allows() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def active() -> bool:
    """Whether this process's launches go out with PDL: ON, a Triton with grid dependency control, a sm90+
    device, and not the interpreter."""
    return ON and gdc_wait is not None and not interpreting() and _device_allows()


def options() -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr and, when active, Triton's launch_pdl."""
    return dict(PDL=True, launch_pdl=True) if active() else dict(PDL=False)


def prefetching() -> bool:
    """The PREFETCH constexpr of a kernel that prefetches_l2 its weights before wait()."""
    return PREFETCH and active()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next launch place its programs (the module docstring's first step)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before this one, its writes visible (the module docstring's third step)."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, PREFETCH: tl.constexpr):
    """Ask L2 for the 128-byte lines at ptrs (a tensor of addresses, one a line; pass only addresses that
    are in bounds, clamped rather than masked): no registers held, no wait, nothing that changes a bit. The
    step before wait() in which a kernel's weights start arriving."""
    if PREFETCH:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)


# elements between two prefetched addresses: a 128-byte line of 16-bit weights (32-bit ones, in tests, get
# every other line)
LINE_ELEMENTS = tl.constexpr(64)


@triton.jit
def prefetch_rows(p_rows, m_rows, p_safe, num_cols, PREFETCH: tl.constexpr, LINES: tl.constexpr):
    """prefetch_l2 of rows [R] of a matrix whose row r starts at p_rows[r] and holds num_cols elements, the
    rows where m_rows is false and the columns past num_cols asking for p_safe (any address in bounds)
    instead, LINES lines of every row a step."""
    if PREFETCH:
        o_c = tl.arange(0, LINES) * LINE_ELEMENTS
        for c0 in range(0, num_cols, LINES * LINE_ELEMENTS):
            m = m_rows[:, None] & ((c0 + o_c) < num_cols)[None, :]
            prefetch_l2(tl.where(m, p_rows[:, None] + (c0 + o_c)[None, :], p_safe), PREFETCH)


@triton.jit
def start(PDL: tl.constexpr):
    """release then wait: the start of a kernel that loads nothing early."""
    release(PDL)
    wait(PDL)


__all__ = ["ON", "active", "options", "prefetch_l2", "prefetch_rows", "prefetching", "release", "start", "wait"]
