"""One grid session (the reader's or the served model's): its exact state on the grid.

    ids (everything known of the session: prompts and outputs)
    |<------------------ committed (k x grid) ------------------>|<-- tail (< grid, or backlog) -->|
    | chunk 0 | chunk 1 | chunk 2 |   ...   | chunk k-1          | waits until a whole chunk exists |
    KV rows [0, committed) in pool pages;  GDN recurrent + conv state as of row `committed`
    checkpoints: GDN state at grid lines g1 < g2 < ..., which ones the session's checkpoint book
                 decides (qse/core/checkpoints.py: prompt ends, recent lines, re-render places);
                 row 0 (zero state) is always an implicit checkpoint

Invariant: the state equals, bit for bit, a fresh prefill of ids[:committed] read chunk by chunk on
the same grid, because every chunk runs the same kernels on the same inputs at the same absolute
position. A new prompt that differs from what was read at token d goes back to the newest
checkpoint at or below d (KV rows below it stay valid) and reads again from there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..core.checkpoints import DIVERGENCE, KINDS, PROMPT, RECENT, CheckpointBook, CheckpointRules
from ..engine.kv import PagedKV
from ..models.cache import SequenceCache


_EPOCHS = itertools.count(1)


def new_epoch() -> int:
    """A fresh `GridSession.epoch` (ids replaced)."""
    return next(_EPOCHS)


@dataclass
class Checkpoint:
    """The GDN state at a grid line and the kinds the book holds it for (qse/core/checkpoints.py: prompt,
    recent, divergence): how a session's checkpoints are handed out and back (the store's records)."""

    position: int  # a grid line
    recurrent: list[torch.Tensor]
    conv: list[torch.Tensor]
    kinds: set[str] = field(default_factory=lambda: {PROMPT})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.recurrent, *self.conv))


@dataclass
class SessionStats:
    chunks_read: int = 0
    ids_read: int = 0  # every id pushed through a grid chunk, re-reads included
    rollbacks: int = 0
    restarts: int = 0  # rollbacks that had no checkpoint and started over
    ids_reread: int = 0  # ids read again because of rollbacks
    last_chunk_ms: float = 0.0
    total_chunk_ms: float = 0.0
    forks: int = 0
    shared_rows: int = 0  # rows it started from another session's state (GridSessions.start_from_donor)


@dataclass
class GridSession:
    session_id: str
    grid: int
    cache: SequenceCache | None  # None while parked or dropped (state lives elsewhere or nowhere)
    ids: list[int] = field(default_factory=list)
    committed: int = 0
    # which rows hold a checkpoint and why (None: the book's default rules on this grid; GridSessions.open
    # gives each session its book's rules)
    book: CheckpointBook | None = None
    # the states at the book's held rows: (recurrent, conv) by row; this session applies the book's changes
    states: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    stats: SessionStats = field(default_factory=SessionStats)
    mode: str = "eager"  # which execution mode wrote the state ('eager' or 'graph')
    last_fed_s: float = 0.0
    pinned: bool = False  # a served turn runs on it: the residency manager must not move or drop its state
    behind_at_turn_start: int = 0
    # renewed whenever `ids` is replaced (a feed, a store's reload), never by an append: whoever saw the ids at
    # one epoch knows they still begin with what it saw while the epoch stands (the conductor then hands a
    # slice only the ids that are new, not the whole session again). Unique across sessions and readers, so a
    # turn's epoch cannot match a reader attached after it fed.
    epoch: int = field(default_factory=new_epoch)
    # the most rows its book's KV pool can hold for one session (None: no bound). A session whose ids need more
    # is too long: no whole chunk of it is readable (no room could ever be made: reading it would only evict
    # the others, then fail), until its ids fit again
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.book is None:
            self.book = CheckpointBook(CheckpointRules(self.grid))

    # ---- the checkpoint book's lines and held rows, as the states' holder sees them ------------
    @property
    def checkpoint_lines(self) -> set[int]:
        """Prompt ends' grid lines: a chunk that ends on one takes a checkpoint."""
        return self.book.lines

    @checkpoint_lines.setter
    def checkpoint_lines(self, lines: set[int]) -> None:
        self.book.lines = set(lines)

    @property
    def divergence_lines(self) -> list[int]:
        """The newest re-render places' lines, oldest first."""
        return self.book.divergence_lines

    @divergence_lines.setter
    def divergence_lines(self, lines: list[int]) -> None:
        self.book.divergence_lines = list(lines)

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The held checkpoints, lowest first (a new list: set it to replace them)."""
        return [Checkpoint(row, *self.states[row], set(self.book.kinds_at(row))) for row in self.book.positions(None)]

    @checkpoints.setter
    def checkpoints(self, held: list[Checkpoint]) -> None:
        """Checkpoints handed back (a parked session's record), kinds and all; [] holds none."""
        self.book.load({c.position: set(c.kinds) for c in held})
        self.states = {c.position: (c.recurrent, c.conv) for c in held}

    def apply(self, change) -> None:
        """Carry out a book's Change on the states: the committed row's state copied where the book takes one,
        the dropped rows' freed."""
        self.apply_dropped(change.dropped)
        if change.take is not None:
            assert self.cache is not None and change.take == self.committed, (change, self.committed)
            self.states[change.take] = self.cache.clone_state()

    def apply_dropped(self, rows) -> None:
        """The states at rows the book no longer holds, freed."""
        for row in rows:
            self.states.pop(row, None)

    @property
    def kv(self) -> PagedKV:
        assert self.cache is not None
        return self.cache.kv  # type: ignore[return-value]

    @property
    def is_resident(self) -> bool:
        return self.cache is not None

    @property
    def is_too_long(self) -> bool:
        return self.max_rows is not None and len(self.ids) > self.max_rows

    @property
    def readable_end(self) -> int:
        """The last grid line the known ids reach: the reader may commit up to here (nothing of a session
        that is too long: 0)."""
        return 0 if self.is_too_long else (len(self.ids) // self.grid) * self.grid

    @property
    def backlog(self) -> int:
        """Ids in whole chunks not read yet."""
        return max(0, self.readable_end - self.committed)

    @property
    def behind(self) -> int:
        """All known ids not yet committed (backlog plus the pending tail)."""
        return len(self.ids) - self.committed

    @property
    def tail(self) -> list[int]:
        return self.ids[self.committed:]

    @property
    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        sections = sum(t.numel() * t.element_size() for t in (*self.cache.recurrent, *self.cache.conv))
        held = sum(t.numel() * t.element_size() for rec, conv in self.states.values() for t in (*rec, *conv))
        return self.kv.nbytes + sections + held

    def checkpoint_positions(self, kind: str | None = PROMPT) -> list[int]:
        """Rows of the checkpoints of one kind (None: of every kind), lowest first."""
        return self.book.positions(kind)


__all__ = ["DIVERGENCE", "KINDS", "PROMPT", "RECENT", "Checkpoint", "GridSession", "SessionStats"]
