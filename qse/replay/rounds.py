"""The served model's rounds on a virtual clock, decided by the conductor's own scheduler (qse/core/scheduler.py).

Requests of a usage ledger that overlap in time share rounds as they do in the server: the scheduler opens
waiting turns up to `max_running`, and each round decodes every running turn in one batched forward and reads
`round_token_budget` ids of the opened prompts in whole grid chunks and tails. A round costs the decode at its
batch size (`DecodeCost`) plus its pieces at the read model's cost (a chunk at its context, a tail as its share
of a chunk), and a turn's tokens come at the ends of its rounds, its first token when its tail is read
(`first_token_early`, as the conductor sends it; else at the end of that round). With `cut_rounds` a round stops
before a piece where a turn that arrived meanwhile goes first (RoundPlanner.cuts_before). A session's next turn
waits for the one before (one turn a session at a time, as the conductor's session lock).

With a `ReaderCost` the reader is there too, in its idle window: each turn's start teaches it the prompt (rolled
back to the grid line at or below the ids the prompt keeps of the session's, as the reader's checkpoints allow
at best), each turn's end the output, and while no turn waits, reads or runs the scheduler's idle window reads
the sessions' whole chunks in its order (QSE_SHADOW_READ_ORDER), from its first look (the moment the engine
comes free with QSE_SHADOW_IDLE_WAKE, else its poll lattice) until a turn joins; that turn waits for the chunk in
flight. Each follow-up's start says how far behind the reader was (its freshness). Not modelled: the reader's
slices between rounds (the per-session replay in simulator.py has them; under many agents' short turns they
are a small share).

With `launch_ahead` (the conductor's, where every running turn samples on the device) a round's ids come back
with the next round, so a turn holds its slot one round past its last decode, as in the server.

Rounds that only decode the same turns, with nothing waiting or being read, are the same decision each time:
they are run as one stretch up to the next arrival or the first turn's last id (a replay of a day of traffic has
millions of them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import PlanDriver, Stop
from qse.core.idle import SessionBacklog
from qse.core.ledger import GpuLedger
from qse.core.plan import Window, group_size, plan_read
from qse.core.rounds import Prompt, Read, RoundPlan, Running, chunks_before_tail
from qse.core.scheduler import (Arrived, Busy, IdleOpened, IdlePoll, Nothing, OpenIdle, OpenTurn, ReadEnded, ReadPlan,
                                RoundDue, Scheduler, TurnEnded)
from qse.replay.read_model import ReadModel, group_share
from qse.replay.usage import UsageRecord


@dataclass(frozen=True)
class DecodeCost:
    """A batched decode round's device ms: `base_ms` (the weights read once) + `per_sequence_ms` a turn in it."""

    base_ms: float
    per_sequence_ms: float = 0.0

    def ms(self, batch: int) -> float:
        return self.base_ms + self.per_sequence_ms * batch


@dataclass(frozen=True)
class ReaderCost:
    """The reader's chunk in the idle window: its device ms by context (`model`, at the reader's grid; inside a
    chunk group, the policy's idle_group, its share by read_model.group_share) and the host's ms around each
    launch (the launch, the readback: wall time the device does not see)."""

    model: ReadModel
    host_ms: float = 0.0


