"""The scheduler: what the engine runs next, from events and `now`. One copy for the conductor and the replay.

    event (with now)                         action
    ----------------                         ------
    RoundDue(waiting, reading, running)  ->  OpenTurn(key) | RunRound(plan) | Nothing      (the round loop)
    RoundEnded(turns, backlogs)          ->  ReadPlan(RATION, ...) | Nothing(until)        (between two rounds)
    IdlePoll(busy, has_work)             ->  OpenIdle | Nothing(until: the next look)
    IdleOpened(backlogs)                 ->  ReadPlan(IDLE, ...) | Nothing(until)          (the burst opens now)
    ReadEnded(stop, backlogs)            ->  ReadPlan(IDLE, next session) | Nothing(until) (a plan was carried out)
    Arrived / TurnEnded                  ->  Nothing(until: the idle window's next look)

The caller owns the turns and the sessions and hands the scheduler views of them with each event, so the
asyncio conductor (real time, the executors) and the replay (a virtual clock, the read model's costs) take the
same decisions from the same facts. The scheduler composes the core's rules and restates none of them:
`RoundPlanner` (admission, what a round takes), `TurnRation` (a slice between rounds), `IdleWindow`/`IdleBurst`
and `pick_idle_session` (the idle window). What it keeps between events is its own: the idle window's open
burst and its lattice of looks, and, per turn, the first moment a slice could open (so the ration's arithmetic
is skipped between rounds that cannot open one).

The chunk by chunk loop stays in `PlanDriver`: a `ReadPlan`'s decision (the burst, the slice) is asked before
every chunk, and a burst refuses the next chunk once a request waits, so an arriving request waits at most one
chunk (one chunk group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, NamedTuple, Sequence

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import Stop
from qse.core.idle import IdleBurst, IdleWindow, SessionBacklog, pick_idle_session
from qse.core.ledger import GpuLedger, Role
from qse.core.plan import ROLE_OF_WINDOW, Window, whole_chunks
from qse.core.ration import BusyShare, RationSlice, TurnRation
from qse.core.rounds import Prompt, RoundPlan, RoundPlanner, Running

# a slice's skip is kept this much short of the moment the core computed: below it, the whole microseconds
# elapsed cannot have reached it (the core rounds time to whole microseconds)
_SKIP_MARGIN_S = 2e-6


# ---- events -----------------------------------------------------------------------------------------------
class Busy(NamedTuple):
    """What keeps the idle window shut (IdleWindow.may_open)."""

    request_running: bool = False
    request_waiting: bool = False
    hold_on: bool = False
    box_locked: bool = False


class SliceView(NamedTuple):
    """A running turn as its slice between two rounds needs it (the caller builds one a round)."""

    key: Hashable  # the caller's handle on the turn
    turn_id: str  # the ledger's key: what the turn's role already spent
    session_id: str  # the reader's session the slice reads
    first_token_s: float | None  # the ration counts from here (None: no first token yet, no slice)
    committed_rows: int  # the reader's rows of the session
    known_tokens: int  # ids the slice may read up to (prompt and output so far; the narrator: the thought's end)
    resident: bool = True  # a parked session comes back in the idle window, never between two rounds


@dataclass(frozen=True)
class Arrived:
    now: float


@dataclass(frozen=True)
class RoundDue:
    """The round loop asks what to do next (after dropping departed turns)."""

    now: float
    waiting: Sequence[Prompt]
    reading: Sequence[Prompt]
    running: Sequence[Running]
    in_flight: bool = False  # a round launched ahead whose ids are not back yet


@dataclass(frozen=True)
class RoundEnded:
    """A round ended: the reader's slice of the turn that got its first token first may open, else the busy
    share's slice of the session in `backlogs` that comes first in `idle_read_order`: the sessions with no turn
    open (the caller gathers them only when `Scheduler.busy_may_open` says a slice is earned: a walk over the
    sessions)."""

    now: float
    turns: Sequence[SliceView]
    backlogs: Mapping[str, SessionBacklog] = field(default_factory=dict)


@dataclass(frozen=True)
class IdlePoll:
    now: float
    busy: Busy
    has_work: bool  # a whole chunk unread somewhere (or a question the reader stands at)


@dataclass(frozen=True)
class IdleOpened:
    """The window's locks are taken: the burst opens at `now`."""

    now: float
    backlogs: Mapping[str, SessionBacklog]


@dataclass(frozen=True)
class ReadEnded:
    """A ReadPlan was carried out; `stop` says why it ended (None: there was no whole chunk to read)."""

    now: float
    stop: Stop | None
    backlogs: Mapping[str, SessionBacklog] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnEnded:
    now: float
    turn_id: str


Event = Arrived | RoundDue | RoundEnded | IdlePoll | IdleOpened | ReadEnded | TurnEnded


# ---- actions ----------------------------------------------------------------------------------------------
class Nothing(NamedTuple):
    """Nothing to run; `until`: the first moment the answer may change (None: at the next event; inf: never)."""

    until: float | None = None


