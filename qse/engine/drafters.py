"""Drafters that need no model: prompt lookup (n-gram), the speculative decoder's cheapest proposals.

A coding agent's turn repeats its context: a file it read comes back in an edit, a tool call names the paths it
was shown. Prompt lookup proposes, after the context's last n ids, the ids that followed their latest earlier
occurrence, for the longest n (max_n down to min_n) that has one. The proposal is one-hot (the drafter has no
law): verification keeps each id with the served model's own probability of it (qse/engine/speculative.py).

The context grows by a turn's ids and shrinks by a rollback (`append`, `rollback_to`); it is kept as one numpy
array, so a search over 10^5 ids is one vectorised comparison with the last id, then a few with the ids before
it, not a Python loop.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class PromptLookup:
    """A turn's context and its n-gram proposals. k: ids proposed at most; window: the newest ids searched
    (None: all of them)."""

    def __init__(self, ids: Iterable[int] = (), k: int = 4, max_n: int = 3, min_n: int = 1,
                 window: int | None = None):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"k (ids a proposal holds at most) must be an integer >= 1, got {k!r}")
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"the n-gram lengths must satisfy 1 <= min_n <= max_n, got min_n={min_n!r}, "
                             f"max_n={max_n!r}")
        if window is not None and not (isinstance(window, int) and window > max_n):
            raise ValueError(f"window must be None or an integer above max_n ({max_n}), got {window!r}")
        self.k, self.max_n, self.min_n, self.window = k, max_n, min_n, window
        self._ids = np.zeros(1024, dtype=np.int64)
        self._len = 0
        self.append(ids)

    def __len__(self) -> int:
        return self._len

    def append(self, ids: Iterable[int]) -> None:
        new = np.fromiter(ids, dtype=np.int64)
        need = self._len + len(new)
        if need > len(self._ids):
            grown = np.zeros(max(need, 2 * len(self._ids)), dtype=np.int64)
            grown[: self._len] = self._ids[: self._len]
            self._ids = grown
        self._ids[self._len : need] = new
        self._len = need

    def rollback_to(self, length: int) -> None:
        """Keep the first `length` ids (a turn's rejected drafts, a re-rendered prompt)."""
        if not (0 <= length <= self._len):
            raise ValueError(f"cannot roll back to {length} ids: the context holds {self._len}")
        self._len = length

    def propose(self) -> list[int]:
        """Up to k ids that followed the latest earlier occurrence of the context's last n ids, for the longest
        n that has one; [] when none does."""
        start = 0 if self.window is None else max(0, self._len - self.window)
        ctx = self._ids[start : self._len]
        if len(ctx) < 2:
            return []
        # the places an n-gram equal to the context's last n ids ends, before the last id: those where the last
        # id occurs (one pass over the context), narrowed by each id before it (a few candidates each step)
        ends = np.flatnonzero(ctx[:-1] == ctx[-1])
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[ctx[hits - back] == ctx[-1 - back]]
            if len(hits):
                follow = hits[-1] + 1
                return ctx[follow : follow + self.k].tolist()
        return []


__all__ = ["PromptLookup"]
