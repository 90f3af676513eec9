"""One grid session (the reader's or the served model's): its exact state on the grid.

    ids (everything known of the session: prompts and outputs)
    |<------------------ committed (k x grid) ------------------>|<-- tail (< grid, or backlog) -->|
    | chunk 0 | chunk 1 | chunk 2 |   ...   | chunk k-1          | waits until a whole chunk exists |
    KV rows [0, committed) in pool pages;  GDN recurrent + conv state as of row `committed`
    checkpoints: GDN state at grid lines g1 < g2 < ... (<= 6), each the last grid line at or
                 below a turn's prompt end; row 0 (zero state) is always an implicit checkpoint

Invariant: the state equals, bit for bit, a fresh prefill of ids[:committed] read chunk by chunk on
the same grid, because every chunk runs the same kernels on the same inputs at the same absolute
position. A new prompt that differs from what was read at token d goes back to the newest
checkpoint at or below d (KV rows below it stay valid) and reads again from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.kv import PagedKV
from ..models.cache import SequenceCache


PROMPT, RECENT, DIVERGENCE = "prompt", "recent", "divergence"
KINDS = frozenset((PROMPT, RECENT, DIVERGENCE))


@dataclass
class Checkpoint:
    """The GDN state at a grid line, held for one or more reasons (its kinds):
    prompt      the last grid line at or below a turn's prompt end (up to max_checkpoints)
    recent      one of the newest grid lines read (up to recent_checkpoints; 4 under `qse serve`)
    divergence  the line at or below a place where a prompt re-rendered (up to divergence_checkpoints)
    """

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


@dataclass
class GridSession:
    session_id: str
    grid: int
    cache: SequenceCache | None  # None while parked or dropped (state lives elsewhere or nowhere)
    ids: list[int] = field(default_factory=list)
    committed: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    checkpoint_lines: set[int] = field(default_factory=set)  # grid lines to snapshot when reached
    divergence_lines: list[int] = field(default_factory=list)  # the newest re-render lines, oldest first
    stats: SessionStats = field(default_factory=SessionStats)
    mode: str = "eager"  # which execution mode wrote the state ('eager' or 'graph')
    last_fed_s: float = 0.0
    pinned: bool = False  # a served turn runs on it: the residency manager must not move or drop its state
    behind_at_turn_start: int = 0

    @property
    def kv(self) -> PagedKV:
        assert self.cache is not None
        return self.cache.kv  # type: ignore[return-value]

    @property
    def is_resident(self) -> bool:
        return self.cache is not None

    @property
    def readable_end(self) -> int:
        """The last grid line the known ids reach: the reader may commit up to here."""
        return (len(self.ids) // self.grid) * self.grid

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
        return self.kv.nbytes + sections + sum(c.nbytes for c in self.checkpoints)

    def checkpoint_positions(self, kind: str | None = PROMPT) -> list[int]:
        """Rows of the checkpoints of one kind (None: of every kind), lowest first."""
        return [c.position for c in self.checkpoints if kind is None or kind in c.kinds]
