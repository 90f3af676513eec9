"""A served turn: its request, the conductor's records of it, and what happens at its start and end.

`GenerateRequest` is what a caller asks; `Turn` is what the conductor keeps of a turn between two rounds;
`RoundEntry` is the turn as the round loop holds it (its queue, its slot, its sampler), seen by the round
planner as a `Prompt` before its first token and as a `Running` turn after; `TurnRecord` is what a finished
turn reports (the usage ledger, the metrics). `TurnLifecycle` is the conductor's part at a turn's two ends:
the prompt checked and fed to the reader at the start, the output fed and the record emitted at the end.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

import structlog

from ..core.ids import first_outside, is_int_list
from ..core.ledger import Role
from ..core.prefix import common_prefix
from ..core.rounds import Prompt
from ..core.rounds import Running as RunningView
from ..core.scheduler import TurnEnded
from ..core.spec import SpecTurn
from ..engine.sampling import Sampler, SamplingParams
from ..engine.turn_drafts import TurnDrafts
from ..sessions.served import ServedTurn
from ..shadow.reader import ShadowError
from .narrator import Narration
from .reading import TurnIds

log = structlog.get_logger("qse.conductor")  # one logger for the conductor's modules: its events keep their name


class ConductorStopped(RuntimeError):
    """The conductor was stopped (a planned stop); the request was not run."""


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    session_id: str | None = None  # explicit (X-Session-Id); else mapped by longest common prefix
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    router_label: str | None = None  # the served router's own class for this turn, if a proxy passes it
    # written by the conductor when the turn starts (the server's usage reads it): prompt ids whose state the
    # served session reused
    cached_tokens: int | None = None
    # the live narrator (the profile's narrator on): called on the event loop with the summary of this turn's
    # thought, while the turn runs (qse/runtime/narrator.py); None: the turn is not narrated
    narrate: Callable[[Narration], None] | None = None
    # asked on the event loop before every round: why the turn must end now (the server's ticket: "abort" for a
    # client that left, "shutdown" past a stop's grace), or None. A turn whose consumer waits for its first
    # token cannot close the generator, and a long prompt read on for a client long gone (79k ids: 53 s)
    ended: Callable[[], str | None] | None = None
    # OpenAI's predicted output, as ids: drafts for speculative decoding (QSE_SPECULATE on), never output
    prediction_ids: tuple[int, ...] = ()
    # written by the conductor as the turn's ids come (the server's usage reads them): ids drafted for the turn
    # and those of them kept
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class TurnRecord:
    request_id: str
    session_id: str | None
    arrival_s: float
    first_token_s: float | None
    end_s: float
    prompt_tokens: int
    shared_prefix_tokens: int
    output_tokens: int
    model: str
    prefill_ms: float
    decode_ms: float
    reader_ration_ms: float
    finish_reason: str
    decode_tokens_per_s: float
    reader_share: float  # reader ration / served decode time
    narrator_ms: float = 0.0  # the narrator's slices inside this turn
    start_s: float | None = None  # when the turn got the engine lock (arrival + queueing)
    # wall time the decode waited on the reader's slices: their device time plus every host step around it
    # (what the served model loses to the ration is this, not reader_ration_ms)
    reader_ration_wall_ms: float = 0.0
    reader_ration_slices: int = 0  # the slices it took (each costs the decode a fixed host overhead)
    # ids of the prompt's kept prefix (what it shares with the session's ids before it) the reader had not read
    # at the turn's start; None for a session's first turn or without a reader (the replay's freshness)
    reader_behind_tokens: int | None = None
    cached_tokens: int = 0  # prompt ids whose served state was reused (not read this turn)
    cache_tier: str | None = None  # where that state came from: device, host, disk
    draft_tokens: int = 0  # ids drafted for it (speculative decoding)
    accepted_draft_tokens: int = 0  # of them, kept: emitted without a round of their own


@dataclass
class Turn:
    """A running turn, as the conductor needs it between two decode rounds."""

    req: GenerateRequest
    turn_id: str  # the ledger's key
    session_id: str | None
    arrival_s: float
    shared_prefix_tokens: int
    start_s: float | None = None
    first_token_s: float | None = None
    out_ids: list[int] = field(default_factory=list)
    finish: str = "length"
    ration_wall_s: float = 0.0  # wall time of the reader's slices between rounds
    ration_slices: int = 0
    reader_behind_tokens: int | None = None  # set by _turn_start (TurnRecord says what it is)
    reader_epoch: int | None = None  # the reader session's epoch once _turn_start fed it the prompt
    cached_tokens: int = 0
    cache_tier: str | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def num_known(self) -> int:
        return len(self.req.prompt_ids) + len(self.out_ids)

    def ids_view(self, end: int | None = None) -> TurnIds:
        """The turn's ids up to `end` (None: all), as a reader slice learns them (only what is new)."""
        return TurnIds(self.req.prompt_ids, tuple(self.out_ids), self.reader_epoch, end)


END = object()  # a turn's stream is over



