"""The served model's rounds: which turns open, which decode, which prompts are read, a round at a time.

A round is one batched decode of every running turn plus a few pieces of the prompts being read. A piece is
one whole grid chunk of a prompt, or its tail (1..grid ids, the last piece: it gives the first token):

    prompt   | chunk | chunk | chunk | tail |      (a prompt of 3 * grid + 5 ids unread: 4 pieces)
    round    |   1   |   1   |   2   |  2   |      (round_token_budget = 2 * grid: 2 pieces a round)

The planner decides; the caller (the runtime's conductor on the device, the replay on a virtual clock) owns
the turns and carries the plan out. It holds no state: the caller hands it views of its turns each round,
so the runtime and the replay take the same decisions from the same facts.

Rules (one copy, here):
- Admission: waiting turns open (a decode slot reserved each) in `prefill_order` while fewer than
  `max_running` turns run or are read.
- Order: a prompt with fewer ids left to read goes first (one long prompt does not hold the first token of
  every short one behind it), ties first come first served; a prompt that `MAX_OVERTAKEN` later arrivals have
  passed (got their first token before it) goes before every prompt not yet overdue (overdue ones first come
  first served), so no prompt waits for more than that many others however many short ones keep arriving.
- Budget: a round reads `token_budget // grid` pieces (at least one), the opened prompts in `prefill_order`,
  each read to its end before the next starts: reading them side by side would delay every first token to the
  last one's.
- Decode: every running turn with ids left to launch decodes in the round, except that with a decode yield
  (`decode_yield_ms` > 0) the running turns sit out a round that reads prompts while every one of them decoded
  less than that long ago: under a burst of prompts the first tokens come sooner, and a running turn's next
  id waits at most the yield plus one round (0, the default: every round decodes them, the lowest
  inter-token latency; SGLang's prefill-first schedule is the far end).
- Cut (`cut_rounds`): a round stops before its next piece when a turn that joined the queue since the round
  was planned would open (a slot is free) and goes before that piece's prompt in `prefill_order`; what the
  round read stands, and the next round is planned with the newcomer. A short follow-up then waits for the
  piece in flight, not for the rest of a round of a long prompt's pieces (a round of 2048 ids is ~80 ms of a
  9B's chunks), and a round is cut only where someone arrived.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple

MAX_OVERTAKEN = 8


class Prompt(NamedTuple):
    """A turn before its first token, as the planner sees it (the caller builds one a round)."""

    key: Hashable  # the caller's handle on the turn (returned in the plan)
    arrival_no: int  # arrival order
    unread_tokens: int  # prompt ids still to read before the first token (an estimate until the turn opens)
    overtaken: int = 0  # turns that arrived after it and got their first token before it
    chunks_left: int | None = None  # whole grid chunks still to read before the tail; None: not opened yet


class Running(NamedTuple):
    """A turn past its first token."""

    key: Hashable
    ids_to_launch: int  # ids it may still be given (max_tokens less those it has and those in flight)
    # on the caller's clock (s): when its last round was planned, or its first token came (the decode yield)
    last_round_s: float = float("-inf")


class Read(NamedTuple):
    """A prompt's pieces in one round: `chunks` whole grid chunks, then its tail when `tail`."""

    key: Hashable
    chunks: int
    tail: bool

    @property
    def pieces(self) -> int:
        return self.chunks + int(self.tail)


class RoundPlan(NamedTuple):
    """One round: the conductor's round loop (or the replay) runs `decode` as one batched forward, then `reads`
    in order; the turns in `first_tokens` (those whose tail is read) decode from the next round on."""

    decode: tuple[Hashable, ...]
    reads: tuple[Read, ...]

    @property
    def first_tokens(self) -> tuple[Hashable, ...]:
        return tuple(r.key for r in self.reads if r.tail)

    def __bool__(self) -> bool:  # a round with nothing to run is no round
        return bool(self.decode or self.reads)


def prefill_order(prompt: Prompt) -> tuple[int, int, int]:
    """Sort key of the waiting and opened prompts (the module's docstring says why)."""
    if prompt.overtaken >= MAX_OVERTAKEN:
        return (0, 0, prompt.arrival_no)
    return (1, prompt.unread_tokens, prompt.arrival_no)


