"""The router's class question in shadow mode: queued where a turn inserted it, answered when the reader gets there.

    turn start (prompt >= router_min_tokens)      the reader's reads (idle window, ration slices)
    ----------------------------------------      -----------------------------------------------
    RouterQueue.queue: position = the prompt's    stop_rows: a read stops before the chunk that would pass
      last turn end; dropped (and logged) when     a pending question; ready: the reader stands in the
      the reader is already past it                question's chunk -> answer -> Journal.append

The queue owns the pending questions and the counts; the conductor runs the asks on the reader's thread and
charges them. Records are typed (msgspec Structs); the journal is one JSON line per answer in
<journal_dir>/shadow.jsonl (read back by qse/shadow/router_eval.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Awaitable, Callable

import msgspec
import structlog

log = structlog.get_logger("qse.router")

ROUTER_CLASSES = ["chat", "code_edit", "debug", "design_ui", "explain", "plan", "search", "test", "other"]
ROUTER_QUESTION = (
    "Classify the user's latest request in this session into one class. Classes: "
    + "; ".join(f"{chr(65 + i)}) {c}" for i, c in enumerate(ROUTER_CLASSES))
    + ". Answer with the letter only."
)
ROUTER_LETTERS = [chr(65 + i) for i in range(len(ROUTER_CLASSES))]
JOURNAL_NAME = "shadow.jsonl"


class PendingQuestion(msgspec.Struct, frozen=True):
    """A router question waiting for the reader to reach `position`."""

    request_id: str
    position: int  # after the prompt's last turn end: the answer is over ids[:position]
    router_label: str | None  # the served router's own class, where a proxy passed it
    behind_at_turn_start: int  # how far behind the reader was when the turn started (tokens)
    asked_at: float  # the conductor's clock


class JournalEntry(msgspec.Struct, frozen=True):
    """One answer, as journaled (qse/shadow/router_eval.py reads these lines back)."""

    ts: float  # wall clock (time.time)
    session: str
    request_id: str
    label: str
    probability: float
    router_label: str | None
    agree: bool | None  # None where no router label came with the turn
    behind_at_turn_start: int
    lag_s: float  # from the turn's start to the answer
    position: int


class RouterCounts(msgspec.Struct):
    answered: int = 0
    compared: int = 0
    agreed: int = 0


class Answer(msgspec.Struct, frozen=True):
    """What an ask returned, as the router needs it."""

    label: str  # a letter of ROUTER_LETTERS
    probability: float


class RouterQueue:
    """The pending router questions of every session, and the answers' counts."""

    def __init__(self, grid: int, min_tokens: int, turn_end_id: int, clock: Callable[[], float]):
        self.grid = grid
        self.min_tokens = min_tokens
        self.turn_end_id = turn_end_id
        self.clock = clock
        self.pending: dict[str, list[PendingQuestion]] = {}
        self.counts = RouterCounts()

    def queue(self, session_id: str, prompt_ids: list[int], request_id: str, router_label: str | None,
              committed: int, behind_at_turn_start: int) -> PendingQuestion | None:
        """Queue the question at the prompt's insertion point (after its last turn end), if the prompt is long
        enough and the reader (at `committed`) has not passed that point."""
        if len(prompt_ids) < self.min_tokens:
            return None
        end = self.turn_end_id
        insertion = max((i + 1 for i, t in enumerate(prompt_ids) if t == end), default=len(prompt_ids))
        if insertion < committed:  # the reader is already past it: it can no longer answer there
            log.warning("router_question_passed", session=session_id, request_id=request_id, position=insertion,
                        committed=committed)
            return None
        item = PendingQuestion(request_id, insertion, router_label, behind_at_turn_start, self.clock())
        self.pending.setdefault(session_id, []).append(item)
        return item

    def stop_rows(self, session_id: str) -> frozenset[int]:
        """Rows at which a read must stop: the chunk starting there would pass a pending question."""
        grid = self.grid
        return frozenset((p.position // grid) * grid for p in self.pending.get(session_id, ()))

    def ready(self, session_id: str, committed: int) -> list[PendingQuestion]:
        """The questions the reader (at `committed`) can answer now: each in the chunk it stands before."""
        return [p for p in self.pending.get(session_id, ()) if committed <= p.position < committed + self.grid]

    def sessions_ready(self, committed_of: Callable[[str], int | None]) -> list[str]:
        """Sessions with a question ready (committed_of: the reader's position, None for an unknown session)."""
        out = []
        for sid in list(self.pending):
            committed = committed_of(sid)
            if committed is not None and self.ready(sid, committed):
                out.append(sid)
        return out

    @property
    def num_pending(self) -> int:
        return sum(len(v) for v in self.pending.values())

    async def answer_ready(self, session_id: str, committed: int | None,
                           ask: Callable[[int], Awaitable[Answer]], journal: "Journal") -> int:
        """Answer the questions the reader has reached (`ask(position)` runs the question there) and journal
        them; returns how many."""
        ready = self.ready(session_id, committed) if committed is not None else []
        for item in ready:
            self.pending[session_id].remove(item)
            result = await ask(item.position)
            label = ROUTER_CLASSES[ROUTER_LETTERS.index(result.label)]
            self.counts.answered += 1
            agree = (label == item.router_label) if item.router_label else None
            if agree is not None:
                self.counts.compared += 1
                self.counts.agreed += int(agree)
            await journal.append(JournalEntry(
                ts=time.time(), session=session_id, request_id=item.request_id, label=label,
                probability=round(result.probability, 6), router_label=item.router_label, agree=agree,
                behind_at_turn_start=item.behind_at_turn_start, lag_s=round(self.clock() - item.asked_at, 3),
                position=item.position))
        if not self.pending.get(session_id, True):
            del self.pending[session_id]
        return len(ready)


class Journal:
    """Appends answers to <root>/shadow.jsonl, one JSON line each; root None: nowhere."""

    def __init__(self, root: Path | None):
        self.root = Path(root) if root is not None else None
        self._lock = asyncio.Lock()
        self._encoder = msgspec.json.Encoder()

    async def append(self, entry: JournalEntry) -> None:
        if self.root is None:
            return
        async with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / JOURNAL_NAME, "ab") as f:
                f.write(self._encoder.encode(entry) + b"\n")
