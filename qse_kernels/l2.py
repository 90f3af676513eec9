"""Weights asked into L2 ahead of the kernel that reads them (sm90+): the decode step's latency-bound stretches
fill the idle memory bus with a later projection's bytes.

At batch 1 a decode layer alternates kernels that stream weights (projections, experts) with short chains of
kernels that read almost nothing (the GDN conv, step and gated norm; the attention's norms and rows; the norm
and router before the experts). During such a chain the memory bus idles; a weight asked into L2 then is read
by its projection at L2's rate. `ahead(tensors)` launches one small kernel, placed in the stream where the chain
begins: its programs ask L2 for the tensors' bytes in PIECE-byte bulk prefetches (cp.async.bulk.prefetch.L2:
one instruction a piece, no registers, no wait, no value), and only its program 0 waits for the kernel before it
(a grid is complete once its last program is: that one wait keeps the stream's order for the kernel after it,
which waits in turn). The tensors are never written during a decode step, so asking before the wait is safe.

What lands in L2 must still be there when its reader comes: the streamed weights between (the experts, the
other projections) are read with evict_first (STREAM_EVICT_FIRST) where a kernel reads a weight once a launch, so
that they leave first. Neither changes a value: a prefetch moves no data into registers, an eviction hint only
orders L2's replacement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, pdl

# on where the device allows it; off, ahead() launches nothing (benchmarks/round_step.py --arms "l2.AHEAD=False -")
AHEAD = True
PIECE = 16 * 1024  # bytes a prefetch instruction asks for
PIECES_A_PROGRAM = 32  # one warp a program, a piece a lane: 512 KB a program
MAX_TENSORS = 4
# weights read once a launch (the GEMV's and skinny GEMM's rows, the pairs path's experts) leave L2 first where
# something is asked ahead
STREAM_EVICT_FIRST = True
# a MoE layer asks for the first NEXT_BYTES of the next layer's input projection while its router runs (the
# experts it streams after leave first): the model's plan (Qwen35MoeModel._ahead_plan) reads it once
NEXT_BYTES = 16 << 20


def stream_policy() -> str:
    """The eviction_policy a kernel streaming weights read once passes to tl.load ("" for the default)."""
    return "evict_first" if STREAM_EVICT_FIRST and active() else ""


def askable(t: torch.Tensor) -> bool:
    """Whether ahead() takes t: one contiguous range of bytes, 16-byte aligned, a multiple of 16 bytes long."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.numel() * t.element_size()) % 16 == 0


def active() -> bool:
    """Whether ahead() launches: AHEAD on, not the interpreter (it has no bulk prefetch), a sm90+ device."""
    return AHEAD and not interpreting() and pdl._device_allows()


@triton.jit
def _bulk_prefetch(base, offset, size):
    """cp.async.bulk.prefetch.L2 of [base + offset, + size) lane by lane (size 0: nothing)."""
    addr = (base.to(tl.pointer_type(tl.int8)) + offset).to(tl.int64)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tensor_pieces(base, nbytes, first, i_piece, PIECE: tl.constexpr):
    """The lanes' pieces i_piece [L] of the pieces numbered first.. of one tensor of nbytes bytes."""
    j = i_piece - first
    start = j.to(tl.int64) * PIECE
    size = tl.where((j >= 0) & (start < nbytes), tl.minimum(nbytes - start, PIECE), 0).to(tl.int32)
    _bulk_prefetch(base, tl.where(size > 0, start, 0), size)


@triton.jit
def _ahead_kernel(p0, n0, p1, n1, p2, n2, p3, n3, NUM: tl.constexpr, PIECE: tl.constexpr, LANES: tl.constexpr,
                  PDL: tl.constexpr):
    """Lane l of program i asks for piece i * LANES + l of the tensors' pieces laid end to end (each tensor's
    from its own first byte: NUM of them, their byte counts n0..n3 multiples of 16); program 0 then waits for
    the kernel before this one and lets the next in."""
    i_piece = tl.program_id(0) * LANES + tl.arange(0, LANES)
    c1 = tl.cdiv(n0, PIECE)
    _tensor_pieces(p0, n0, 0, i_piece, PIECE)
    if NUM > 1:
        c2 = c1 + tl.cdiv(n1, PIECE)
        _tensor_pieces(p1, n1, c1, i_piece, PIECE)
        if NUM > 2:
            c3 = c2 + tl.cdiv(n2, PIECE)
            _tensor_pieces(p2, n2, c2, i_piece, PIECE)
            if NUM > 3:
                _tensor_pieces(p3, n3, c3, i_piece, PIECE)
    if tl.program_id(0) == 0:
        pdl.start(PDL)


def ahead(*tensors: torch.Tensor) -> None:
    """Ask L2 for the bytes of up to MAX_TENSORS askable device tensors (weights no kernel of the step writes),
    from a launch placed here in the stream (the module docstring). Checked everywhere; launched where active()."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"ahead() takes at most {MAX_TENSORS} tensors a launch; got {len(tensors)}")
    args, pieces = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not askable(t):
            raise ValueError(f"ahead() needs contiguous, 16-byte aligned tensors of a multiple of 16 bytes; got "
                             f"strides {t.stride()}, address {t.data_ptr()}, {nbytes} bytes")
        args += [t, nbytes]
        pieces += triton.cdiv(nbytes, PIECE)
    if not active() or not tensors:
        return
    args += [tensors[0], 0] * (MAX_TENSORS - len(tensors))
    _ahead_kernel[(triton.cdiv(pieces, PIECES_A_PROGRAM),)](*args, NUM=len(tensors), PIECE=PIECE,
                                                            LANES=PIECES_A_PROGRAM, num_warps=1, **pdl.options())


__all__ = ["AHEAD", "NEXT_BYTES", "STREAM_EVICT_FIRST", "active", "ahead", "askable", "stream_policy"]
