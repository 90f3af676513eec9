"""Speculative rounds: whether a round verifies the running turns' drafts, and how many rows a turn.

A verify of W rows a turn (its next token and W - 1 drafted ids, qse/engine/rounds.py) costs more than a decode
round of the same turns, cost(b, W) against cost(b, 1) for the round's bucket b, and yields for a turn with a
draft of d ids 1 + E[accepted] tokens, where a draft's j-th id is kept with probability alpha^j for the turn's
acceptance rate alpha:

    tokens(W)  = sum over turns of 1 + sum_{j=1..min(d, W-1)} alpha^j
    choose W   = the width with the most tokens per device ms; 1 (a plain round) unless one beats it by `margin`

A turn that finds no draft for a few rounds looks again only now and then (`looks`): looking needs its last id
on the host, so its rounds cannot be launched ahead while it looks. Nor does a turn look whose rate could not pay
for the round's widest verify alone (a head whose drafts are refused: a verify costs more than a plain round and
the rounds lose their launch ahead); its rate drifts back to the prior between verifies, more slowly after each
verify in a row that kept nothing (`SpecTurn.misses`), so such a turn tries again ever more rarely. The costs
are measured: every round the loop runs reports its device ms (`observe_round`), a running mean a (bucket,
width); a width not measured yet is priced from the plain round's cost by a prior per extra row. A
turn's alpha is a running mean of what its drafts kept (`observe_turn`); a turn that stops drafting drifts back
to the prior (`SpecTurn.idle`), so one bad stretch does not shut its drafts off for the rest of the turn.

Pure: no torch, no clock. The round loop (qse/runtime/rounds.py) owns one planner and a SpecTurn a turn.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass, field


def expected_tokens(draft: int, alpha: float) -> float:
    """Tokens a verify yields for a turn with `draft` drafted ids, each kept with probability alpha after the
    last: the next token, plus alpha + alpha^2 + ... + alpha^draft."""
    if draft <= 0 or alpha <= 0.0:
        return 1.0
    if alpha >= 1.0:
        return 1.0 + draft
    return 1.0 + alpha * (1.0 - alpha ** draft) / (1.0 - alpha)


@dataclass
class SpecTurn:
    """One running turn's acceptance: a running mean of the share of its drafted ids a verify kept (the turn's
    own counts of drafted and kept ids are its record's, qse/runtime/turn.py), and the rounds since it last
    found a draft (SpecPlanner.looks)."""

    alpha: float
    prior: float | None = None  # the rate an idle round drifts back toward (None: alpha's first value)
    quiet_rounds: int = 0  # rounds in a row it found no draft in (or did not look in)
    misses: int = 0  # verifies in a row that kept none of its drafts

    def __post_init__(self) -> None:
        if self.prior is None:
            self.prior = self.alpha

    def observe(self, drafted: int, accepted: int, weight: float) -> None:
        if drafted <= 0:
            return
        # the rate a geometric acceptance gives this outcome: a of d kept, the (a + 1)-th refused (all kept: a
        # rate above every lower count's)
        rate = accepted / drafted if accepted < drafted else (accepted + 1) / (drafted + 1)
        self.alpha += weight * (rate - self.alpha)

    def idle(self, prior: float, weight: float) -> None:
        """A round the turn did not draft in: its rate drifts back toward the prior."""
        self.alpha += weight * (prior - self.alpha)


@dataclass
class SpecPlanner:
    """widths: the verify widths the rounds hold graphs for (each >= 2). prior_row_cost: a verify's extra cost a
    row above the first, as a share of the plain round, until the width is measured. prior_alpha: a new turn's
    acceptance rate. margin: the share of tokens per ms a verify must win by."""

    widths: tuple[int, ...]
    prior_row_cost: float = 0.15
    prior_alpha: float = 0.5
    # a turn whose request sent a prediction (OpenAI's predicted outputs: the file an agent rewrites) starts
    # here: its drafts come mostly from text the answer will repeat, and a verify must be tried to learn it
    prediction_alpha: float = 0.9
    alpha_weight: float = 0.5  # the newest verify's weight in a turn's rate
    idle_weight: float = 0.05  # a round without a draft pulls the rate this far back to the prior
    cost_weight: float = 0.2  # the newest round's weight in its (bucket, width) cost
    margin: float = 0.05
    # a turn that found no draft in `quiet_after` rounds in a row looks again only every `recheck_every` rounds:
    # a round looks for drafts only with the turns' last ids on the host, which costs it the launch ahead
    # (measured on the H200, one 9B user: 157.6 -> 182.0 tokens/s launched ahead), so a turn with nothing to
    # draft should not keep its batch from it
    quiet_after: int = 4
    recheck_every: int = 8
    # after m verifies in a row that kept nothing a turn's rate drifts back at idle_weight / 2^min(m, max_backoff)
    # a round: from a refused draft's rate, ~3 rounds to the next try after one miss, ~100 after five, ~400 at most
    max_backoff: int = 7
    _cost_ms: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.widths or any(not isinstance(w, int) or w < 2 for w in self.widths):
            raise ValueError(f"verify widths must be integers >= 2, got {self.widths!r}")
        for name in ("prior_alpha", "prediction_alpha"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)!r}")
        self.widths = tuple(sorted(set(self.widths)))

    @property
    def max_draft(self) -> int:
        """The most drafted ids a verify reads a turn."""
        return self.widths[-1] - 1

    def new_turn(self, predicted: bool = False) -> SpecTurn:
        """A running turn's rate, from the prior (prediction_alpha where its request sent a prediction)."""
        return SpecTurn(self.prediction_alpha if predicted else self.prior_alpha)

    def looks(self, turn: SpecTurn, bucket: int | None = None) -> bool:
        """Whether the turn looks for drafts this round: its last quiet_rounds rounds found none (looks now and
        then), and, for a round of `bucket` rows, a full draft at its rate would pay for a verify alone (also
        while the plain round is unmeasured: verifies measure it)."""
        quiet = turn.quiet_rounds
        if not (quiet < self.quiet_after or (quiet - self.quiet_after) % self.recheck_every == 0):
            return False
        return bucket is None or self.cost_ms(bucket, 1) is None or self.choose(bucket, [(self.max_draft, turn.alpha)]) > 1

    def looks_next(self, turn: SpecTurn, bucket: int | None = None) -> bool:
        """Whether the turn would look for drafts in the round after this one, where this one does not verify
        (the MTP head drafts for the next round after this one: none where no turn would read them)."""
        after = copy.copy(turn)
        self.observe_turn(after, 0, 0)
        return self.looks(after, bucket)

    def observe_round(self, bucket: int, width: int, ms: float) -> None:
        """A round of `bucket` rows a width (1: plain) took `ms` of device time."""
        if ms <= 0.0:
            return
        key = (bucket, width)
        old = self._cost_ms.get(key)
        self._cost_ms[key] = ms if old is None else old + self.cost_weight * (ms - old)

    def observe_turn(self, turn: SpecTurn, drafted: int, accepted: int) -> None:
        """A round the turn ran in: what it drafted (0: nothing, or it did not look) and kept."""
        if drafted > 0:
            turn.observe(drafted, accepted, self.alpha_weight)
            turn.quiet_rounds = 0
            turn.misses = turn.misses + 1 if accepted == 0 else 0
        else:
            turn.idle(turn.prior, self.idle_weight / 2 ** min(turn.misses, self.max_backoff))
            turn.quiet_rounds += 1

    def cost_ms(self, bucket: int, width: int) -> float | None:
        """A round's device ms as measured, or priced from the plain round's (None: nothing measured yet)."""
        measured = self._cost_ms.get((bucket, width))
        if measured is not None:
            return measured
        plain = self._cost_ms.get((bucket, 1))
        if plain is None:
            return None
        return plain * (1.0 + self.prior_row_cost * (width - 1))

    def choose(self, bucket: int, drafts: list[tuple[int, float]]) -> int:
        """The width of the next round of `bucket` rows whose turns hold drafts of (length, alpha): 1 (plain)
        when no turn drafted, when the plain round has not been measured yet, or when no verify earns more
        tokens per ms by the margin."""
        if not drafts or all(d <= 0 for d, _ in drafts):
            return 1
        plain_ms = self.cost_ms(bucket, 1)
        if plain_ms is None:
            return 1
        best, best_rate = 1, len(drafts) / plain_ms * (1.0 + self.margin)
        for width in self.widths:
            ms = self.cost_ms(bucket, width)
            tokens = sum(expected_tokens(min(d, width - 1), alpha) for d, alpha in drafts)
            if tokens / ms > best_rate:
                best, best_rate = width, tokens / ms
        return best


__all__ = ["SpecPlanner", "SpecTurn", "expected_tokens"]
