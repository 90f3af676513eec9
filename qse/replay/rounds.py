"""The served model's rounds on a virtual clock, decided by the conductor's own planner (qse/core/rounds.py).

Requests of a usage ledger that overlap in time share rounds as they do in the server: each round the planner
admits waiting turns up to `max_running`, decodes every running turn in one batched forward and reads
`round_token_budget` ids of the opened prompts in whole grid chunks and tails. A round costs the decode at its
batch size (`DecodeCost`) plus its pieces at the read model's cost (a chunk at its context, a tail as its share
of a chunk), and a turn's tokens come at the ends of its rounds. A session's next turn waits for the one before
(one turn a session at a time, as the conductor's session lock). Not modelled here: the reader's slices between
rounds. With `launch_ahead` (the conductor's, where every running turn samples on the device) a round's ids
come back with the next round, so a turn holds its slot one round past its last decode, as in the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from qse.core.rounds import Prompt, RoundPlan, RoundPlanner, Running, chunks_before_tail
from qse.replay.read_model import ReadModel
from qse.replay.usage import UsageRecord


@dataclass(frozen=True)
class DecodeCost:
    """A batched decode round's device ms: `base_ms` (the weights read once) + `per_sequence_ms` a turn in it."""

    base_ms: float
    per_sequence_ms: float = 0.0

    def ms(self, batch: int) -> float:
        return self.base_ms + self.per_sequence_ms * batch


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

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.record.arrival_s

    @property
    def tokens_per_s(self) -> float | None:
        """Its output ids over its wall time, arrival to end (the prefill included)."""
        if self.end_s is None or self.end_s <= self.record.arrival_s:
            return None
        return self.ids / (self.end_s - self.record.arrival_s)


@dataclass
class RoundsResult:
    turns: list[ServedTurn]
    plans: list[tuple[float, RoundPlan]] = field(default_factory=list)  # (round start s, plan), keys: turn index

    def report(self) -> dict:
        return {"num_rounds": len(self.plans),
                "turns": [{"session": t.record.session, "arrival_s": t.record.arrival_s, "ttft_s": t.ttft_s,
                           "tokens_per_s": t.tokens_per_s, "output_tokens": t.ids} for t in self.turns]}


def simulate_rounds(records: Iterable[UsageRecord], planner: RoundPlanner, read_model: ReadModel,
                    decode: DecodeCost, launch_ahead: bool = False) -> RoundsResult:
    """Replay `records` (in arrival order; a record's `cached_tokens` whole grid chunks are taken as reused)
    through `planner`'s rounds. Turn keys in the plans are the records' indices in arrival order."""
    grid = planner.grid
    recs = sorted(records, key=lambda r: r.arrival_s)
    turns = []
    for no, rec in enumerate(recs):
        cached = (min(rec.cached_tokens, rec.prompt_tokens - 1) // grid) * grid
        turns.append(ServedTurn(rec, no, rec.prompt_tokens - cached, cached, rec.arrival_s))
    last_of_session: dict[str, int] = {}
    blocked: dict[int, int] = {}  # turn -> the turn of its session it waits for
    for i, t in enumerate(turns):
        if t.record.session in last_of_session:
            blocked[i] = last_of_session[t.record.session]
        last_of_session[t.record.session] = i
    pending = list(range(len(turns)))  # not yet in the queue
    waiting: list[int] = []
    reading: list[int] = []
    running: list[int] = []
    result = RoundsResult(turns)
    now = 0.0 if not turns else turns[0].ready_s

    def prompt(i: int) -> Prompt:
        t = turns[i]
        return Prompt(i, t.arrival_no, t.unread_tokens, t.overtaken, t.chunks_left)

    while pending or waiting or reading or running:  # (a turn with an id in flight is still running)
        for i in [i for i in pending if i not in blocked and turns[i].ready_s <= now]:
            pending.remove(i)
            waiting.append(i)
        if not (waiting or reading or running):  # idle until the next turn can join
            now = max(now, min(turns[i].ready_s for i in pending if i not in blocked))
            continue
        for i in planner.admit([prompt(i) for i in waiting], len(reading) + len(running)):
            waiting.remove(i)
            turns[i].chunks_left = chunks_before_tail(turns[i].unread_tokens, grid)
            reading.append(i)
        plan = planner.plan([Running(i, turns[i].record.output_tokens - turns[i].ids - turns[i].in_flight)
                             for i in running],
                            [prompt(i) for i in reading])
        cost_ms = decode.ms(len(plan.decode)) if plan.decode else 0.0
        for read in plan.reads:
            t = turns[read.key]
            for _ in range(read.chunks):
                cost_ms += read_model.ms_per_chunk(t.row, grid)
                t.row += grid
            if read.tail:
                cost_ms += read_model.ms_per_chunk(t.row, grid) * (t.unread_tokens - read.chunks * grid) / grid
        result.plans.append((now, plan))
        now += cost_ms / 1000
        ended = []
        for read in plan.reads:  # (the conductor hands out the first tokens before the round's decoded ids)
            t = turns[read.key]
            t.unread_tokens -= read.chunks * grid
            t.chunks_left -= read.chunks
            if read.tail:
                t.first_token_s, t.ids, t.unread_tokens = now, 1, 0
                reading.remove(read.key)
                running.append(read.key)
                for j in planner.overtaken(prompt(read.key), [prompt(j) for j in waiting + reading]):
                    turns[j].overtaken += 1
        for i in running:  # the round launched ahead last time comes back with this one
            turns[i].ids += turns[i].in_flight
            turns[i].in_flight = 0
        for i in plan.decode:
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
            for j, k in list(blocked.items()):
                if k == i:
                    del blocked[j]
                    turns[j].ready_s = max(turns[j].ready_s, now)
    return result