class _Reader:
    """The reader's sessions on the virtual clock, read in the scheduler's idle window through the runtime's own
    PlanDriver (as simulator.py reads one session)."""

    def __init__(self, cost: ReaderCost, sched: Scheduler, grid: int, group: int = 1):
        self.cost, self.sched, self.grid, self.group = cost, sched, grid, group
        self.estimator = ChunkCostEstimator(cost.model.ms_per_chunk(0, grid))
        self.sessions: dict[str, list[int]] = {}  # session -> [ids known, rows read]
        self.prompt_lines: dict[str, int] = {}  # session -> its prompt end's grid line (a group ends there)
        self.unread_since: dict[str, float] = {}
        self.first_look_s: float | None = None  # the idle window's first look once the engine is free
        self.now = 0.0  # the virtual clock while the window reads
        self.chunks = 0
        self.device_ms = 0.0

    def _note(self, sid: str, now: float) -> None:
        known, read = self.sessions[sid]
        if known - read >= self.grid:
            self.unread_since.setdefault(sid, now)
        else:
            self.unread_since.pop(sid, None)

    def backlogs(self) -> dict[str, SessionBacklog]:
        return {sid: SessionBacklog(self.unread_since[sid], (k - r) // self.grid, r)
                for sid, (k, r) in self.sessions.items() if sid in self.unread_since}

    def turn_start(self, rec: UsageRecord, now: float) -> int | None:
        """The prompt is known: ids behind at the start (None: the session's first turn)."""
        held = self.sessions.get(rec.session)
        behind, read = None, 0
        if held is not None:
            kept = min(rec.shared_prefix_tokens, held[0])
            read = held[1] if held[1] <= kept else (kept // self.grid) * self.grid
            behind = kept - read
        self.sessions[rec.session] = [rec.prompt_tokens, read]
        self.prompt_lines[rec.session] = (rec.prompt_tokens // self.grid) * self.grid
        self._note(rec.session, now)
        return behind

    def turn_end(self, rec: UsageRecord, turn_no: int, now: float) -> None:
        self.sessions[rec.session][0] += rec.output_tokens
        self._note(rec.session, now)
        action = self.sched.on(TurnEnded(now, f"t{turn_no}"))
        self.first_look_s = action.until if isinstance(action, Nothing) else now

    def launch(self, sid: str, row: int, chunks: int) -> tuple[float, int]:
        """One launch of `sid` from `row` (the pipe's): a chunk, or a group as the reader forms it (a power of
        two up to `chunks`, ending at the prompt's line); the clock moves by its device and host time."""
        count = group_size(row, chunks, self.grid, {self.prompt_lines[sid]}) if chunks > 1 else 1
        share = group_share(count)
        ms = sum(self.cost.model.ms_per_chunk(row + i * self.grid, self.grid) * share for i in range(count))
        self.now += (ms + self.cost.host_ms) / 1000
        self.chunks += count
        self.device_ms += ms
        return ms, count

    def idle(self, free_s: float, until_s: float) -> float:
        """Read from the window's first look after `free_s` while no turn joins (`until_s`, inf: none will);
        returns when the engine is free again (the launch in flight at `until_s` ends first)."""
        self.now = free_s if self.first_look_s is None else max(free_s, self.first_look_s)
        held = free_s
        driver = PlanDriver(estimator=self.estimator, ledger=self.sched.ledger, clock=lambda: self.now)
        while self.now < until_s:
            backlogs = self.backlogs()
            action = self.sched.on(IdlePoll(self.now, Busy(), bool(backlogs)))
            if not isinstance(action, OpenIdle):
                break  # nothing to read: nothing changes before a turn joins
            action = self.sched.on(IdleOpened(self.now, backlogs))
            while isinstance(action, ReadPlan):
                sid = action.session_id
                known, read = self.sessions[sid]
                plan = plan_read(Window.IDLE, session_id=sid, turn_id=None, committed_rows=read,
                                 prompt_tokens=self.prompt_lines[sid], known_tokens=known, grid=self.grid,
                                 budget_ms=action.budget_ms(self.now),
                                 first_chunk_est_ms=self.estimator.estimate_ms(read), group=self.group)
                stop = Stop.BACKLOG
                if plan is not None:
                    res = driver.run(plan, action.decision, _ReaderPipe(self, sid),
                                     request_waiting=lambda: self.now >= until_s)
                    self.sessions[sid][1], stop = res.end_row, res.stop
                self._note(sid, self.now)
                held = max(held, self.now)
                action = self.sched.on(ReadEnded(self.now, stop, self.backlogs()))
            self.now = action.until if isinstance(action, Nothing) and action.until is not None else until_s
        self.first_look_s = None
        return held


class _ReaderPipe:
    """PlanDriver's chunks of one session on the virtual clock (each launch read, and timed, at once)."""

    can_group = True
    reads_at_launch = True

    def __init__(self, reader: _Reader, session_id: str):
        self.reader, self.session_id = reader, session_id

    def launch(self, row: int, chunks: int) -> tuple[float, int]:
        return self.reader.launch(self.session_id, row, chunks)

    def finish(self, handle: float) -> float:
        return handle


@dataclass
class ServedTurn:
    """One request's served turn on the virtual clock (seconds)."""

    record: UsageRecord
    arrival_no: int
    unread_tokens: int  # prompt ids left to read before the first token
    row: int  # the committed row the next chunk reads above (its context)
    ready_s: float  # when it joins the queue: its arrival, or its session's previous turn's end
    overtaken: int = 0
    chunks_left: int | None = None  # set when it opens
    first_token_s: float | None = None
    end_s: float | None = None
    ids: int = 0  # ids it has
    in_flight: int = 0  # ids of a round launched ahead, not back yet
    last_round_s: float = float("-inf")  # its last round's start, or its first token (the decode yield)
    reader_behind_tokens: int | None = None  # with a reader: its ids unread at the turn's start (None: a first turn)
    last_id_s: float | None = None  # when its last id came back (the inter-token gaps)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.record.arrival_s

    @property
    def tokens_per_s(self) -> float | None:
        """Its output ids over its wall time, arrival to end (the prefill included)."""
        if self.end_s is None or self.end_s <= self.record.arrival_s:
            return None
        return self.ids / (self.end_s - self.record.arrival_s)


def _dist(values: list[float]) -> dict:
    ordered = sorted(values)

    def pct(p: float) -> float | None:
        return ordered[max(1, -(-len(ordered) * p // 100)) - 1] if ordered else None

    return {"n": len(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99), "max": ordered[-1] if ordered else None}


@dataclass
class RoundsResult:
    turns: list[ServedTurn]
    # (round start s, plan), keys: turn index; only where simulate_rounds was asked to keep them
    plans: list[tuple[float, RoundPlan]] = field(default_factory=list)
    num_rounds: int = 0
    reader_chunks: int = 0  # with a reader: the chunks its idle windows read, and their device ms
    reader_device_ms: float = 0.0
    # with keep_gaps: every gap between two ids of a turn (s), its first token's to its second's included
    itl_s: list[float] = field(default_factory=list)

    def report(self) -> dict:
        return {"num_rounds": self.num_rounds,
                "turns": [{"session": t.record.session, "arrival_s": t.record.arrival_s, "ttft_s": t.ttft_s,
                           "tokens_per_s": t.tokens_per_s, "output_tokens": t.ids} for t in self.turns]}

    def summary(self) -> dict:
        """The served turns under rounds: time to the first token, each turn's tokens/s, and all turns' ids over
        the wall time from the first arrival to the last end."""
        ended = [t for t in self.turns if t.end_s is not None]
        span = (max(t.end_s for t in ended) - min(t.record.arrival_s for t in self.turns)) if ended else 0.0
        return {"num_rounds": self.num_rounds, "num_turns": len(self.turns),
                "ttft_s": _dist([t.ttft_s for t in self.turns if t.ttft_s is not None]),
                "tokens_per_s": _dist([t.tokens_per_s for t in ended if t.tokens_per_s is not None]),
                "aggregate_tokens_per_s": (sum(t.ids for t in ended) / span) if span > 0 else None}


class _Views:
    """The queue's turns as the scheduler sees them, built only if it looks (it does not while every slot is
    taken: a replay of an overloaded hour keeps thousands waiting)."""

    def __init__(self, keys: list[int], view: Callable[[int], Prompt]):
        self.keys, self.view = keys, view

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[Prompt]:
        return map(self.view, self.keys)


def simulate_rounds(records: Iterable[UsageRecord], policy, read_model: ReadModel, decode: DecodeCost,
                    keep_plans: bool = True, tail_ms: float = 0.0, reader: ReaderCost | None = None,
                    keep_gaps: bool = False) -> RoundsResult:
    """Replay `records` (in arrival order; a record's `cached_tokens` whole grid chunks are taken as reused)
    through the scheduler's rounds as `policy` (qse.policy.Policy: max_running, round_token_budget, served_grid,
    launch_ahead, decode_yield_ms) sets them. Turn keys in the plans are the records' indices in arrival order.
    tail_ms: a tail's fixed cost on top of its rows' share of a chunk (the served model reads its tail outside
    the chunks' graphs, so a tail of a few ids costs about as much as one of a few hundred). reader: the reader's
    idle window too (the module's docstring; the policy's grid, read_order, idle_wake, idle_poll_s, idle_burst_s,
    idle_group); a record's shared_prefix_tokens are then the ids it keeps of its session's before it. keep_gaps:
    the inter-token gaps too (RoundsResult.itl_s: what a decode yield costs the streams)."""
    # the rounds need neither the estimator nor the ledger (they are the reader's)
    sched = Scheduler(policy, ChunkCostEstimator(policy.chunk_prior_ms), GpuLedger())
    planner, grid, launch_ahead = sched.rounds, policy.served_grid, policy.launch_ahead
    recs = sorted(records, key=lambda r: r.arrival_s)
    turns = []
    for no, rec in enumerate(recs):
        cached = (min(rec.cached_tokens, rec.prompt_tokens - 1) // grid) * grid
        turns.append(ServedTurn(rec, no, rec.prompt_tokens - cached, cached, rec.arrival_s))
    after: dict[int, int] = {}  # turn -> the next turn of its session (it joins when this one ends)
    last_of_session: dict[str, int] = {}
    ready: list[tuple[float, int]] = []  # (when it may join the queue, turn): not yet in the queue
    for i, t in enumerate(turns):
        if t.record.session in last_of_session:
            after[last_of_session[t.record.session]] = i
        else:
            ready.append((t.ready_s, i))
        last_of_session[t.record.session] = i
    heapq.heapify(ready)
    waiting: list[int] = []
    reading: list[int] = []
    running: list[int] = []
    result = RoundsResult(turns)
    now = 0.0 if not turns else turns[0].ready_s
    shadow = _Reader(reader, sched, policy.grid, policy.idle_group) if reader is not None else None
    if shadow is not None and turns:
        sched.on(Arrived(turns[0].record.arrival_s))  # the idle window's lattice starts with the first request

    def prompt(i: int) -> Prompt:
        t = turns[i]
        return Prompt(i, t.arrival_no, t.unread_tokens, t.overtaken, t.chunks_left)

    def ids_to_launch(i: int) -> int:
        return turns[i].record.output_tokens - turns[i].ids - turns[i].in_flight

    def note(plan: RoundPlan) -> None:
        result.num_rounds += 1
        if keep_plans:
            result.plans.append((now, plan))

    def came(i: int, at: float, count: int = 1, every_s: float = 0.0) -> None:
        """`count` ids of turn i were decoded, the last by `at`, `every_s` apart (a stretch of equal rounds): a
        launched-ahead round's ids are read back as the next one runs, so they reach the stream at its end too."""
        t = turns[i]
        if keep_gaps and t.last_id_s is not None and count > 0:
            first = at - (count - 1) * every_s
            result.itl_s.append(first - t.last_id_s)
            result.itl_s.extend([every_s] * (count - 1))
        if count > 0:
            t.last_id_s = at

    while ready or waiting or reading or running:  # (a turn with an id in flight is still running)
        while ready and ready[0][0] <= now:
            waiting.append(heapq.heappop(ready)[1])
        if not (waiting or reading or running):  # idle until the next turn can join
            if shadow is not None:
                now = shadow.idle(now, ready[0][0])
            now = max(now, ready[0][0])
            continue
        action = sched.on(RoundDue(now, _Views(waiting, prompt), [prompt(i) for i in reading],
                                   [Running(i, ids_to_launch(i), turns[i].last_round_s) for i in running],
                                   any(turns[i].in_flight for i in running)))
        if isinstance(action, OpenTurn):
            i = action.key
            waiting.remove(i)
            if shadow is not None:
                turns[i].reader_behind_tokens = shadow.turn_start(turns[i].record, now)
            turns[i].chunks_left = chunks_before_tail(turns[i].unread_tokens, grid)
            reading.append(i)
            continue
        if isinstance(action, Nothing):  # (nothing waits, reads or runs: the loop above ends first)
            break
        plan = action.plan
        cost_ms = decode.ms(len(plan.decode)) if plan.decode else 0.0
        stretch = min((ids_to_launch(i) for i in running), default=0) - 1
        if not (waiting or reading or plan.reads) and stretch >= 2 and len(plan.decode) == len(running):
            # the same decode round until a turn joins the queue or one has its last id to launch
            done = 0
            while done < stretch and not (ready and ready[0][0] <= now):
                note(plan)
                now += cost_ms / 1000
                done += 1
            for i in running:
                t = turns[i]
                t.last_round_s = now - cost_ms / 1000  # the last of the stretch's rounds started then
                if launch_ahead:
                    t.ids, t.in_flight = t.ids + t.in_flight + done - 1, 1
                else:
                    t.ids += done
                came(i, now, done, cost_ms / 1000)
            continue
        for i in plan.decode:
            turns[i].last_round_s = now
        tail_read_s: dict[int, float] = {}  # when each tail of the round was read (its first token then, if early)
        done: list[Read] = []  # the pieces the round read (fewer than planned where it was cut)
        num_busy = len(reading) + len(running)

        def cut(i: int, got: int) -> bool:
            """Whether the round stops before turn i's next piece, `got` of its chunks read this round (the
            planner's rule: a turn that joined the queue by then goes first)."""
            at, t = now + cost_ms / 1000, turns[i]
            if not planner.cut_rounds or not (done or got) or not ready or ready[0][0] > at:  # (none joined yet)
                return False
            piece = Prompt(i, t.arrival_no, t.unread_tokens - got * grid, t.overtaken, t.chunks_left - got)
            return planner.cuts_before(piece, [prompt(j) for s, j in ready if s <= at], num_busy)

        for read in plan.reads:
            t = turns[read.key]
            got, stopped = 0, False
            while got < read.chunks and not (stopped := cut(read.key, got)):
                cost_ms += read_model.ms_per_chunk(t.row, grid)
                t.row += grid
                got += 1
            tail = read.tail and not stopped and not (stopped := cut(read.key, got))
            if tail:
                cost_ms += tail_ms + read_model.ms_per_chunk(t.row, grid) * (t.unread_tokens - got * grid) / grid
                tail_read_s[read.key] = now + cost_ms / 1000
            if got or tail:
                done.append(Read(read.key, got, tail))
            if stopped:
                break
        plan = RoundPlan(plan.decode, tuple(done))
        note(plan)
        now += cost_ms / 1000
        ended = []
        for read in plan.reads:  # (the conductor hands out the first tokens before the round's decoded ids)
            t = turns[read.key]
            t.unread_tokens -= read.chunks * grid
            t.chunks_left -= read.chunks
            if read.tail:
                first_s = tail_read_s[read.key] if policy.first_token_early else now
                t.first_token_s, t.ids, t.unread_tokens = first_s, 1, 0
                t.last_round_s, t.last_id_s = now, first_s
                reading.remove(read.key)
                running.append(read.key)
                for j in planner.overtaken(prompt(read.key), _Views(waiting + reading, prompt)):
                    turns[j].overtaken += 1
        for i in running:  # the round launched ahead last time comes back with this one
            turns[i].ids += turns[i].in_flight
            turns[i].in_flight = 0
        for i in plan.decode:
            came(i, now)
            if launch_ahead:
                turns[i].in_flight = 1
            else:
                turns[i].ids += 1
        for i in list(running):
            if turns[i].ids >= max(1, turns[i].record.output_tokens):
                running.remove(i)
                ended.append(i)
        for i in ended:
            turns[i].end_s = now
            if shadow is not None:
                shadow.turn_end(turns[i].record, i, now)
            if i in after:
                j = after[i]
                turns[j].ready_s = max(turns[j].ready_s, now)
                heapq.heappush(ready, (turns[j].ready_s, j))
    if shadow is not None:
        shadow.idle(now, float("inf"))  # after the last turn: the backlogs read (nothing waits for them)
        result.reader_chunks, result.reader_device_ms = shadow.chunks, shadow.device_ms
    return result

