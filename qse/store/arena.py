"""Pinned host memory taken once and handed out in pieces: the host tier's buffers without a pinned allocation
per move.

A fresh pinned allocation of a session's size takes about a second (the driver locks and maps every page; seen
on an H200 host as the first moves of a size to the host tier, `benchmarks/NOTES.md`), and the store makes its
host copies on the served model's own thread, between two decode rounds. So the host tier's memory is pinned
once, on a thread of its own when the store first meets its device (as vLLM pins its swap space at start), and a
move takes pieces of it. Until it is ready, or when it has no room, a move's tensors go to plain (pageable)
memory, counted in `fallbacks`: their copies hold the store's thread, but nobody else's.

A piece goes back when the last tensor that views it is freed: the tensor's storage is a numpy array whose base
is the piece, so every view of it keeps the piece (and the arena) alive, whichever thread drops it last. Copies
still in flight are the caller's to wait for before it drops a piece (the store waits for a host entry's copies
before it lets one go).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

ALIGN = 4096  # a piece starts on a page: DMA-friendly and never shares a cache line with its neighbour


class _Piece:
    """A range of the arena; numpy reads the address from `__array_interface__` and keeps this object as the
    array's base, so the range is returned exactly when nothing views it any more."""

    def __init__(self, arena: "PinnedArena", start: int, size: int, nbytes: int) -> None:
        self.arena, self.start, self.size = arena, start, size
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (arena.address + start, False)}

    def __del__(self) -> None:
        self.arena._returned.append((self.start, self.size))  # deque.append is atomic: any thread, no lock


class PinnedArena:
    """`nbytes` of host memory (pinned when `pin`) allocated by `start()` on a thread of its own; `take` hands out
    pieces (None until it is ready, or when no free range is large enough)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        if nbytes < 0:
            raise ValueError(f"a pinned arena needs nbytes >= 0, got {nbytes}")
        self.nbytes = -(-int(nbytes) // ALIGN) * ALIGN
        self.pin = pin
        self.address = 0
        self.fallbacks = 0  # tensors of moves that found no room (or no arena yet): copied to pageable memory
        self.error: BaseException | None = None  # the allocation's failure: the arena stays empty, moves fall back
        self._base: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = []  # (start, size), sorted by start, never adjacent
        self._returned: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Allocate on a daemon thread (once); `take` answers None until it is done."""
        if self._thread is None and self.nbytes:
            self._thread = threading.Thread(target=self._allocate, name="qse-arena", daemon=True)
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _allocate(self) -> None:
        try:
            base = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except (RuntimeError, MemoryError) as exc:  # no pinnable memory: the host tier allocates per move
            self.error = exc
        else:
            with self._lock:
                self._base, self.address = base, base.data_ptr()
                self._free = [(0, self.nbytes)]
        finally:
            self._ready.set()

    @property
    def free_nbytes(self) -> int:
        with self._lock:
            self._merge_returned()
            return sum(size for _, size in self._free)

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` and `dtype` in the arena (its contents undefined), or None (not ready, no room)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self._base is None:
                return None
            self._merge_returned()
            for i, (start, free) in enumerate(self._free):
                if free >= size:  # first fit: the low addresses fill up, large ranges stay whole above
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (start + size, free - size)
                    break
            else:
                return None
        piece = _Piece(self, start, size, nbytes)
        flat = torch.from_numpy(np.asarray(piece))  # the storage keeps the array, the array keeps the piece
        return flat.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)

    def _merge_returned(self) -> None:
        """Returned pieces back into the sorted free list, neighbours joined (under the lock)."""
        if not self._returned:
            return
        ranges = self._free
        while self._returned:
            ranges.append(self._returned.popleft())
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for start, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


__all__ = ["ALIGN", "PinnedArena"]
