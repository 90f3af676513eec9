"""The served model's turns on grid sessions: an agent's next turn reads only its new tokens.

    prompt of turn n
    |<------------- committed (kept from turn n-1, or a checkpoint) ----------->|<- read now ->|<- tail ->|
    | chunk | chunk | ...                                               | chunk | chunk | ...  | < grid   |
                                                                            line L = last grid line below
                                                                            the prompt's end
    turn:  feed (rollback where the prompt re-rendered) -> bring the state back (host or disk tier) ->
           read whole grid chunks up to L -> the tail and the decode run above the committed rows ->
           at the end the rows above L are dropped and the GDN state is L's again (a fork's put-back)

Invariant: the first token's logits equal, bit for bit, a cold prefill of the same prompt on the same
grid with the same kernels and mode (`cold_logits`): the state at L is the grid's (GridSessions'
invariant) and the tail is read by the same call in both. L stops one id short of the prompt's end, so
every prompt leaves a tail of 1..grid ids whose last row gives the first token's logits.

Rows above L (the tail, the output) are never kept: their state came from reads of another shape
than the grid's. The next turn re-renders them in its prompt and reads them on the grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.engine import Stopwatch
from .grid import GridSessions, SessionError
from .session import GridSession

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass
class TurnStart:
    """What the start of a served turn found and did (usage, metrics and the ledger read it)."""

    session_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt rows whose state was reused (not read this turn)
    tier: str | None  # where the reused state came from: device, host, disk; None when nothing was reused
    rolled_back_to: int | None  # the grid line a re-rendered prompt went back to, if it did
    chunks_read: int  # whole grid chunks read this turn
    tail_tokens: int  # ids read above the committed rows before the first token
    gpu_ms: float  # the turn's reads: chunks and the tail


@dataclass
class ServedTurn:
    """A running turn: the session's rows above `committed` and the working state belong to it."""

    session: GridSession
    start: TurnStart
    pos: int  # the next row a decoded token is written at
    saved: tuple | None = None  # eager: the GDN state at the committed row, put back at the end
    entry: object = None  # graph: the one-row decode entry
    is_open: bool = True
    extra: dict = field(default_factory=dict)


