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

With ORDER = WAIT_FIRST the release moves after the wait (the next launch comes in only once this one
runs). A kernel that reads nothing before wait() (most of them) only hides its launch. PDL changes no arithmetic:
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

# on wherever the device and Triton allow it. ORDER: where a kernel lets the next launch in, RELEASE_FIRST
# (before its wait: launches cascade ahead) or WAIT_FIRST (after it: at most one launch waits ahead).
# PREFETCH: the kernel families that ask L2 for their weights before their wait ("gemv", "moe"), and EVICT the
# L2 priority those lines get. benchmarks/round_step.py --pdl times the choices against each other.
ON = True
RELEASE_FIRST, WAIT_FIRST = 1, 2
ORDER = WAIT_FIRST
PREFETCH = frozenset({"moe"})
EVICT_NORMAL, EVICT_LAST = 1, 2
EVICT = EVICT_NORMAL


@functools.cache
def _device_allows() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def active() -> bool:
    """Whether this process's launches go out with PDL: ON, a Triton with grid dependency control, a sm90+
    device, and not the interpreter."""
    return ON and gdc_wait is not None and not interpreting() and _device_allows()


def options() -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr (0: off, else ORDER) and, when active,
    Triton's launch_pdl."""
    return dict(PDL=ORDER, launch_pdl=True) if active() else dict(PDL=0)


def prefetching(family: str) -> int:
    """The PREFETCH constexpr of a kernel of `family` that can prefetch_l2 its weights before wait(): 0 (no),
    else the lines' EVICT priority."""
    return EVICT if active() and family in PREFETCH else 0


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next launch place its programs (the module docstring's first step; with WAIT_FIRST, wait()
    does it instead)."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before this one, its writes visible (the module docstring's third step)."""
    if PDL != 0:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PREFETCH: tl.constexpr):
    """Ask L2 for the 128-byte lines at ptrs (a tensor of addresses, one a line; pass only addresses that
    are in bounds, clamped rather than masked), at priority PREFETCH (EVICT_NORMAL, EVICT_LAST; 0: nothing):
    no registers held, no wait, nothing that changes a bit. The step before wait() in which a kernel's weights
    start arriving."""
    if PREFETCH == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif PREFETCH == 2:
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
    if PREFETCH != 0:
        o_c = tl.arange(0, LINES) * LINE_ELEMENTS
        for c0 in range(0, num_cols, LINES * LINE_ELEMENTS):
            m = m_rows[:, None] & ((c0 + o_c) < num_cols)[None, :]
            prefetch_l2(tl.where(m, p_rows[:, None] + (c0 + o_c)[None, :], p_safe), PREFETCH)


@triton.jit
def start(PDL: tl.constexpr):
    """release then wait: the start of a kernel that loads nothing early."""
    release(PDL)
    wait(PDL)


__all__ = ["EVICT", "ON", "ORDER", "PREFETCH", "active", "options", "prefetch_l2", "prefetch_rows", "prefetching", "release", "start", "wait"]
