"""A share of the served model's time, counted from a given moment, less what was already spent.

The reader's ration and the narrator's share are both this rule: between two decode rounds a role
may spend `share` x (now - since) minus what it already spent this turn. `since` is the served
model's FIRST TOKEN (the reader's ration: plus its delay, see qse/core/ration.py), not the turn's start: counted from the start, a 17 s prefill earns about 340 ms
that is then spent inside the decode, and the decode loses 5.3 % (the seed's first build).

Arithmetic is exact: the share is held as the fraction its decimal spelling names (0.02 is 1/50),
times are whole microseconds, and an allowance is floored, so a role never earns a microsecond
more than its share.
"""

from __future__ import annotations

import math
from fractions import Fraction


def s_to_us(seconds: float) -> int:
    """Seconds to whole microseconds (round half to even, as `round`)."""
    return round(seconds * 1_000_000)


class ShareBudget:
    def __init__(self, share: float):
        if not (isinstance(share, (int, float)) and math.isfinite(share) and 0 <= share < 1):
            raise ValueError(f"a time share must be in [0, 1), got {share!r}")
        self.share = float(share)
        self._share = Fraction(repr(float(share)))

    def earned_us(self, now_s: float, since_s: float) -> int:
        """Microseconds the share has earned from `since_s` to `now_s` (0 before `since_s`)."""
        elapsed_us = max(0, s_to_us(now_s - since_s))
        return math.floor(self._share * elapsed_us)

    def allowance_us(self, now_s: float, since_s: float, spent_us: int) -> int:
        """What is left to spend at `now_s`: earned minus spent, never below zero."""
        return max(0, self.earned_us(now_s, since_s) - spent_us)

    def earliest_s(self, since_s: float, spent_us: int, cost_us: int) -> float | None:
        """The first moment at which the allowance reaches `cost_us`; None if the share is zero."""
        if self._share == 0:
            return None
        need_us = spent_us + cost_us
        if need_us <= 0:
            return since_s
        elapsed_us = math.ceil(need_us / self._share)
        return since_s + elapsed_us / 1_000_000
