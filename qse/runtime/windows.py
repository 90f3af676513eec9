"""The reader's side of the conductor: the slices between two rounds and the idle window.

Between two rounds the scheduler may open the oldest running turn's ration, the busy share's slice (a session
with no turn open) or the narrator's; when nothing runs or waits, the idle window reads bursts of the sessions'
unread chunks, the shortest backlog first (qse/core/idle.py: idle_read_order). Each is carried out chunk by
chunk on the reader's thread (`ChunkRunner`), every chunk charged to the ledger. A mixin of `Conductor`: the
sessions and the ledger are the conductor's.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from ..core.drive import Stop
from ..core.idle import IdleBurst, SessionBacklog
from ..core.ledger import Role
from ..core.locks import HeldLocks, LockRank, Priority
from ..core.plan import ROLE_OF_WINDOW, Window, whole_chunks
from ..core.ration import RationSlice
from ..core.scheduler import Busy, IdleOpened, IdlePoll, OpenIdle, ReadEnded, ReadPlan, RoundEnded, SliceView
from .narrator import NARRATOR_QUESTION, Narration
from .reading import ReadOutcome, TurnIds, learn
from .turn import Turn

log = structlog.get_logger("qse.conductor")  # one logger for the conductor's modules: its events keep their name


class ReaderWindows:
    """The reader's slices between rounds and its idle window."""

    def _note_backlog(self, session_id: str) -> None:
        """Keep when each session's oldest unread chunk became known (the reader's order ages backlogs by it)."""
        session = self.reader.sessions.get(session_id) if self.reader is not None else None
        if session is not None and session.backlog >= self.reader.grid:
            self._unread_since.setdefault(session_id, self.clock())
        else:
            self._unread_since.pop(session_id, None)

    async def _between_rounds(self) -> None:
        """The reader's slice where the scheduler opens one: the oldest running turn's ration (its prompt first,
        then the output so far), else the busy share's (the session first in idle_read_order, gathered only
        when a slice is earned); then the narrator's for the turns it follows."""
        if self.reader is None or not (self._running or self._reading):
            return
        now = self.clock()
        backlogs = self._between_turns_backlogs(now) if self.scheduler.busy_may_open() else {}
        action = self.scheduler.on(RoundEnded(now, [self._slice_view(e.turn) for e in self._running], backlogs))
        if isinstance(action, ReadPlan):
            await self._slice(action, action.key)
        for entry in list(self._running):
            if entry.turn.turn_id in self.narrator.followed and not entry.closed:
                await self._narrate(entry.turn)

    def _slice_view(self, turn: Turn, upto: int | None = None) -> SliceView:
        """A running turn as the scheduler weighs its slice: its own session, read up to `upto` ids (None: all
        it knows)."""
        session = self.reader.sessions.get(turn.session_id)
        return SliceView(turn, turn.turn_id, turn.session_id, turn.first_token_s,
                         session.committed if session is not None else 0,
                         turn.num_known if upto is None else upto,
                         session is not None and session.is_resident)

    async def _narrate(self, turn: Turn) -> None:
        """The narrator's slice of a turn it follows: whole chunks of the session toward the thought's end, then,
        with less than a chunk left above the thought's end, the summary on a fork (charged to the turn)."""
        followed = self.narrator.followed[turn.turn_id]
        sid = turn.session_id
        session = self.reader.sessions.get(sid)
        if followed.done or turn.first_token_s is None or session is None or not session.is_resident:
            return
        end = self.narrator.thought_end(turn.turn_id, turn.out_ids)
        if whole_chunks(session.committed, end if end is not None else turn.num_known, self.reader.grid) > 0:
            action = self.scheduler.slice(Window.NARRATOR, self.clock(), self._slice_view(turn, end))
            if isinstance(action, ReadPlan):
                await self._slice(action, turn, end)
            return
        if end is None:
            return  # the thought goes on: nothing to summarise yet
        if not self.scheduler.summary_earned(self.clock(), self._slice_view(turn, end), self.narrator.summary_est_ms):
            return  # not earned yet
        ids = self.render_question(NARRATOR_QUESTION)
        result = await self.reader_exec.run(self._summarize_at, sid, turn.ids_view(end), ids,
                                            self.narrator.max_tokens)
        self.ledger.record(Role.NARRATOR, result.gpu_ms, turn_id=turn.turn_id)
        narration = Narration(sid, turn.req.request_id, result.text, len(result.token_ids), result.position,
                              round(result.gpu_ms, 3), live=True)
        log.info("narration", session=sid, request_id=turn.req.request_id, tokens=narration.tokens,
                 position=narration.position, gpu_ms=narration.gpu_ms, live=True)
        self.narrator.delivered(turn.turn_id, narration)

    def _summarize_at(self, session_id: str, upto: TurnIds, question_ids: list[int], max_tokens: int):
        """On the reader's thread: the session learns the turn's ids up to `upto` (if it holds fewer), then the
        summary decodes on a fork above all it holds."""
        learn(self.reader, self.reader.get(session_id), upto)
        return self.reader.summarize(session_id, question_ids, max_tokens, (self.reader.engine.chat.turn_end_id,))

    async def _slice(self, action: ReadPlan, turn: Turn | None, end: int | None = None) -> None:
        """Carry out a slice the scheduler opened between two rounds: a turn's (its session, up to `end` of its
        ids: None, all it knows; the narrator: up to the thought's end), or the busy share's (turn None: the
        session's ids as the reader holds them). Every running turn waited for it: each is charged its wall
        (the decode loss each of them saw)."""
        now = self.clock()
        sl = action.decision
        num_chunks, stop = await self._read(action.window, action.session_id,
                                            turn.turn_id if turn is not None else None, sl,
                                            known=turn.ids_view(end) if turn is not None else None)
        self.scheduler.on(ReadEnded(self.clock(), stop))
        if action.window is Window.RATION:
            wall = self.clock() - now
            for entry in self._running:
                entry.turn.ration_wall_s += wall
                entry.turn.ration_slices += 1
        role = ROLE_OF_WINDOW[action.window]
        log.info("ration_slice", window=action.window.value, session=action.session_id,
                 request_id=turn.req.request_id if turn is not None else None, chunks=num_chunks,
                 gpu_ms=sl.spent_us / 1000, budget_ms=sl.budget_us / 1000,
                 spent_turn_ms=(self.ledger.spent_us(role, turn.turn_id if turn is not None else None) or 0) / 1000)

    async def _read(self, window: Window, session_id: str, turn_id: str | None, decision: IdleBurst | RationSlice,
                    known: TurnIds | None = None) -> tuple[int, Stop | None]:
        """Whole chunks of one session while `decision` allows, on the reader's thread; a router question
        is asked where the turn inserted it, then reading goes on. Returns (chunks read, why it stopped)."""
        num_chunks = 0
        while True:
            now = self.clock()
            left_us = decision.left_us(now) if isinstance(decision, IdleBurst) else decision.left_us
            called = time.perf_counter()
            outcome: ReadOutcome | None = await self.reader_exec.run(
                self.runner.run, window, session_id, turn_id, decision, budget_ms=left_us / 1000,
                prompt_tokens=len(self._session_prompts.get(session_id, ())) or None, known=known,
                question_rows=self.router.stop_rows(session_id), request_waiting=self._request_waiting)
            back = time.perf_counter()
            if outcome is None:
                self._note_backlog(session_id)
                return num_chunks, None
            num_chunks += outcome.result.num_chunks
            self._note_backlog(session_id)
            for report in outcome.reports:
                log.info("chunk", window=window.value, session=session_id, position=report.position,
                         backlog=report.backlog, gpu_ms=round(report.gpu_ms, 3), chunks=report.chunks)
            if outcome.host is not None and outcome.host.left is not None:
                # one read's host time: the hop to the reader's thread and back, and what it did before its first
                # launch and after its last readback (the device idles then: a session switch's cost)
                log.info("reader_read", window=window.value, session=session_id, chunks=outcome.result.num_chunks,
                         gpu_ms=round(outcome.result.gpu_us / 1000, 3),
                         hop_ms=round((outcome.host.entered - called) * 1e3, 3),
                         back_ms=round((back - outcome.host.left) * 1e3, 3), **outcome.host.ms())
            if outcome.result.stop is Stop.REFUSED:
                log.error("chunk_not_recorded", window=window.value, session=session_id,
                          gpu_ms=outcome.reports[-1].gpu_ms if outcome.reports else None)
            answered = (await self._answer_router(session_id, window, turn_id, decision)
                        if (outcome.reports or outcome.is_at_question) else 0)
            if not outcome.is_at_question or not answered:  # (a gate with nothing to answer would spin)
                return num_chunks, outcome.result.stop

    def _request_waiting(self) -> bool:
        """Asked on the reader's thread before every idle chunk: someone waits for the engine, or we stop."""
        return self._stopping or self.board.engine.has_waiter_above(Priority.IDLE_READER)

    def _idle_wait_s(self) -> float:
        """Until the scheduler's next look (its lattice: a look every poll_s from the first request, the replay's
        too), at most poll_s, at least a millisecond (a stale look after the clock jumped comes at once, once)."""
        poll, next_s = self.scheduler.idle.poll_s, self.scheduler.next_look_s
        return poll if next_s is None else min(poll, max(1e-3, next_s - self.clock()))

    def _engine_freed(self) -> None:
        """The round loop let the engine go (its last turn ended): with the policy's idle_wake the idle window
        looks now, not at its next poll (the scheduler's TurnEnded says the same to the replay)."""
        if self.scheduler.wake_on_end and self._wake is not None:
            self._wake.set()

    async def _idle_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), self._idle_wait_s())
            except TimeoutError:
                pass
            if self._stopping:
                break
            self._wake.clear()  # a wake is one look (stop sets it for good, after _stopping)
            try:
                await self.idle_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the reader must never take the server down
                log.error("idle_read_failed", error=repr(exc))

    def _idle_has_work(self) -> bool:
        reader, ready = self.reader, self.runner.is_ready
        if any(s.backlog >= reader.grid and ready(s.session_id) for s in reader.sessions.values()):
            return True
        return any(ready(sid) for sid in self.router.sessions_ready(self._committed))

    def _idle_backlogs(self, now: float) -> dict[str, SessionBacklog]:
        """The sessions with a whole chunk unread, as the scheduler picks the idle window's next one (a parked
        session only once its state has loaded)."""
        grid, ready = self.reader.grid, self.runner.is_ready
        return {s.session_id: SessionBacklog(self._unread_since.setdefault(s.session_id, now), s.backlog // grid,
                                             s.committed)
                for s in self.reader.sessions.values() if s.backlog >= grid and ready(s.session_id)}

    def _between_turns_backlogs(self, now: float) -> dict[str, SessionBacklog]:
        """The busy share's sessions: those with a whole chunk unread and no turn open (waiting, read or running).
        Their agents are thinking, their next turns want them read, and while other agents run the idle window
        does not open for them; a session with a turn open is its own ration's (alone on the server, the idle
        window after the turn reads it, and a short turn's decode loses nothing)."""
        open_turns = {e.turn.session_id for e in (*self._waiting, *self._reading, *self._running)}
        return {sid: b for sid, b in self._idle_backlogs(now).items() if sid not in open_turns}

    async def idle_once(self) -> int:
        """One look at the idle window: read up to idle_burst_s if nothing runs or waits. Returns chunks read."""
        if self.reader is None or self._stopping:
            return 0
        board = self.board
        busy = Busy(request_running=board.engine.locked, request_waiting=board.engine.num_waiting > 0,
                    hold_on=board.holds > 0, box_locked=board.box.locked)
        if not self.scheduler.idle_may_look(busy):
            self.scheduler.on(IdlePoll(self.clock(), busy, has_work=False))
            return 0
        # a safe point on every quiet look (never inside a ration slice): the reader's spills go to the mover, the
        # host cap holds, parked sessions with a backlog start loading (the window reads them once loaded, never
        # their files)
        await self.reader_exec.run(self.runner.safe_point)
        action = self.scheduler.on(IdlePoll(self.clock(), busy, self._idle_has_work()))
        if not isinstance(action, OpenIdle):
            return 0
        held = HeldLocks()
        if not board.engine.try_acquire(Priority.IDLE_READER):  # behind every waiter: it never queues
            return 0
        held.acquire(LockRank.ENGINE)
        chunks = 0
        try:
            if not board.try_box(held):  # without waiting
                return 0
            try:
                chunks = await self._idle_burst()
            finally:
                board.release_box(held)
        finally:
            board.engine.release()
            held.release(LockRank.ENGINE)
        if chunks:
            self.idle_bursts += 1
        return chunks

    async def _idle_burst(self) -> int:
        """Ask, read, report: the router's questions the reader stands at first, then the sessions the scheduler
        picks (the shortest backlog first, idle_read_order) until it closes the burst."""
        for sid in self.router.sessions_ready(self._committed):
            if self.runner.is_ready(sid):
                await self._answer_router(sid)  # the reader already stands where these were asked
        opened = self.clock()
        action = self.scheduler.on(IdleOpened(opened, self._idle_backlogs(opened)))
        burst = self.scheduler.burst
        chunks = 0
        try:
            while isinstance(action, ReadPlan):
                num, stop = await self._read(Window.IDLE, action.session_id, None, action.decision)
                chunks += num
                now = self.clock()
                action = self.scheduler.on(ReadEnded(now, stop, self._idle_backlogs(now)))
        finally:
            if self.scheduler.burst is not None:  # a read failed: the burst closes with it
                self.scheduler.on(ReadEnded(self.clock(), None))
        log.info("idle_burst", chunks=chunks, gpu_ms=burst.spent_us / 1000 if burst is not None else 0.0,
                 wall_ms=round((self.clock() - opened) * 1e3, 3))
        return chunks