@dataclass(eq=False)
class RoundEntry:
    """A turn in the round loop: what the loop hands its generator, and what the next round feeds it."""

    turn: Turn
    out: asyncio.Queue  # ids, then END (or an exception)
    done: asyncio.Future  # set once the loop has finished the turn (its slot free, its record emitted)
    arrival_no: int = 0  # arrival order (ties and the overdue turns go first come first served)
    unread_tokens: int = 0  # prompt ids its turn must read (an estimate until the turn opens)
    overtaken: int = 0  # turns that arrived after it and got their first token before it
    seq: ServedTurn | None = None
    sampler: Sampler | None = None
    token: int | None = None  # the next round's input: the last id sampled (on the host)
    in_flight: int = 0  # ids launched and not read back yet (0 or 1: a round launched ahead)
    last_round_s: float = float("-inf")  # when its last round was planned or its first token came (the yield)
    closed: bool = False  # the consumer left: end at the next round
    first_sent: bool = False  # its first token went to the consumer (mid-round, where QSE_FIRST_TOKEN_EARLY)
    drafts: TurnDrafts | None = None  # its drafter (speculative decoding; made at its first round)
    spec: SpecTurn | None = None  # its drafts' acceptance rate

    def departed(self) -> str | None:
        """Why the turn ends at the next round, if it does: its consumer closed it, or its request ended."""
        if self.closed:
            return "abort"
        ended = self.turn.req.ended
        return ended() if ended is not None else None

    def running(self) -> RunningView:
        """As the round planner sees a running turn: the ids it has and those in flight stay under max_tokens
        (a stop id in flight may still end it: that round's id is then dropped)."""
        return RunningView(self, self.turn.req.max_tokens - len(self.turn.out_ids) - self.in_flight, self.last_round_s)

    def prompt(self) -> Prompt:
        """As the round planner sees a turn before its first token."""
        if self.seq is None:
            return Prompt(self, self.arrival_no, self.unread_tokens, self.overtaken)
        return Prompt(self, self.arrival_no, self.seq.start.prompt_tokens - self.seq.session.committed,
                      self.overtaken, self.seq.chunks_left)



class TurnLifecycle:
    """The conductor's part at a turn's start (the prompt checked, the reader fed) and end (the output fed, the
    record emitted). A mixin of `Conductor`: the state it reads is the conductor's."""

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ShadowError("empty prompt: at least one token id is needed")
        vocab = self.served.cfg.vocab_size
        if is_int_list(ids) and first_outside(ids, vocab) is None:  # (in C: qse/core/ids.py)
            return
        bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < vocab)), None)
        if bad is not None:
            raise ShadowError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def _shared_prefix(self, session_id: str | None, ids: list[int]) -> int:
        prev = self._session_prompts.get(session_id or "")
        return common_prefix(prev, ids) if prev else 0

    async def _turn_start(self, turn: Turn) -> None:
        """The reader learns the new prompt (rolling back where it diverged); the router's question queues."""
        sid = turn.session_id
        if self.reader is None or sid is None:
            return
        prompt = list(turn.req.prompt_ids)

        def feed() -> tuple[int | None, int]:
            before = self.reader.sessions.get(sid)
            kept = common_prefix(before.ids, prompt) if before is not None and before.ids else None
            report = self.reader.feed(sid, prompt, len(prompt))
            return None if kept is None else max(0, kept - report.position), self.reader.sessions[sid].epoch

        turn.reader_behind_tokens, turn.reader_epoch = await self.reader_exec.run(feed)
        self._session_prompts[sid] = prompt
        self._note_backlog(sid)
        if turn.req.narrate is not None and self.options.narrator == "on":
            self.narrator.follow(turn.turn_id, turn.req.request_id, sid, len(prompt), turn.req.narrate)
        if self.options.router == "shadow":
            session = self.reader.sessions[sid]
            self.router.queue(sid, turn.req.prompt_ids, turn.req.request_id, turn.req.router_label,
                              session.committed, session.behind_at_turn_start)

    async def _turn_end(self, turn: Turn) -> None:
        sid = turn.session_id
        self.narrator.unfollow(turn.turn_id)
        if self.reader is not None and sid is not None and turn.out_ids:
            await self.reader_exec.run(self.reader.feed, sid, turn.ids_view().since(0))
            self._note_backlog(sid)
        balance = self.ledger.close_turn(turn.turn_id)
        end = self.clock()
        self.scheduler.on(TurnEnded(end, turn.turn_id))
        self.turns += 1
        prefill_ms = balance.gpu_ms(Role.SERVED_PREFILL) if balance else 0.0
        decode_ms = balance.gpu_ms(Role.SERVED_DECODE) if balance else 0.0
        ration_ms = balance.gpu_ms(Role.READER_RATION) if balance else 0.0
        n_decode = max(0, len(turn.out_ids) - 1)
        record = TurnRecord(
            request_id=turn.req.request_id, session_id=sid, arrival_s=turn.arrival_s,
            first_token_s=turn.first_token_s, end_s=end, prompt_tokens=len(turn.req.prompt_ids),
            shared_prefix_tokens=turn.shared_prefix_tokens, output_tokens=len(turn.out_ids), model=self.served.name,
            prefill_ms=prefill_ms, decode_ms=decode_ms, reader_ration_ms=ration_ms, finish_reason=turn.finish,
            decode_tokens_per_s=(n_decode / (decode_ms / 1e3)) if decode_ms > 0 else 0.0,
            reader_share=(ration_ms / decode_ms) if decode_ms > 0 else 0.0,
            narrator_ms=balance.gpu_ms(Role.NARRATOR) if balance else 0.0, start_s=turn.start_s,
            reader_ration_wall_ms=turn.ration_wall_s * 1e3, reader_ration_slices=turn.ration_slices,
            reader_behind_tokens=turn.reader_behind_tokens,
            cached_tokens=turn.cached_tokens,
            cache_tier=turn.cache_tier,
            draft_tokens=turn.draft_tokens, accepted_draft_tokens=turn.accepted_draft_tokens,
        )
        log.info("turn", **asdict(record))
        if self.on_turn is not None:
            self.on_turn(record)
