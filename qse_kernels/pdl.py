"""Programmatic dependent launch (PDL, sm90+): the decode step's kernels overlap their launch with the end
of the kernel before them.

A decode round at batch 1 is some 450 small launches, most of them bound by latency rather than by bandwidth:
each one's programs reach the device, issue their first loads and wait for them while the device has little
else to do. Launched with PDL (Triton's launch_pdl), a kernel's programs may be placed on the device as soon as
every program of the kernel before it has let them in. The contract that keeps that correct is one call,
start(PDL), the first statement of every kernel launched with options(), before any load or store:

    wait            until the kernel before this one has finished and its writes are visible (by induction
                    every earlier kernel of the stream has too)
    let in          the next launch may place its programs, which wait in turn (before the wait instead
                    with ORDER = RELEASE_FIRST)

PDL changes no arithmetic: a kernel's bits are the same on or off (the GPU tests run it on, the interpreter off:
it has no grid dependency control). A launch without PDL (a torch op, cuBLAS) waits for the whole kernel before
it as always, and the kernel after it finds its wait already satisfied.
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

# on wherever the device and Triton allow it. ORDER: where a kernel lets the next launch in, WAIT_FIRST (after
# its wait: at most one launch waits ahead) or RELEASE_FIRST (before it: launches cascade ahead). Wait first
# was the faster on the H200 at batch 1, release first a little slower than no PDL there; a kernel asking L2
# for its weights before its wait was slower still and was taken out (benchmarks/NOTES.md, round_step-pdl-*).
ON = True
RELEASE_FIRST, WAIT_FIRST = 1, 2
ORDER = WAIT_FIRST


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


@triton.jit
def start(PDL: tl.constexpr):
    """The first statement of every kernel launched with options(): its wait, and the next launch let in
    after it (WAIT_FIRST) or before it (RELEASE_FIRST)."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL != 0:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


__all__ = ["ON", "ORDER", "RELEASE_FIRST", "WAIT_FIRST", "active", "options", "start"]