class OpenTurn(NamedTuple):
    """Open this waiting turn (its session's state ready, a slot reserved), then ask again."""

    key: Hashable


class RunRound(NamedTuple):
    plan: RoundPlan


class OpenIdle(NamedTuple):
    """The idle window may open: take its locks (never queueing), then report IdleOpened."""

    now: float


class ReadPlan(NamedTuple):
    """Read whole chunks of `session_id` while `decision` allows (PlanDriver asks it before every chunk)."""

    window: Window
    session_id: str
    decision: IdleBurst | RationSlice
    turn_id: str | None = None  # the turn charged (None in the idle window)
    key: Hashable = None  # the caller's handle on that turn

    def budget_ms(self, now: float) -> float:
        d = self.decision
        return (d.left_us(now) if isinstance(d, IdleBurst) else d.left_us) / 1000


Action = Nothing | OpenTurn | RunRound | OpenIdle | ReadPlan


class Scheduler:
    """The engine's next action, event by event. `estimator` and `ledger` are the caller's (it teaches and
    charges them as chunks are read); the scheduler only reads them."""

    def __init__(self, policy, estimator: ChunkCostEstimator, ledger: GpuLedger, *, max_running: int | None = None,
                 served_grid: int | None = None, reader_grid: int | None = None):
        """policy: qse.policy.Policy (or anything with its fields). max_running/served_grid: the served rounds'
        (default the policy's); reader_grid: the reader's (default the policy's; the caller sets `reader_grid`
        when another reader comes). The policy's idle_wake: the idle window looks the moment a turn ends (the
        runtime's when its round loop ends), else at the next look of its lattice."""
        self.idle = IdleWindow.of(policy)
        self.rations = {Window.RATION: TurnRation.reader(policy), Window.NARRATOR: TurnRation.narrator(policy)}
        self.busy = BusyShare.reader(policy)
        self.rounds = RoundPlanner(policy.max_running if max_running is None else max_running,
                                   policy.round_token_budget, policy.served_grid if served_grid is None else served_grid,
                                   policy.decode_yield_ms, policy.cut_rounds)
        self.estimator = estimator
        self.ledger = ledger
        self.reader_grid = policy.grid if reader_grid is None else reader_grid
        self.wake_on_end = bool(policy.idle_wake)
        self.read_order = policy.read_order  # whom the idle window and the busy share read next
        self.burst: IdleBurst | None = None  # the idle window's burst while it is open
        self.next_look_s: float | None = None  # the idle window's next look (its lattice)
        # (turn, window) -> ((session, spent us, next chunk's estimate), the first moment a slice could open)
        self._not_before: dict[tuple[str, Window], tuple[tuple, float]] = {}

    def on(self, event: Event) -> Action:
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"the scheduler knows no event {event!r}")
        return handler(self, event)

    # ---- the served rounds -------------------------------------------------------------------------------
    def _round_due(self, ev: RoundDue) -> Action:
        """Open the next admitted turn, else one round of every running turn and the opened prompts' pieces;
        Nothing once no turn waits, reads, runs or has ids in flight."""
        admit = self.rounds.admit(ev.waiting, len(ev.reading) + len(ev.running))
        if admit:
            return OpenTurn(admit[0])
        plan = self.rounds.plan(ev.running, ev.reading, ev.now)
        if ev.running or plan.reads or ev.in_flight:
            return RunRound(plan)
        return Nothing()

    def _round_ended(self, ev: RoundEnded) -> Action:
        """The reader's slice between two rounds goes to the running turn that got its first token first, when
        its ration opens one; else to the busy share (BusyShare), on the session first in `idle_read_order`."""
        started = [t for t in ev.turns if t.first_token_s is not None]
        action: Action = Nothing()
        if started:
            action = self.slice(Window.RATION, ev.now, min(started, key=lambda t: t.first_token_s))
            if isinstance(action, ReadPlan):
                return action
        busy = self._busy_slice(ev.now, ev.backlogs)
        return busy if isinstance(busy, ReadPlan) else action  # (the turn's ration says when it may open)

    def _served_and_spent_us(self) -> tuple[int, int]:
        """The served model's device time so far (prefill and decode) and the reader's between rounds."""
        spent = self.ledger.spent_us
        return ((spent(Role.SERVED_PREFILL) or 0) + (spent(Role.SERVED_DECODE) or 0),
                spent(ROLE_OF_WINDOW[Window.RATION]) or 0)

    def busy_may_open(self) -> bool:
        """Whether the busy share has earned a slice of the shortest size now (cheap: two ledger totals, none
        while the share is off)."""
        return self.busy.share > 0 and self.busy.may_open(*self._served_and_spent_us())

    def _busy_slice(self, now: float, backlogs: Mapping[str, SessionBacklog]) -> ReadPlan | Nothing:
        sid = pick_idle_session(backlogs, now, self.read_order)
        if sid is None:
            return Nothing()
        served_us, spent_us = self._served_and_spent_us()
        sl = self.busy.open_slice(now, served_us, spent_us, self.estimator.estimate_ms(backlogs[sid].committed_rows))
        return Nothing() if sl is None else ReadPlan(Window.RATION, sid, sl)

    def slice(self, window: Window, now: float, turn: SliceView) -> ReadPlan | Nothing:
        """A slice of `window`'s ration (the reader's, the narrator's) for `turn` between two rounds, if the next
        chunk's estimate fits what the turn earned. Nothing(until=None): no whole chunk to read (or none may be
        read now); Nothing(until=t): not before t (inf: never)."""
        if turn.first_token_s is None or not turn.resident:
            return Nothing()
        if whole_chunks(turn.committed_rows, turn.known_tokens, self.reader_grid) == 0:
            return Nothing()
        ration = self.rations[window]
        spent_us = self.ledger.spent_us(ROLE_OF_WINDOW[window], turn.turn_id) or 0
        est_ms = self.estimator.estimate_ms(turn.committed_rows)
        key = (turn.session_id, spent_us, est_ms)
        held = self._not_before.get((turn.turn_id, window))
        if held is not None and held[0] == key and now < held[1] - _SKIP_MARGIN_S:
            return Nothing(held[1])  # the allowance cannot have reached the next chunk's estimate yet
        sl = ration.open_slice(now, turn.first_token_s, spent_us, est_ms)
        if sl is None:
            earliest = ration.earliest_s(turn.first_token_s, spent_us, est_ms)
            until = math.inf if earliest is None else earliest
            self._not_before[(turn.turn_id, window)] = (key, until)
            return Nothing(until)
        return ReadPlan(window, turn.session_id, sl, turn.turn_id, turn.key)

    def summary_earned(self, now: float, turn: SliceView, est_ms: float) -> bool:
        """Whether the narrator's share of `turn` has earned a summary of `est_ms` now (the narrator's chunks
        read: what is left is the summary on a fork, charged to the same share)."""
        if turn.first_token_s is None:
            return False
        spent_us = self.ledger.spent_us(ROLE_OF_WINDOW[Window.NARRATOR], turn.turn_id) or 0
        return self.rations[Window.NARRATOR].open_slice(now, turn.first_token_s, spent_us, est_ms) is not None

    def _turn_ended(self, ev: TurnEnded) -> Action:
        for window in self.rations:
            self._not_before.pop((ev.turn_id, window), None)
        return self._look_after(ev.now)

    def _arrived(self, ev: Arrived) -> Action:
        if self.next_look_s is None:  # the idle window's lattice starts with the first request
            self.next_look_s = ev.now
        return Nothing(self.next_look_s)

    # ---- the idle window ---------------------------------------------------------------------------------
    def _look_after(self, now: float) -> Nothing:
        """The idle window's first look at or after `now` (the engine came free at `now`)."""
        if self.wake_on_end or self.next_look_s is None:
            return Nothing(now)
        return Nothing(self.idle.first_poll_at_or_after(self.next_look_s, now))

    def idle_may_look(self, busy: Busy) -> bool:
        """Whether the idle window could open now, work aside: the caller looks for work (a safe point, the
        sessions' backlogs) only then, and reports the look as IdlePoll either way."""
        return self.burst is None and self.idle.may_open(**busy._asdict())

    def _idle_poll(self, ev: IdlePoll) -> Action:
        if ev.has_work and self.idle_may_look(ev.busy):
            return OpenIdle(ev.now)
        self.next_look_s = self.idle.next_poll_s(ev.now)
        return Nothing(self.next_look_s)

    def _idle_opened(self, ev: IdleOpened) -> Action:
        self.burst = self.idle.open(ev.now)
        return self._next_idle_read(ev.now, ev.backlogs)

    def _read_ended(self, ev: ReadEnded) -> Action:
        if self.burst is None:  # a slice between two rounds: the round loop goes on
            return Nothing()
        if ev.stop is Stop.BACKLOG:  # that session is read: the next one, in the same burst
            return self._next_idle_read(ev.now, ev.backlogs)
        if ev.stop is Stop.BUDGET:
            # the burst is spent, nobody waits: the next look comes at once (a safe point between two bursts),
            # not a poll later, which left the device idle for up to a poll in every long idle window
            self.burst = None
            self.next_look_s = ev.now
            return Nothing(ev.now)
        return self._close_burst(ev.now)  # a request waits, or a chunk was not recorded

    def _next_idle_read(self, now: float, backlogs: Mapping[str, SessionBacklog]) -> Action:
        sid = pick_idle_session(backlogs, now, self.read_order)
        if sid is None:
            return self._close_burst(now)
        assert self.burst is not None
        return ReadPlan(Window.IDLE, sid, self.burst)

    def _close_burst(self, now: float) -> Nothing:
        self.burst = None
        self.next_look_s = self.idle.next_poll_s(now)
        return Nothing(self.next_look_s)


_HANDLERS = {RoundDue: Scheduler._round_due, RoundEnded: Scheduler._round_ended, IdlePoll: Scheduler._idle_poll,
             IdleOpened: Scheduler._idle_opened, ReadEnded: Scheduler._read_ended, TurnEnded: Scheduler._turn_ended,
             Arrived: Scheduler._arrived}