class ServedSessions:
    """The served model's sessions: a GridSessions over the served engine, and its turns.

    One thread (the served engine's executor) calls every method; one turn runs at a time on a session.
    """

    def __init__(self, book: GridSessions):
        self.book = book
        self.engine = book.engine
        self.counts = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, **{f"hits_{t}": 0 for t in TIERS}}

    @property
    def mode(self) -> str:
        return self.book.mode

    @property
    def grid(self) -> int:
        return self.book.grid

    def warm(self) -> None:
        """Capture the grid chunk's graph and the decode step now rather than in the first turn."""
        self.book.warm()
        if self.book.graphs is not None:
            self.book.graphs.prepare(1, "last")

    # ---- the turn ----------------------------------------------------------------------------
    def begin(self, session_id: str, prompt_ids: list[int]) -> tuple[ServedTurn, torch.Tensor]:
        """Start a turn: reuse what the session holds, read the rest of the prompt; returns the turn and the
        first token's logits [1, vocab]."""
        book = self.book
        if not prompt_ids:
            raise SessionError("empty prompt: at least one token id is needed")
        window = self.engine.cfg.max_position_embeddings
        if len(prompt_ids) >= window:
            raise SessionError(f"the prompt has {len(prompt_ids)} tokens; this model's window is {window}")
        known = book.sessions.get(session_id)
        tier = self._tier_before(known)
        report = book.feed(session_id, prompt_ids, prompt_end=len(prompt_ids))
        session = book.get(session_id)
        book.ensure_resident(session)  # a parked state comes back (or the session is read from row 0)
        cached = session.committed
        limit = ((len(prompt_ids) - 1) // book.grid) * book.grid
        reports = book.read_all(session_id, limit=limit, group=1)
        turn = ServedTurn(session, TurnStart(session_id, len(prompt_ids), cached, tier if cached else None,
                                             report.rolled_back_to, sum(r.chunks for r in reports),
                                             len(prompt_ids) - session.committed, sum(r.gpu_ms for r in reports)),
                          pos=session.committed)
        try:
            logits, ms = self._read_tail(turn, prompt_ids[session.committed:])
        except BaseException:
            self.finish(turn)
            raise
        turn.start.gpu_ms += ms
        c = self.counts
        c["queries"] += 1
        c["query_tokens"] += len(prompt_ids)
        c["hit_tokens"] += cached
        if cached and tier is not None:
            c[f"hits_{tier}"] += 1
        return turn, logits

    def _tier_before(self, session: GridSession | None) -> str | None:
        if session is None:
            return None
        if session.is_resident:
            return DEVICE
        tier_of = getattr(self.book.residency, "tier_of", None)
        return tier_of(session.session_id) if tier_of is not None else None

    def _read_tail(self, turn: ServedTurn, tail: list[int]) -> tuple[torch.Tensor, float]:
        """The ids above the committed rows, on the working state: the first token's logits and device ms."""
        book, session = self.book, turn.session
        book.reserve_rows(session, session.committed + len(tail) + 1, len(tail))
        graphs = book.graphs
        watch = Stopwatch(self.engine.device)
        if graphs is not None:
            turn.entry = graphs.prepare(1, "last")  # a first capture must run before the state is loaded
            with watch.measure():
                graphs.load(session.cache)
                logits = graphs.forward_eager(tail, session.committed, "last")
        else:
            turn.saved = session.cache.clone_state()
            logits, ms = self.engine.forward(session.cache, self.engine.ids_tensor(tail), "last")
            watch.gpu_ms = ms
        turn.pos = session.committed + len(tail)
        return logits, watch.gpu_ms

    def decode(self, turn: ServedTurn, token: int) -> tuple[torch.Tensor, float]:
        """One token on top of the turn; logits [1, vocab] (valid until the next step) and device ms."""
        book, session = self.book, turn.session
        pos = turn.pos
        window = self.engine.cfg.max_position_embeddings
        if pos + 1 > window:
            raise SessionError(f"position {pos + 1} exceeds the model window {window}")
        kv = session.kv
        if pos + 1 > kv.capacity:
            book.reserve_rows(session, pos + 1, 1)
            if book.graphs is not None:
                book.graphs.kv.load(kv)  # the new page into the table the graph reads
        graphs = book.graphs
        if graphs is None:
            logits, ms = self.engine.forward(session.cache, self.engine.ids_tensor([token]), "last")
        else:
            watch = Stopwatch(self.engine.device)
            with watch.measure():
                logits = graphs.run(turn.entry, [token], pos)
            ms = watch.gpu_ms
        turn.pos = pos + 1
        return logits, ms

    def finish(self, turn: ServedTurn) -> None:
        """The turn is over: the rows above the committed ones go, the GDN state is the committed row's."""
        if not turn.is_open:
            return
        turn.is_open = False
        session = turn.session
        if session.cache is None:
            return
        if turn.saved is not None:
            session.cache.set_state(*turn.saved)
        self.book.end_fork(session)

    # ---- checks ------------------------------------------------------------------------------
    def cold_logits(self, prompt_ids: list[int], session_id: str = "__cold__") -> tuple[torch.Tensor, GridSession]:
        """A cold prefill of the prompt on the same grid, kernels and mode: the first token's logits (a
        copy) and the session holding the state it kept. The session stays open; close it when done."""
        if session_id in self.book.sessions:
            self.book.close(session_id)
        turn, logits = self.begin(session_id, prompt_ids)
        out = logits.clone()
        self.finish(turn)
        return out, self.book.get(session_id)


__all__ = ["DEVICE", "DISK", "HOST", "TIERS", "ServedSessions", "ServedTurn", "TurnStart"]