def chunks_before_tail(unread_tokens: int, grid: int) -> int:
    """Whole grid chunks of a prompt with `unread_tokens` ids unread above a grid line: the tail keeps 1..grid
    ids (qse/sessions/served.py: the line L stops one id short of the prompt's end)."""
    return max(0, unread_tokens - 1) // grid


class RoundPlanner:
    """The served rounds' decisions: `admit` between rounds, then `plan` a round, then `overtaken` for each
    first token. Pure: it keeps nothing between calls."""

    def __init__(self, max_running: int, token_budget: int, grid: int, decode_yield_ms: float = 0.0,
                 cut_rounds: bool = False):
        for name, value in (("max_running", max_running), ("grid", grid)):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(token_budget, int) and token_budget >= 0):
            raise ValueError(f"the round's token budget must be an integer >= 0 ids, got {token_budget!r}")
        if not (isinstance(decode_yield_ms, (int, float)) and 0 <= decode_yield_ms < float("inf")):
            raise ValueError(f"the decode yield (QSE_DECODE_YIELD_MS) must be a finite number of ms >= 0, "
                             f"got {decode_yield_ms!r}")
        self.max_running = max_running
        self.token_budget = token_budget
        self.grid = grid
        self.decode_yield_ms = float(decode_yield_ms)
        self.cut_rounds = bool(cut_rounds)

    @property
    def pieces_per_round(self) -> int:
        """Pieces a round reads: the budget's whole grid chunks, at least one (a prompt always advances)."""
        return max(1, self.token_budget // self.grid)

    def admit(self, waiting: Iterable[Prompt], num_busy: int) -> list[Hashable]:
        """The waiting turns to open now, in the order they open: `prefill_order` while fewer than max_running
        turns run or are read (`num_busy`). A turn that fails to open frees its slot: ask again."""
        free = self.max_running - num_busy
        if free <= 0:
            return []
        return [p.key for p in sorted(waiting, key=prefill_order)[:free]]

    def plan(self, running: Iterable[Running], reading: Iterable[Prompt], now: float = 0.0) -> RoundPlan:
        """The next round at `now` (the caller's clock, s): every running turn with ids left decodes (unless
        they all yield the round to the prompts: the module's docstring); the opened prompts (`chunks_left` set)
        get `pieces_per_round` pieces in `prefill_order`, whole chunks first, the tail last."""
        decoding = [r for r in running if r.ids_to_launch > 0]
        decode = tuple(r.key for r in decoding)
        pieces, reads = self.pieces_per_round, []
        for prompt in sorted(reading, key=prefill_order):
            if pieces == 0:
                break
            if prompt.chunks_left is None:
                raise ValueError(f"prompt {prompt.key!r} is not opened (chunks_left is None): admit it first")
            chunks = min(pieces, prompt.chunks_left)
            tail = pieces > chunks
            reads.append(Read(prompt.key, chunks, tail))
            pieces -= chunks + int(tail)
        if reads and decoding and all((now - r.last_round_s) * 1e3 < self.decode_yield_ms for r in decoding):
            decode = ()  # every running turn decoded within the yield: this round is the prompts'
        return RoundPlan(decode, tuple(reads))

    def cuts_before(self, piece: Prompt, joined: Iterable[Prompt], num_busy: int) -> bool:
        """Whether a round stops before its next piece, one of `piece`'s prompt (as it stands then): with
        `cut_rounds`, a turn that joined the queue since the round was planned (`joined`) would open now (fewer
        than max_running turns run or are read: `num_busy`) and goes before it in `prefill_order`."""
        if not self.cut_rounds or num_busy >= self.max_running:
            return False
        key = prefill_order(piece)
        return any(prefill_order(p) < key for p in joined)

    @staticmethod
    def overtaken(first: Prompt, others: Iterable[Prompt]) -> list[Hashable]:
        """The prompts `first` overtook by getting its first token: those still waiting or being read that
        arrived before it (each one's `overtaken` count goes up by one: the starvation bound)."""
        return [p.key for p in others if p.arrival_no < first.arrival_no]

