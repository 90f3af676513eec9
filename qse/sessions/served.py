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
grid with the same kernels and mode (`qse cache-check` and tests/sessions check it): the state at L is the grid's (GridSessions'
invariant) and the tail is read by the same call in both. L stops one id short of the prompt's end, so
every prompt leaves a tail of 1..grid ids whose last row gives the first token's logits.

Rows above L (the tail, the output) are never kept: their state came from reads of another shape
than the grid's. The next turn re-renders them in its prompt and reads them on the grid.

Decoding runs in rounds (qse/engine/rounds.py): a turn's working state (its own SequenceCache over the
session's pages, so the session's GDN state at L is never written) joins a slot of the rounds, and one
`decode_round` advances every running turn by one token in one batched forward (`launch_round`: the same,
its ids sampled on the device and read back later, so a round may run past a stop id: the extra row is
above L and goes with the rest at `finish`). A session with an open turn is pinned: the residency manager
never moves it. A turn's prompt may be read in pieces between rounds (open, read_chunks, first_token).

With the MTP head (mtp=True, QSE_SPECULATE=mtp) the turns draft on the device. The head's KV rows sit in one more
slot of the session's own pages (rounds.mtp_kv_slot): they leave and come back with the pages, but no tier
stores them (a restored session's are stale). What the head holds of a turn:
- its tail: the tail is read with the final-hidden taps, and `start_drafts` (once the first id is sampled)
  writes the head's rows of the tail and the first drafts;
- the grid chunks this turn reads: where the book reads them with the taps (chunk_hidden, as served_sessions
  builds it with the head), the head's rows of each chunk, launched behind it (`read_chunks`);
- the rows below what this turn reads: whatever the head wrote when they were read, or an earlier turn's tail or
  output; zeros where it never wrote (a session restored from host memory or disk brings back none of them);
- after every round of its turns, `follow_round` (launch_round does it itself): the head reads that round's rows
  and drafts again (the rounds' invariant: a draft follows each round before any other).
Stale or zero rows only make the drafts worse: a verify keeps only what the served model itself picks. With the
taps the tail's last layer runs for every row (where without them only the last row's): on row-invariant
kernels the same bits, elsewhere rounding like a verify's rows.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.prefix import common_prefix
from ..engine.engine import DeviceClock, Stopwatch
from ..engine.rounds import DecodeRounds, TokensBack
from ..engine.sampling import Sampler
from ..models.cache import SequenceCache
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
    # where the turn start's wall time went (ms): bringing the state back (a file's read included), moving
    # other sessions out to make room, reading the whole chunks, reading the tail to the first logits
    restore_ms: float = 0.0
    evict_ms: float = 0.0
    read_ms: float = 0.0
    tail_ms: float = 0.0
    shared_from: str | None = None  # the session whose state at `cached_tokens` a new session started from


@dataclass
class ServedTurn:
    """A running turn: the session's rows above `committed` and the working state belong to it."""

    session: GridSession
    start: TurnStart
    pos: int  # the next row a decoded token is written at
    cache: SequenceCache | None = None  # the turn's working state over the session's pages
    slot: int | None = None  # its slot in the decode rounds
    is_open: bool = True
    prompt_ids: list[int] = field(default_factory=list)
    limit: int = 0  # L: the prompt's last grid line below its end (chunks are read up to it)
    is_reserved: bool = False  # holds a decode slot it has not taken yet (open -> first_token)
    # the last prompt chunk read_chunks launched and did not wait for: the next read_chunks, the tail
    # (first_token) or finish waits for it
    held: list = field(default_factory=list)
    # the MTP head's side (ServedSessions with mtp): the tail's final hiddens until start_drafts reads them, and
    # the head's drafts after the turn's last round (long [k] on the device; None: none since its last round)
    tail_hidden: torch.Tensor | None = None
    drafts: torch.Tensor | None = None

    @property
    def chunks_left(self) -> int:
        """Whole grid chunks of the prompt still to read before its tail (0 once they are read)."""
        if self.cache is not None:
            return 0
        return max(0, self.limit - self.session.committed) // self.session.grid


class LaunchedRound:
    """A decode round launched with its ids sampled on the device (ServedSessions.launch_round): `finish`
    waits for them and the round's device time, once; `gpu_ms` is set then."""

    def __init__(self, back: TokensBack, begin: Any, end: Any, clock: DeviceClock):
        self._back, self._marks, self._clock = back, (begin, end), clock
        self._ids: list[int] | None = None
        self.gpu_ms: float | None = None

    def finish(self) -> tuple[list[int], float]:
        if self._ids is None:
            self._ids = self._back.ids()
            if self.gpu_ms is None:
                self.gpu_ms = self._clock.ms(*self._marks)
        return self._ids, self.gpu_ms


class ServedSessions:
    """The served model's sessions: a GridSessions over the served engine, and its turns.

    One thread (the served engine's executor) calls every method; one turn runs at a time on a session.
    """

    def __init__(self, book: GridSessions, max_running: int = 1, verify_width: int = 0, mtp: bool = False,
                 may_share: Callable[[str, str], bool] | None = None):
        """max_running: turns decoding at once (the rounds' slots and largest batch). verify_width: the most rows
        a turn may verify in a round (speculative decoding: its token and verify_width - 1 drafts; 0: off).
        mtp: the turns draft with the model's MTP head (verify_width >= 2; the book's pool built with
        pool_slots_for(cfg, mtp=True) slots a page). may_share(a, b): whether session a may start from session
        b's state (GridSessions.start_from_donor: a first turn whose prompt begins as a resident session's does;
        the conductor passes one namespace's rule, QSE_SHARE_HEADS); None: never."""
        if mtp:
            require_mtp_head(book.engine)
        self.book = book
        self.engine = book.engine
        self.rounds = DecodeRounds(book.engine, book.pool, max_running,
                                   graphs=None if book.graphs is not None and book.graphs.capture else False,
                                   verify_width=verify_width, mtp=mtp)
        self._clock = DeviceClock(book.engine.device)
        self._reserved = 0  # turns opened that have not taken their decode slot yet
        self.counts = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, **{f"hits_{t}": 0 for t in TIERS}}
        self.may_share = may_share

    @property
    def mode(self) -> str:
        return self.book.mode

    @property
    def mtp(self) -> bool:
        """Whether the turns draft with the MTP head (start_drafts, follow_round, head_drafts)."""
        return self.rounds.mtp is not None

    @property
    def grid(self) -> int:
        return self.book.grid

    def warm(self, tails: bool | None = None) -> None:
        """Capture the grid chunk's graph and the decode step now rather than in the first turn; with `tails`
        (None: on CUDA) also the tails': on the graph path each tail class's graph (`ForwardGraphs.tail_rows`),
        eagerly one tail of every length class (`tail_lengths`) above two chunks of context, so that no turn
        pays for compiling a kernel variant: a tail's eager launch compiles one per shape class the first time
        it meets it (the attention's split count is a compile-time constant chosen from the tail's length),
        which cost the first turn at each new class about a cold prefill."""
        self.book.warm()
        self.rounds.warm()
        if not (self.engine.device.type == "cuda" if tails is None else tails):
            return
        if self.book.graphs is not None:
            self.book.graphs.warm_tails(self.grid, hidden=self.mtp)
            return
        counts = dict(self.counts)
        sid = "__warm_tails__"
        base = [0] * (2 * self.grid)  # two whole chunks: the tail's attention launch splits as at any long context
        try:
            for length in tail_lengths(self.grid):
                turn, _ = self.begin(sid, base + [0] * length)
                self.finish(turn)
        finally:
            if sid in self.book.sessions:
                self.book.close(sid)
            self.counts = counts

    # ---- the turn ----------------------------------------------------------------------------
    # A turn starts in three steps, so that a round loop can read a long prompt a few chunks at a time
    # between decode rounds: `open` (reuse what the session holds), `read_chunks` (whole grid chunks up to
    # the line L, as many calls as it likes), `first_token` (the tail above L: the first token's logits; the
    # turn joins a decode slot). `begin` is the three at once. The chunks are the same reads, on the same
    # state, whatever comes between two calls (each grid chunk loads and stores the session's own state),
    # so the first token is a cold prefill's bits however the prompt was cut into calls.
    def begin(self, session_id: str, prompt_ids: list[int]) -> tuple[ServedTurn, torch.Tensor]:
        """Start a turn: reuse what the session holds, read the rest of the prompt; returns the turn and the
        first token's logits [1, vocab]."""
        turn = self.open(session_id, prompt_ids)
        try:
            self.read_chunks(turn, hold_last=True)
        except BaseException:
            self.finish(turn)
            raise
        return turn, self.first_token(turn)

    def open(self, session_id: str, prompt_ids: list[int]) -> ServedTurn:
        """The turn's session holds the prompt (rolled back where it re-rendered) and its state is resident
        and pinned; nothing of the prompt is read yet. The turn holds a decode slot from here (reserved until
        first_token takes it)."""
        book = self.book
        if not prompt_ids:
            raise SessionError("empty prompt: at least one token id is needed")
        window = self.engine.cfg.max_position_embeddings
        if len(prompt_ids) >= window:
            raise SessionError(f"the prompt has {len(prompt_ids)} tokens; this model's window is {window}")
        known = book.sessions.get(session_id)
        if known is not None and known.pinned:
            raise SessionError(f"session {session_id!r} already has a turn running; one turn a session at a time")
        if self.rounds.num_free - self._reserved <= 0:
            raise SessionError(f"every decode slot is taken ({self.rounds.max_running} turns run or start)")
        tier = self._tier_before(known)
        rollbacks0 = known.stats.rollbacks if known is not None else 0
        spent0 = book.residency.spent_ms()
        report = book.feed(session_id, prompt_ids, prompt_end=len(prompt_ids))
        session = book.get(session_id)
        session.pinned = True  # from here until finish: the store never moves it
        limit = ((len(prompt_ids) - 1) // book.grid) * book.grid
        try:
            book.ensure_resident(session)  # a parked state comes back (or the session is read from row 0)
            # nothing held (a new session, or one read again from row 0): another session's head, where one
            # begins as this prompt does
            shared_from = (book.start_from_donor(session, limit, self.may_share)
                           if self.may_share is not None and session.committed == 0 else None)
        except BaseException:
            session.pinned = False
            raise
        if shared_from is not None:
            tier = DEVICE
        rolled_back_to = report.rolled_back_to
        if rolled_back_to is None and session.stats.rollbacks > rollbacks0:
            rolled_back_to = session.committed  # a parked state went back as it came back (the store's restore)
        if session.committed > limit:  # the prompt ends on a line the session holds: its last chunk is the tail,
            rolled_back_to = book.rollback(session, limit)  # read again for the first token's logits
        cached = session.committed
        self._reserved += 1
        turn = ServedTurn(session, TurnStart(session_id, len(prompt_ids), cached, tier if cached else None,
                                             rolled_back_to, 0, len(prompt_ids) - cached, 0.0),
                          pos=cached, prompt_ids=list(prompt_ids), limit=limit, is_reserved=True)
        turn.start.shared_from = shared_from
        spent1 = book.residency.spent_ms()
        turn.start.restore_ms = _grew(spent0, spent1, "restore")
        turn.start.evict_ms = _grew(spent0, spent1, "evict")
        c = self.counts
        c["queries"] += 1
        c["query_tokens"] += len(prompt_ids)
        c["hit_tokens"] += cached
        if cached and tier is not None:
            c[f"hits_{tier}"] += 1
        return turn

    def read_chunks(self, turn: ServedTurn, max_chunks: int | None = None, hold_last: bool = False,
                    stop: Callable[[], bool] | None = None) -> float:
        """Up to max_chunks (None: every) whole grid chunks of the turn's prompt below its line L, up to the
        book's chunk group a launch (the same bits as one at a time), the next launched before the last is read
        back; returns the device ms of those waited for.
        hold_last: the last chunk launched is left running (not waited for), so the device is never idle
        while the host goes on: the next call (the next round's piece of this prompt) reads it back once it
        has launched one of its own, first_token launches the tail behind it, and finish waits for it. A held
        chunk's ms count once it is waited for.
        stop: asked before each launch after the first; True reads no more (a round cut where a newcomer goes
        first: the rounds' QSE_ROUND_CUT)."""
        if turn.cache is not None or not turn.is_open:
            raise SessionError("the turn's prompt is read already (its first token came)")
        book = self.book
        in_flight: deque = deque(turn.held)  # what an earlier call left running: read back behind this one's launch
        turn.held = []
        reports: list = []
        spent0, t_read = book.residency.spent_ms(), time.perf_counter()
        failed = True
        launched = 0  # chunks launched (a group counts its chunks)
        try:
            while max_chunks is None or launched < max_chunks:
                if launched and stop is not None and stop():
                    break
                group = book.chunk_group if max_chunks is None else min(book.chunk_group, max_chunks - launched)
                pending = book.launch_step(turn.start.session_id, group, turn.limit)
                if pending is None:
                    break
                self._head_reads(turn, pending)
                launched += pending.chunks
                in_flight.append(pending)
                while len(in_flight) > 1:
                    reports.append(book.finish_step(in_flight.popleft()))
            failed = False
        finally:
            keep = 1 if hold_last and not failed else 0
            while len(in_flight) > keep:
                reports.append(book.finish_step(in_flight.popleft()))
            turn.held = list(in_flight)
        evicted = _grew(spent0, book.residency.spent_ms(), "evict")
        turn.start.evict_ms += evicted
        # the chunks' wall without the evictions made for their pages
        turn.start.read_ms += max(0.0, (time.perf_counter() - t_read) * 1e3 - evicted)
        turn.start.chunks_read += launched
        turn.start.tail_tokens = turn.start.prompt_tokens - turn.session.committed
        turn.pos = turn.session.committed
        return self._count_chunks(turn, reports)

    def _head_reads(self, turn: ServedTurn, pending) -> None:
        """The head's rows of a grid chunk just launched, from its final hiddens (a book with chunk_hidden), each
        paired with the prompt's id after it; launched behind the chunk, before the next one overwrites them."""
        if not self.mtp or pending.hidden is None:
            return
        start, rows = pending.start, pending.hidden.shape[0]
        self.rounds.mtp_rows(turn.session.kv, start, turn.session.ids[start + 1 : start + rows + 1], pending.hidden)

    def _count_chunks(self, turn: ServedTurn, reports: list) -> float:
        ms = sum(r.gpu_ms for r in reports)
        turn.start.gpu_ms += ms
        return ms

    def _settle(self, turn: ServedTurn) -> float:
        """Wait for the chunk the turn holds, and count it; its device ms."""
        held, turn.held = turn.held, []
        return self._count_chunks(turn, [self.book.finish_step(pending) for pending in held])

    def first_token(self, turn: ServedTurn) -> torch.Tensor:
        """The tail above L on the turn's own working state, which then takes its decode slot: the first
        token's logits [1, vocab]. Every chunk below L must be read (read_chunks) before."""
        if turn.chunks_left:
            raise SessionError(f"{turn.chunks_left} grid chunks of the prompt are still unread")
        spent0, t_tail = self.book.residency.spent_ms(), time.perf_counter()
        try:
            logits, ms = self._read_tail(turn, turn.prompt_ids[turn.session.committed:])
            self._settle(turn)  # (done by now: the tail ran behind it)
        except BaseException:
            self.finish(turn)
            raise
        turn.start.tail_ms = (time.perf_counter() - t_tail) * 1e3
        turn.start.evict_ms += _grew(spent0, self.book.residency.spent_ms(), "evict")
        turn.start.gpu_ms += ms
        turn.start.tail_tokens = turn.start.prompt_tokens - turn.session.committed
        return logits

    def unread_estimate(self, session_id: str, prompt_ids: list[int]) -> int:
        """About how many prompt ids a turn of this prompt would read (what it does not share with the state the
        session holds now); read on any thread, so an estimate: the state may move before the turn opens."""
        session = self.book.sessions.get(session_id)
        if session is None or session.cache is None and self.book.residency.tier_of(session_id) is None:
            return len(prompt_ids)
        kept = common_prefix(session.ids, prompt_ids, session.committed)
        return len(prompt_ids) - (kept // self.grid) * self.grid

    def is_ready(self, session_id: str) -> bool:
        """Whether a turn on this session may open without reading a file on the served thread: its state is
        resident, in host memory, read ahead, or nowhere (a cold read). Any thread may ask (one moment's
        answer: a state may move before the turn opens, and then it is read as before)."""
        return self.book.residency.ready(session_id)

    def prefetch(self, session_ids: list[str]) -> list[Future]:
        """Between rounds (a safe point): what has finished moving lands, and each of these sessions whose state
        is only in a file starts loading into host memory beside the device work; the loads still in flight
        (their turns open once they have landed: `is_ready`)."""
        book = self.book
        book.safe_point()
        loads = [book.residency.prefetch(book, sid) for sid in session_ids]
        return [f for f in loads if f is not None]

    def _tier_before(self, session: GridSession | None) -> str | None:
        if session is None:
            return None
        if session.is_resident:
            return DEVICE
        return self.book.residency.tier_of(session.session_id)

    def _read_tail(self, turn: ServedTurn, tail: list[int]) -> tuple[torch.Tensor, float]:
        """The ids above the committed rows on the turn's own working state, which then joins a decode slot:
        the first token's logits and device ms."""
        book, session = self.book, turn.session
        graphs = book.graphs  # on the graph path a tail reads in its class's graph, its rows past it padding
        rows = len(tail) if graphs is None else graphs.tail_rows(len(tail))
        # (with the head: the first drafts' rows too, start_drafts)
        book.reserve_rows(session, session.committed + max(rows, len(tail) + 1 + self.rounds.draft_reach), len(tail))
        cache = self.engine.new_cache(kv=session.kv)  # the session's pages, a state of the turn's own
        cache.copy_state_from(session.cache)
        cache.length = session.committed
        turn.cache = cache
        if graphs is None:
            taps = self.engine.model.new_taps(len(tail), ("final_hidden",)) if self.mtp else None
            logits, ms = self.engine.forward(cache, self.engine.host_ids(tail), "last", taps=taps)
            hidden = None if taps is None else taps["final_hidden"]
        else:
            watch = Stopwatch(self.engine.device)
            with watch.measure():
                logits, hidden = graphs.run_tail(cache, tail, session.committed, hidden=self.mtp)
            ms = watch.gpu_ms
        turn.tail_hidden = hidden  # (the head's rows of the tail: start_drafts)
        self._reserved -= 1  # the slot open() reserved is taken now
        turn.is_reserved = False
        turn.slot = self.rounds.admit(cache)
        if turn.slot is None:  # begin checked a slot was free; one thread runs every method
            raise SessionError("no decode slot is free")
        turn.pos = cache.length
        return logits, ms

    # ---- the MTP head's drafts (mtp) ---------------------------------------------------------
    def start_drafts(self, turn: ServedTurn, first_id: int) -> None:
        """The turn's first id was sampled: the head reads the tail's rows (each final hidden with the id after
        it) and drafts the first verify's ids (turn.drafts). Nothing without the head, or once the turn has
        decoded; a tail whose drafts would pass the model's window is left without them."""
        hidden, turn.tail_hidden = turn.tail_hidden, None
        if hidden is None or turn.slot is None or turn.pos != turn.session.committed + hidden.shape[0]:
            return
        if turn.pos + self.rounds.verify_width - 1 > self.engine.cfg.max_position_embeddings:
            return
        tail = turn.prompt_ids[turn.session.committed:]
        turn.drafts = self.rounds.mtp_prefill(turn.slot, [*tail[1:], first_id], hidden)

    def follow_round(self, turns: list[ServedTurn], next_ids: list[int] | torch.Tensor,
                     accepted: list[int] | None = None, k: int | None = None) -> None:
        """After a round of these turns (decode_round, or verify_round and keep_round), before any other round:
        the head reads the round's rows and drafts again (turn.drafts). next_ids[i]: the id after turn i's last
        kept row (a host list, or the rounds' `sampled` on the device); accepted: each turn's kept drafts (None:
        a plain round); k: ids a turn (None: the widest verify's; 0: the head reads the rows and drafts nothing,
        where no turn will look next round). Nothing without the head."""
        if not self.mtp or not turns:
            return
        drafts = self.rounds.draft([t.slot for t in turns], next_ids, accepted, k=k).clone()  # the next overwrites
        for turn, row in zip(turns, drafts):
            turn.drafts = row

    def head_drafts(self, turns: list[ServedTurn]) -> list[list[int]]:
        """Each turn's drafts from the head after its last round, read back in one copy ([] where it has none)."""
        have = [t.drafts for t in turns if t.drafts is not None]  # (their lengths may differ: follow_round's k)
        flat = torch.cat(have).tolist() if have else []
        out, at = [], 0
        for turn in turns:
            n = 0 if turn.drafts is None else int(turn.drafts.shape[0])
            out.append(flat[at : at + n])
            at += n
        return out

    def decode(self, turn: ServedTurn, token: int) -> tuple[torch.Tensor, float]:
        """One token on top of the turn alone; logits [1, vocab] (valid until the next step) and device ms."""
        logits, ms = self.decode_round([turn], [token])
        return logits, ms

    def decode_round(self, turns: list[ServedTurn], tokens: list[int],
                     carry: list[int] | None = None) -> tuple[torch.Tensor, float]:
        """One token on top of each turn, in one batched forward: logits [len(turns), vocab] (row i is turn i's,
        valid until the next round) and the round's device ms (waited for). carry: as DecodeRounds.run (row i
        reads the id launch_round sampled in row carry[i] of the last round, where carry[i] >= 0)."""
        self._before_round(turns)
        watch = Stopwatch(self.engine.device)
        with watch.measure():
            logits = self.rounds.run([t.slot for t in turns], tokens, carry)
        for turn in turns:
            turn.pos += 1
        return logits, watch.gpu_ms

    def launch_round(self, turns: list[ServedTurn], tokens: list[int], carry: list[int] | None,
                     samplers: list[Sampler], between: Callable[[], None] | None = None,
                     draft_k: int | None = None) -> "LaunchedRound":
        """decode_round without waiting: each row's id chosen on the device (every sampler is_on_device; plain
        greedy rows in one argmax) into the rounds' `sampled` row i, where the next round may read it (carry),
        and on its way to the host; nothing here waits for the device. between: called once the forward is
        enqueued and before the sampling (a grammar's matcher takes the last round's ids there and builds this
        step's mask on the host while the device runs the forward; the sampling stays outside any graph).
        draft_k: the MTP head's draft after the round, ids a turn (follow_round's k)."""
        if not all(s.is_on_device for s in samplers):
            raise ValueError("launch_round samples on the device: log-probabilities need decode_round")
        self._before_round(turns)
        begin = self._clock.mark()
        logits = self.rounds.run([t.slot for t in turns], tokens, carry)
        if between is not None:
            between()
        num_rows = len(turns)
        sampled = self.rounds.sampled
        limit = samplers[0].vocab_limit if samplers else None
        if any(s.params.is_plain_greedy for s in samplers):
            sampled[:num_rows].copy_(torch.argmax(logits[:, :limit], dim=-1))  # first maximum on ties, as alone
        for i, sampler in enumerate(samplers):
            if not sampler.params.is_plain_greedy:
                sampled[i].copy_(sampler.on_device(logits[i]))
        end = self._clock.mark()
        for turn in turns:
            turn.pos += 1
        self.follow_round(turns, sampled[:num_rows], k=draft_k)  # the head reads the ids where they are, on the device
        return LaunchedRound(self.rounds.send_back(num_rows), begin, end, self._clock)

    def verify_round(self, turns: list[ServedTurn], rows: list[list[int]]) -> tuple[torch.Tensor, float]:
        """A verify (speculative decoding): turn i reads rows[i] (its next token, then its drafts; the same
        count for every turn) in one batched forward. Returns the logits [len(turns), T, vocab] (row j: the law
        after rows[i][:j + 1]; valid until the next round) and the device ms (waited for). Nothing is kept until
        `keep_round` says how many rows each turn keeps."""
        width = len(rows[0]) if rows else 0
        self._before_round(turns, width)
        watch = Stopwatch(self.engine.device)
        with watch.measure():
            logits = self.rounds.verify([t.slot for t in turns], rows)
        return logits, watch.gpu_ms

    def keep_round(self, turns: list[ServedTurn], accepted: list[int]) -> None:
        """After verify_round: turn i keeps its token and its first accepted[i] drafts."""
        self.rounds.keep([t.slot for t in turns], accepted)
        for turn, count in zip(turns, accepted):
            turn.pos += count + 1

    def can_verify(self, turns: list[ServedTurn], width: int) -> bool:
        """Whether every turn may read `width` rows now: the rounds verify that wide, and no turn would pass the
        model's window or the most rows a session holds (near them a turn decodes one id a round)."""
        if not 2 <= width <= self.rounds.verify_width:
            return False
        limit = min(self.engine.cfg.max_position_embeddings, self.book.max_rows)
        return all(turn.pos + width + self.rounds.draft_reach <= limit for turn in turns)

    def _before_round(self, turns: list[ServedTurn], width: int = 1) -> None:
        window, reach = self.engine.cfg.max_position_embeddings, self.rounds.draft_reach
        for turn in turns:
            if turn.pos + width > window:
                raise SessionError(f"position {turn.pos + width} exceeds the model window {window}")
            turn.drafts = None  # (until follow_round: the head's drafts after this round)
            rows = turn.pos + width  # and the head's draft rows above the round's, where a session may hold them
            rows += reach if rows + reach <= self.book.max_rows else 0
            if rows > turn.session.kv.capacity:  # a new page, room made by the residency manager
                self.book.reserve_rows(turn.session, rows, width)

    def finish(self, turn: ServedTurn) -> float:
        """The turn is over: its slot is free, the rows above the committed ones go (the session's own GDN state
        was never written: it is the committed row's). Returns the device ms of a chunk it still held (read back
        here: a turn that ends while its prompt is read), for the caller's ledger."""
        if not turn.is_open:
            return 0.0
        settled = 0.0
        if turn.held:
            try:
                settled = self._settle(turn)  # (it lets go of the chunk before waiting for it)
            except Exception:  # the device failed under the chunk: the turn still ends and frees its slot below;
                pass  # the failure shows again at the engine's next call
        turn.is_open = False
        session = turn.session
        if turn.slot is not None:
            self.rounds.release(turn.slot, keep=False)
            turn.slot = None
        if turn.is_reserved:
            self._reserved -= 1
            turn.is_reserved = False
        session.pinned = False
        if session.cache is not None:
            self.book.end_fork(session)
        self.book.safe_point()  # between rounds: moves land, the host cap is kept
        return settled


def require_mtp_head(engine) -> None:
    """A ValueError naming the model where it has no MTP head to draft with (QSE_SPECULATE=mtp)."""
    layers = getattr(engine.cfg, "mtp_num_hidden_layers", 0)
    head = getattr(engine.model, "mtp_head", None)
    why = None
    if head is None:
        why = f"the {engine.resolved.family} family drafts with no MTP head"
    elif layers < 1:
        why = f"its config has mtp_num_hidden_layers={layers}"
    else:
        try:
            head()
        except ValueError as exc:  # (another layer count, or tensors the checkpoint lacks: the head says which)
            why = str(exc)
    if why is not None:
        raise ValueError(f"QSE_SPECULATE=mtp drafts with the served checkpoint's MTP head, and the served model "
                         f"{engine.name!r} has none ({why}): serve a checkpoint that ships one (config "
                         f"mtp_num_hidden_layers: 1, tensors mtp.*), or set QSE_SPECULATE=ngram or off")


def _grew(before: dict[str, float], after: dict[str, float], phase: str) -> float:
    return after.get(phase, 0.0) - before.get(phase, 0.0)


def tail_lengths(grid: int) -> list[int]:
    """Tail lengths (1..grid) that meet every launch shape a tail's kernels take: 1, grid, and each multiple of
    16 with the length after it. A kernel is specialised on length == 1 and length % 16 == 0, and its
    compile-time constants change with the length in steps of more than 16 lengths (the attention's split
    count: ceil(length * group / 128)), so every class meets one of these, divisible by 16 or not."""
    out = {1, grid}
    for m in range(16, grid + 1, 16):
        out.update((m, min(grid, m + 1)))
    return sorted(out)


__all__ = ["DEVICE", "DISK", "HOST", "TIERS", "LaunchedRound", "ServedSessions", "ServedTurn", "TurnStart",
           "require_mtp_head", "tail_lengths"]
