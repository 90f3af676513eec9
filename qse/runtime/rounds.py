"""The served model's round loop: turns wait, open, are read a few chunks a round, decode together, end.

The loop asks the scheduler (qse/core/scheduler.py: RoundDue) what to do next and carries it out on the served
model's thread: open a turn (its slot, the served session's state back), or run a round (one batched decode of
every running turn, then the planned prompt pieces), then the reader's slice between rounds
(qse/runtime/windows.py). A round whose turns all sample on the device is launched ahead (`LaunchedAhead`): its
ids come back in the next round's hop. A mixin of `Conductor`: the queues it moves turns between are the
conductor's.

Speculative decoding (QSE_SPECULATE): a round where a turn looks for drafts waits for its ids; its proposals are
the turns' own lookups (ngram) or the MTP head's drafts (mtp: the head follows every round of the running turns,
`ServedSessions.follow_round`, and a turn's first drafts come with its first token, `start_drafts`); then one
planner, verify, keep and sampler path for both.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable, NamedTuple

import structlog
import torch

from ..core.ledger import Role
from ..core.locks import HeldLocks, Priority
from ..core.rounds import Read, RoundPlan
from ..core.scheduler import Arrived, OpenTurn, RoundDue, RunRound
from ..engine.sampling import Sampler
from ..engine.turn_drafts import TurnDrafts
from ..sessions.served import LaunchedRound
from .executor import landed
from .turn import END, ConductorStopped, GenerateRequest, RoundEntry, Turn

log = structlog.get_logger("qse.conductor")  # one logger for the conductor's modules: its events keep their name


class LaunchedAhead(NamedTuple):
    """The round launched ahead, whose ids are read back in the next round's hop."""

    batch: list[RoundEntry]  # its turns, in its rows' order
    launch: LaunchedRound


