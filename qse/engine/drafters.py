"""Drafters: what proposes the ids a verify checks. Prompt lookup (n-gram) needs no model; the MTP drafter runs the
checkpoint's MTP head on the served model's hidden states.

Every drafter states what it needs of the served model (`requires()`: hidden size, vocabulary, the forward's taps,
tensors by name), and `check_drafter` refuses a drafter that does not fit, naming it and the mismatch, when the
two are put together (at load): a 0.8B MTP head under a 9B model would read 4096-wide states with 1024-wide weights.

A coding agent's turn repeats its context: a file it read comes back in an edit, a tool call names the paths it
was shown. Prompt lookup proposes, after the context's last n ids, the ids that followed their latest earlier
occurrence, for the longest n (max_n down to min_n) that has one. The proposal is one-hot (the drafter has no
law): verification keeps each id with the served model's own probability of it (qse/engine/speculative.py).

The context grows by a turn's ids and shrinks by a rollback (`append`, `rollback_to`); it is kept as one numpy
array, so a search over 10^5 ids is one vectorised comparison with the last id, then a few with the ids before
it, not a Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class DrafterNeeds:
    """What a drafter needs of the served model; None or () where it needs nothing."""

    hidden_size: int | None = None  # the width of the hidden states it reads
    vocab_size: int | None = None  # the vocabulary its ids index (its head's rows)
    taps: tuple[str, ...] = ()  # what the served model's forward hands it besides logits (the model's TAPS)
    tensors: tuple[str, ...] = ()  # the served model's weights it reads, by canonical name (a shared head)


class Drafter(Protocol):
    """Proposes up to k ids after a turn's context; the verify keeps a prefix of them (qse/engine/speculative.py)."""

    name: str

    def requires(self) -> DrafterNeeds: ...

    def propose(self) -> list[int]: ...

    def rollback_to(self, length: int) -> None: ...


class DrafterMismatch(ValueError):
    """A drafter that does not fit the served model."""


def check_drafter(drafter: Drafter, model: Any) -> None:
    """Raise DrafterMismatch, naming the drafter and what differs, unless `model` (cfg, TAPS, its weights by name)
    gives the drafter all it requires."""
    needs, cfg = drafter.requires(), model.cfg
    where = f"drafter {drafter.name!r} does not fit the served model"
    if needs.hidden_size is not None and needs.hidden_size != cfg.hidden_size:
        raise DrafterMismatch(f"{where}: it reads hidden states {needs.hidden_size} wide, the model's are "
                              f"{cfg.hidden_size}; use the drafter built for this checkpoint")
    if needs.vocab_size is not None and needs.vocab_size != cfg.vocab_size:
        raise DrafterMismatch(f"{where}: its vocabulary has {needs.vocab_size} ids, the model's {cfg.vocab_size}; "
                              "use the drafter built for this checkpoint")
    taps = tuple(getattr(model, "TAPS", ()))
    missing = [tap for tap in needs.taps if tap not in taps]
    if missing:
        raise DrafterMismatch(f"{where}: it needs the forward's tap {missing[0]!r}, the model hands out {taps}")
    names = set(getattr(model, "w", {})) | set(getattr(model, "lin", {}))
    missing = [name for name in needs.tensors if name not in names]
    if missing:
        raise DrafterMismatch(f"{where}: it reads the model's tensor {missing[0]!r}, which the model does not hold")


class PromptLookup:
    """A turn's context and its n-gram proposals. k: ids proposed at most; window: the newest ids searched
    (None: all of them)."""

    name = "prompt-lookup"

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

    def requires(self) -> DrafterNeeds:
        return DrafterNeeds()  # ids only

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
        for _, hits in ngram_matches(ctx, ctx, ends, min(self.max_n, len(ctx) - 1), self.min_n):
            if len(hits):
                follow = hits[-1] + 1
                return ctx[follow : follow + self.k].tolist()
        return []


def ngram_matches(corpus: np.ndarray, tail: np.ndarray, ends: np.ndarray, longest: int, shortest: int):
    """For n from `longest` down to `shortest`: (n, the places in `corpus` where an occurrence of tail's last n
    ids ends), narrowed from `ends` (where tail's last id occurs) by each id before it: a few candidates a
    step, never a Python loop over the corpus."""
    for n in range(longest, shortest - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            hits = hits[corpus[hits - back] == tail[-1 - back]]
        yield n, hits


class MTPDrafter:
    """k greedy drafts a verify from a model's MTP head (its `mtp_head()`: qse/models/qwen3_5/mtp.py), on one
    turn's MTP state. The head pairs the served model's final hidden state at a position with the id after it;
    the caller feeds it those pairs (`extend`) and proposes from the last one:

        prompt x_0 .. x_{n-1} read, x_n sampled        extend([x_1 .. x_n], hidden of rows 0 .. n-1)
        propose() -> d_0 .. d_{k-1}; the verify reads [x_n, d_0 ..] and keeps a, then its next id b
        extend([d_0 .. d_{a-1}, b], hidden of the verify's rows 0 .. a)

    len() is the rows the head holds (the served model's committed rows); a proposal writes none of them."""

    name = "mtp"

    def __init__(self, head: Any, k: int = 3, kv: Any = None, capacity: int = 1024):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"k (ids a proposal holds) must be an integer >= 1, got {k!r}")
        self.head, self.k = head, k
        self.cache = head.new_cache(kv, capacity)

    def __len__(self) -> int:
        return self.cache.length

    def requires(self) -> DrafterNeeds:
        return DrafterNeeds(hidden_size=self.head.hidden_size, vocab_size=self.head.vocab_size,
                            taps=("final_hidden",), tensors=tuple(self.head.shared_tensors))

    def extend(self, next_ids: Iterable[int] | torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows len() .. len() + T - 1: row i pairs hidden[i] [T, H], the served model's final hidden at position
        len() + i, with next_ids[i], the id after it."""
        ids = next_ids if isinstance(next_ids, torch.Tensor) else torch.tensor(list(next_ids), dtype=torch.long)
        self.head.forward(ids, hidden, self.cache)

    def draft(self) -> torch.Tensor:
        """k ids, long [k] on the device (no host reads)."""
        return self.head.draft(self.cache, self.k)

    def propose(self) -> list[int]:
        return self.draft().tolist()

    def rollback_to(self, length: int) -> None:
        """Keep the head's first `length` rows; extend the accepted rows before the next proposal."""
        self.cache.rollback_to(length)


__all__ = ["Drafter", "DrafterMismatch", "DrafterNeeds", "MTPDrafter", "PromptLookup", "check_drafter", "ngram_matches"]