class RoundLoop:
    """The served turns, in rounds."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[int]:
        """Stream the served model's token ids for one request; the reader follows the turn. The turn waits for
        the round loop, which reads its prompt a few grid chunks a round beside the running turns' decode, then
        decodes it with every other running turn, one batched round a token. Closing the generator ends the
        turn at the next round."""
        arrival = self.clock()
        self.scheduler.on(Arrived(arrival))
        self._check_prompt(req.prompt_ids)
        self._refuse_if_stopped()
        session_id = self.map_session(req.prompt_ids, req.session_id) or f"s-{uuid.uuid4().hex[:16]}"
        turn = Turn(req, f"{req.request_id}#{next(self._turn_seq)}", session_id, arrival,
                     self._shared_prefix(session_id, req.prompt_ids))
        lock = self._session_locks.setdefault(session_id, asyncio.Lock())
        async with lock:  # one turn a session at a time: the next one starts from what this one kept
            entry = RoundEntry(turn, asyncio.Queue(), asyncio.get_running_loop().create_future(),
                             arrival_no=next(self._arrivals),
                             unread_tokens=self.serving.unread_estimate(session_id, req.prompt_ids))
            self._waiting.append(entry)
            self._joined = (*self._joined, entry)
            self._waiting_changed.set()
            self._kick_rounds()
            try:
                while True:
                    item = await entry.out.get()
                    if item is END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                entry.closed = True  # the loop ends the turn at its next round (or drops it from the queue)
                await asyncio.shield(entry.done)

    @property
    def num_waiting(self) -> int:
        """Turns queued for the round loop (not yet started)."""
        return len(self._waiting)

    async def wait_for_waiting(self, count: int) -> None:
        """Until at least `count` turns are queued for the round loop (tests order tasks with this)."""
        while len(self._waiting) < count:
            self._waiting_changed.clear()
            await self._waiting_changed.wait()

    async def rounds_ended(self) -> None:
        """Until the round loop has nothing left (a round launched past a turn's end included)."""
        while self._round_task is not None:
            await asyncio.shield(self._round_task)

    def _kick_rounds(self) -> None:
        if self._round_task is None:
            self._round_task = asyncio.create_task(self._round_loop(), name="qse-rounds")

    async def _round_loop(self) -> None:
        """Ask, do, report: the scheduler opens waiting turns while slots are free, then runs one round (a batched
        decode of every running turn and the next pieces of the prompts being read), then each turn's token (a
        first token when its prompt's tail was read), then the reader's slice between rounds. The engine is held
        while any turn runs, reads or waits (the idle window and the questions wait for the loop to end)."""
        try:
            async with self.board.engine_lock(Priority.SERVED, HeldLocks()):
                while True:
                    await self._drop_departed()
                    # a turn whose served state is only in a file is weighed once its load (beside the rounds)
                    # has landed: it then opens with a host copy, and no round waits for a file read
                    loads = await self._prefetch_waiting()
                    ready = [e.prompt() for e in self._waiting if self.serving.is_ready(e.turn.session_id)]
                    action = self.scheduler.on(RoundDue(
                        self.clock(), ready, [e.prompt() for e in self._reading],
                        [e.running() for e in self._running], self._in_flight is not None))
                    if isinstance(action, OpenTurn):
                        self._waiting.remove(action.key)
                        await self._start_turn(action.key)
                    elif isinstance(action, RunRound):
                        await self._round(action.plan)
                        await self._between_rounds()
                    elif loads:  # nothing runs and the waiting turns' states are loading
                        await self._until_loaded(loads)
                    elif not self._waiting:
                        break
                # no await between the last look at the queues and this: a turn that arrives now starts a loop
                self._round_task = None
            self._engine_freed()
        finally:
            self._round_task = None
            for entry in list(self._waiting) + self._reading + self._running:  # the loop died: nobody waits forever
                if not entry.done.done():
                    entry.out.put_nowait(ConductorStopped("the served model's round loop stopped"))
                    entry.done.set_result(None)
            self._waiting.clear()
            self._reading.clear()
            self._running.clear()
            self._in_flight = None

    async def _drop_departed(self) -> None:
        """Turns whose clients left end now: queued ones unstarted, the others with their slots freed."""
        for entry in [e for e in self._waiting if e.departed()]:
            self._waiting.remove(entry)
            entry.turn.finish = entry.departed()
            await self._end(entry, started=False)
        for entry in [e for e in self._reading + self._running if e.departed()]:
            entry.turn.finish = entry.departed()
            await self._end(entry)

    async def _prefetch_waiting(self) -> list:
        """Waiting turns' sessions whose state is only in a file start loading, and finished loads land (one hop
        to the served thread, between rounds); the loads still in flight."""
        sids = [e.turn.session_id for e in self._waiting if not self.serving.is_ready(e.turn.session_id)]
        return await self.served_exec.run(self.serving.prefetch, sids) if sids else []

    async def _until_loaded(self, loads: list) -> None:
        """Nothing runs and the waiting turns' states are loading: until one load is done or a turn arrives."""
        self._waiting_changed.clear()  # (no await since the waiting turns were weighed: no arrival is missed)
        waits = [asyncio.ensure_future(landed(load)) for load in loads]
        waits.append(asyncio.ensure_future(self._waiting_changed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _start_turn(self, entry: "RoundEntry") -> None:
        """The turn opens: the reader learns the prompt, the served session reuses what it holds and reserves a
        slot; its prompt is read by the next rounds."""
        turn, req = entry.turn, entry.turn.req
        if entry.departed():  # the client left while it waited
            turn.finish = entry.departed()
            await self._end(entry, started=False)
            return
        if self._stopped:
            entry.out.put_nowait(ConductorStopped("the conductor is stopped (a planned stop); send the request "
                                                  "again after the restart"))
            await self._end(entry, started=False)
            return
        turn.start_s = self.clock()
        self.ledger.open_turn(turn.turn_id)
        try:
            await self._turn_start(turn)
            entry.seq = await self.served_exec.run(self.serving.open, turn.session_id, req.prompt_ids)
        except Exception as exc:
            entry.out.put_nowait(exc)
            await self._end(entry)
            return
        entry.sampler = Sampler(req.sampling, vocab_limit=self.served.chat.tokenizer.vocab_size)
        turn.cached_tokens, turn.cache_tier = entry.seq.start.cached_tokens, entry.seq.start.tier
        req.cached_tokens = entry.seq.start.cached_tokens
        self._reading.append(entry)

    async def _round(self, plan: RoundPlan) -> None:
        """One round in one hop to the served thread: a batched decode of the running turns, then the planned
        prompt reads, then the ids of the round launched ahead last time. Where every running turn samples on
        the device (launch_ahead), this round's ids stay on the device, feed the next round, and come back in
        the next hop: one hop a round, and the device never waits for the host between two rounds. A turn
        whose tail was read gets its first token."""
        batch = list(plan.decode)
        now = self.clock()
        for entry in batch:
            entry.last_round_s = now
        in_flight, self._in_flight = self._in_flight, None
        rows = {id(e): i for i, e in enumerate(in_flight.batch)} if in_flight is not None else {}
        carry = [rows.get(id(e), -1) if e.in_flight else -1 for e in batch]
        # a batch with turns that can verify drafts runs its rounds one at a time: the drafts follow the last ids,
        # which must be on the host (a round launched ahead keeps them on the device)
        planner = self.spec_planner
        bucket = self.serving.rounds.bucket(len(batch)) if batch else 0
        speculating = planner is not None and any(e.sampler.verifies and planner.looks(e.spec, bucket) for e in batch)
        # the MTP head drafts after the round for the next one: the widest draft where a turn looks now, else one
        # id where a turn will look next round (a head step reads the whole output head; a turn that stopped
        # looking tries again with one draft), else none (the head only reads the round's rows, for later drafts)
        if speculating or planner is None:
            draft_k = None  # (without a planner there is no head either: follow_round does nothing)
        else:
            draft_k = int(any(e.sampler.verifies and e.spec is not None and planner.looks_next(e.spec, bucket)
                              for e in batch))
        ahead = (not speculating and self.policy.launch_ahead and bool(batch)
                 and all(e.sampler.is_on_device for e in batch))
        spec = speculating and in_flight is None
        # the earlier round's samplers that take its ids (a grammar's matcher): those of turns still running
        takers = [e.sampler if e in self._running else None for e in in_flight.batch] if in_flight else []
        # a first token leaves the served thread as its tail is read, not with the round's other pieces after it
        loop = asyncio.get_running_loop()
        early = ((lambda e, token: loop.call_soon_threadsafe(self._send_first, e, token))
                 if self.policy.first_token_early else None)
        self._joined = ()  # (the queue as planned: a turn that joins from here on may cut the round)
        cut = self._round_cut(len(self._reading) + len(self._running)) if plan.reads else None
        try:
            launched, tokens, ms, reads, earlier, drafted = await self.served_exec.run(
                self._round_on_thread, batch, carry, ahead, plan.reads, in_flight.launch if in_flight else None, takers,
                spec, draft_k, early, cut)
        except Exception as exc:  # the round failed: every turn in it ends with the error
            for entry in batch + [r.key for r in plan.reads] + (in_flight.batch if in_flight else []):
                if not entry.done.done():
                    entry.out.put_nowait(exc)
                    await self._end(entry)
            return
        for entry, (read_ms, first, exc) in zip([r.key for r in plan.reads], reads):
            self.ledger.record(Role.SERVED_PREFILL, read_ms, turn_id=entry.turn.turn_id)
            if exc is not None:
                entry.out.put_nowait(exc)
                await self._end(entry)
            elif first is not None:
                await self._first_token(entry, first)
        if earlier is not None:
            ids, earlier_ms = earlier
            await self._decoded(in_flight.batch, [[t] for t in ids], earlier_ms)
        # a round that did not look for drafts (a round that wanted to, but drained one launched ahead first, is
        # not counted: the next one looks)
        if planner is not None and drafted is None and not speculating:
            for entry in batch:
                if entry.spec is not None:
                    planner.observe_turn(entry.spec, 0, 0)
        if launched is not None:
            for entry in batch:
                entry.in_flight = 1
            self._in_flight = LaunchedAhead(batch, launched)
        elif batch:
            if drafted is not None:
                self._spec_observed(batch, tokens, ms, drafted)
            await self._decoded(batch, tokens, ms)

    async def _decoded(self, batch: list["RoundEntry"], tokens: list[list[int]], ms: float) -> None:
        """A round's ids to its turns (one a turn, or a verify's accepted drafts and the id after them); a turn
        that ended since the round was launched drops its ids (a stop read one round late: its kept state is the
        prompt's grid line, never the rows above), and so does one that ends part way through its ids."""
        share = ms / len(batch)  # a round's device time, attributed evenly to its turns
        for entry, ids in zip(batch, tokens):
            entry.in_flight = 0
            if entry not in self._running:
                self.ledger.record(Role.SERVED_DECODE, share)
                continue
            self.ledger.record(Role.SERVED_DECODE, share, turn_id=entry.turn.turn_id)
            for token in ids:
                await self._emit(entry, token)
                if entry not in self._running:
                    break

    def _spec_observed(self, batch: list["RoundEntry"], tokens: list[list[int]], ms: float,
                       drafted: tuple[int, list[int]]) -> None:
        """What a round that could have verified cost and what its drafts earned, to the planner."""
        width, counts = drafted
        planner = self.spec_planner
        planner.observe_round(self.serving.rounds.bucket(len(batch)), width, ms)
        for entry, count, ids in zip(batch, counts, tokens):
            if entry.spec is not None:
                accepted = len(ids) - 1 if count else 0
                planner.observe_turn(entry.spec, count, accepted)
                turn = entry.turn
                turn.draft_tokens += count
                turn.accepted_draft_tokens += accepted
                turn.req.draft_tokens, turn.req.accepted_draft_tokens = turn.draft_tokens, turn.accepted_draft_tokens

    def _round_cut(self, num_busy: int) -> Callable[["RoundEntry"], bool] | None:
        """The round's cut, asked on the served thread before each of its pieces after the first (None: the
        policy does not cut rounds): whether a turn that joined the queue since the round was planned, with its
        state ready to open, goes before `entry`'s next piece (the planner's rule, RoundPlanner.cuts_before)."""
        planner, serving = self.scheduler.rounds, self.serving
        if not planner.cut_rounds:
            return None

        def cut(entry: "RoundEntry") -> bool:
            joined = [e.prompt() for e in self._joined if serving.is_ready(e.turn.session_id)]
            return bool(joined) and planner.cuts_before(entry.prompt(), joined, num_busy)

        return cut

    def _send_first(self, entry: "RoundEntry", token: int) -> None:
        """On the event loop, once a turn: its first token to its consumer (a stop id sends nothing: the turn ends
        after the round), stamped when it leaves. Called from the served thread as the tail is read (the
        round's other pieces still run), else by `_first_token` after the round."""
        if entry.first_sent:
            return
        entry.first_sent = True
        entry.turn.first_token_s = self.clock()
        if token not in entry.turn.req.stop_ids:
            entry.out.put_nowait(token)

    async def _first_token(self, entry: "RoundEntry", token: int) -> None:
        """After the round that read the turn's tail: the token sent (if it was not already), the turn running."""
        turn = entry.turn
        self._send_first(entry, token)
        entry.last_round_s = self.clock()
        self._reading.remove(entry)
        self._running.append(entry)
        if self.spec_planner is not None:
            entry.spec = self.spec_planner.new_turn(predicted=bool(turn.req.prediction_ids))
        behind = [e.prompt() for e in list(self._waiting) + self._reading]
        for other in self.scheduler.rounds.overtaken(entry.prompt(), behind):
            other.overtaken += 1  # (prefill_order's starvation bound)
        await self._emit(entry, token, sent=True)

    def _round_on_thread(self, batch: list["RoundEntry"], carry: list[int], ahead: bool,
                         plan: tuple[Read, ...], earlier: LaunchedRound | None, takers: list[Sampler | None],
                         spec: bool = False, draft_k: int | None = None,
                         early: Callable[["RoundEntry", int], Any] | None = None,
                         cut: Callable[["RoundEntry"], bool] | None = None):
        """The decode of `batch` (launched ahead, or sampled on the host and waited for), each planned read, then
        the earlier round's ids. Returns (the round launched ahead or None, the batch's ids when not ahead, their
        device ms, for each read (device ms, the first token if the tail was read, the error if it failed), the
        earlier round's (ids, device ms) or None). `early(entry, token)`: called with each first token as its tail
        is read (it hands the token to the event loop). `cut(entry)`: asked before each piece after the round's
        first; True stops the round's reads there (`_round_cut`): the planned reads not reached are not run.

        A grammar turn's next mask needs its last id on the host: where the earlier round holds one, its ids are
        read back between this round's forward and its sampling (the forward never waits for them; the matcher
        and the mask run on the host while the device runs the forward), each taker taking its row's id."""
        launched, tokens, ms, drafted = None, [], 0.0, None
        back: tuple[list[int], float] | None = None

        def take_earlier() -> None:
            nonlocal back
            if earlier is not None and back is None:
                back = earlier.finish()
                for sampler, token in zip(takers, back[0]):
                    if sampler is not None:
                        sampler.taken(token)

        take_first = any(s is not None and s.grammar is not None for s in takers)
        if batch:
            seqs, host_ids = [e.seq for e in batch], [0 if c >= 0 else e.token for e, c in zip(batch, carry)]
            if spec:  # (no round in flight: every turn's last id is on the host)
                tokens, ms, drafted = self._speculative_round(batch)
            elif ahead:
                launched = self.serving.launch_round(seqs, host_ids, carry, [e.sampler for e in batch],
                                                     between=take_earlier if take_first else None, draft_k=draft_k)
            else:
                logits, ms = self.serving.decode_round(seqs, host_ids, carry)
                if take_first:
                    take_earlier()
                tokens = [[e.sampler(logits[i])] for i, e in enumerate(batch)]
                self.serving.follow_round(seqs, [t[0] for t in tokens], k=draft_k)  # (launch_round's own: its k)
        reads = []
        for entry, chunks, tail in plan:
            seq = entry.seq
            if reads and cut is not None and cut(entry):
                log.info("round_cut", request_id=entry.turn.req.request_id, chunks_left=seq.chunks_left)
                break
            before = seq.start.gpu_ms
            try:
                if chunks:  # the last chunk is left running: the tail, or the next round, launches behind it
                    stop = (lambda e=entry: cut(e)) if cut is not None else None
                    self.serving.read_chunks(seq, chunks, hold_last=True, stop=stop)
                first = None
                if tail and seq.chunks_left == 0 and not ((reads or chunks) and cut is not None and cut(entry)):
                    first = self._read_tail(entry)  # (the round's first piece is never cut)
                    if early is not None:
                        early(entry, first)
                reads.append((seq.start.gpu_ms - before, first, None))
            except Exception as exc:
                self.serving.finish(seq)
                reads.append((seq.start.gpu_ms - before, None, exc))
        take_earlier()
        return launched, tokens, ms, reads, back, drafted

    def _proposals(self, batch: list["RoundEntry"]) -> list[list[int]]:
        """Each turn's drafts for this round ([] for a turn that cannot verify or does not look this round): the
        MTP head's after the turn's last round (QSE_SPECULATE=mtp: read back from the device), else its own
        lookups (TurnDrafts); cut where they would pass the turn's last id or leave the tokenizer's vocabulary
        (a head's argmax may pick a padding row of the model's vocabulary)."""
        planner, serving = self.spec_planner, self.serving
        bucket = serving.rounds.bucket(len(batch))
        looking = [e for e in batch if e.sampler.verifies and planner.looks(e.spec, bucket)]
        found = iter(serving.head_drafts([e.seq for e in looking]) if serving.mtp else
                     [self._looked_up(e) for e in looking])
        proposals: list[list[int]] = []
        for entry in batch:
            if entry not in looking:
                proposals.append([])
                continue
            turn, limit = entry.turn, entry.sampler.vocab_limit
            room = turn.req.max_tokens - len(turn.out_ids) - 1  # drafts past the turn's last id would be thrown away
            draft = next(found)[: max(0, room)]
            if limit is not None:
                draft = draft[: next((j for j, t in enumerate(draft) if not 0 <= t < limit), len(draft))]
            proposals.append(draft)
        return proposals

    def _looked_up(self, entry: "RoundEntry") -> list[int]:
        """The turn's drafts looked up in its prediction, prompt and output (QSE_SPECULATE=ngram)."""
        turn, req = entry.turn, entry.turn.req
        if entry.drafts is None:  # (its first round: the prompt's ids and the first token)
            entry.drafts = TurnDrafts(req.prompt_ids, self.spec_planner.max_draft, req.prediction_ids)
            entry.drafts.append(turn.out_ids)
        return entry.drafts.propose()

    def _speculative_round(self, batch: list["RoundEntry"]) -> tuple[list[list[int]], float, tuple[int, list[int]]]:
        """One round of turns some of which draft (on the served thread): each verifying turn's drafts (the MTP
        head's, or looked up), the planner's width for them (1: a plain round, where no verify pays), then the
        round, and each turn's ids: its accepted drafts and the id after them (a turn that cannot verify, or
        drafted nothing, one id as in a plain round); the head then follows the round. Returns (ids a turn,
        device ms, (width, ids drafted a turn))."""
        planner, serving = self.spec_planner, self.serving
        proposals = self._proposals(batch)
        seqs = [e.seq for e in batch]
        width = planner.choose(serving.rounds.bucket(len(batch)),
                               [(len(p), e.spec.alpha if e.spec is not None else 0.0) for e, p in zip(batch, proposals)])
        if width > 1 and not serving.can_verify(seqs, width):
            width = 1
        if width > 1:
            drafts = [p[: width - 1] for p in proposals]
            # every turn reads `width` rows; a short draft is padded with its own token (rows past it are not kept)
            rows = [[e.token, *d, *[e.token] * (width - 1 - len(d))] for e, d in zip(batch, drafts)]
            try:
                logits, ms = serving.verify_round(seqs, rows)
            except MemoryError:  # no pages for the drafts' rows (before any device work): one id a turn instead
                width = 1
        if width == 1:
            logits, ms = serving.decode_round(seqs, [e.token for e in batch])
            tokens = [[e.sampler(logits[i])] for i, e in enumerate(batch)]
            serving.follow_round(seqs, [t[0] for t in tokens])
            return tokens, ms, (1, [0] * len(batch))
        greedy = [i for i, e in enumerate(batch) if drafts[i] and e.sampler.verifies == "greedy"]
        picks: dict[int, list[int]] = {}
        if greedy:  # one argmax and one read back for every greedy turn (first maximum on ties, as alone)
            limit = batch[greedy[0]].sampler.vocab_limit
            index = torch.tensor(greedy, device=logits.device)
            picks = dict(zip(greedy, torch.argmax(logits.index_select(0, index)[..., :limit], dim=-1).tolist()))
        tokens, accepted = [], []
        for i, (entry, draft) in enumerate(zip(batch, drafts)):
            if not draft:
                ids = [entry.sampler(logits[i, 0])]
            elif i in picks:
                target, kept = picks[i], 0
                while kept < len(draft) and draft[kept] == target[kept]:
                    kept += 1
                ids = [*draft[:kept], target[kept]]
            else:
                ids = entry.sampler.verify(logits[i], draft)
            tokens.append(ids)
            accepted.append(len(ids) - 1)
        serving.keep_round(seqs, accepted)
        serving.follow_round(seqs, [ids[-1] for ids in tokens], accepted)
        return tokens, ms, (width, [len(d) for d in drafts])

    def _read_tail(self, entry: "RoundEntry") -> int:
        """The prompt's tail and the first token, on the served thread."""
        seq, req = entry.seq, entry.turn.req
        logits = self.serving.first_token(seq)
        try:
            token = entry.sampler(logits[-1])
            self.serving.start_drafts(seq, token)  # (the MTP head's rows of the tail, and its first drafts)
        except BaseException:
            self.serving.finish(seq)
            raise
        log.info("served_turn_start", session=seq.start.session_id, request_id=req.request_id, **{
            k: v for k, v in asdict(seq.start).items() if k != "session_id"})
        return token

    async def _emit(self, entry: "RoundEntry", token: int, sent: bool = False) -> None:
        """A sampled token: the turn's end (a stop id, or max_tokens reached after it), or the next round's input.
        sent: the consumer has it already (a first token, `_send_first`)."""
        turn, req = entry.turn, entry.turn.req
        if token in req.stop_ids:
            turn.finish = "stop"
            await self._end(entry)
            return
        turn.out_ids.append(token)
        if entry.drafts is not None:
            entry.drafts.append((token,))
        if not sent:
            entry.out.put_nowait(token)
        if len(turn.out_ids) >= req.max_tokens:
            turn.finish = "length"
            await self._end(entry)
            return
        entry.token = token

    async def _end(self, entry: "RoundEntry", started: bool = True) -> None:
        for queue in (self._reading, self._running):
            if entry in queue:
                queue.remove(entry)
        if started:
            if entry.seq is not None:
                held_ms = await self.served_exec.run(self.serving.finish, entry.seq)
                if held_ms:  # a chunk of its prompt it left running, read back as it ended
                    self.ledger.record(Role.SERVED_PREFILL, held_ms, turn_id=entry.turn.turn_id)
            await self._turn_end(entry.turn)
        entry.out.put_nowait(END)
        if not entry.done.done():
            entry.done.set_result(None)

    def served_session_rows(self) -> int | None:
        """The rows one served session can hold: the whole served KV pool (other sessions' pages are made room
        for), less one page a turn may hold above its rows while it decodes."""
        pool = self.serving.book.pool
        return max(0, (pool.num_pages - 1) * pool.page_rows)
