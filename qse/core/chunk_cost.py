"""The next grid chunk's cost, estimated from the last chunk measured at about that context.

A chunk's cost grows with the rows already read (attention reads every earlier row), so the
estimate is keyed by context: measurements fall into buckets of `bucket_tokens` rows of context, a
bucket remembers its last measurement, and a query takes its own bucket, else the nearest measured
one (on a tie the larger context: attention only grows, so err towards the dearer chunk), else the
prior. The prior is what the policy assumes before the engine has measured anything.

A bucket learns only from chunks read at its context, so an estimate that no window admits would stand for
good: the windows read a chunk estimated above a whole window alone, as the first of a whole window (the
probe in qse/core/idle.py and ration.py), and its measurement replaces the estimate.
"""

from __future__ import annotations

import bisect
import math


class ChunkCostEstimator:
    def __init__(self, prior_ms: float, bucket_tokens: int = 4096):
        if not (math.isfinite(prior_ms) and prior_ms > 0):
            raise ValueError(f"chunk cost prior must be a positive number of ms, got {prior_ms!r}")
        if bucket_tokens <= 0:
            raise ValueError(f"bucket_tokens must be positive, got {bucket_tokens!r}")
        self.prior_ms = float(prior_ms)
        self.bucket_tokens = int(bucket_tokens)
        self._keys: list[int] = []  # sorted measured buckets
        self._last_ms: dict[int, float] = {}

    def _bucket(self, context_tokens: int) -> int:
        return max(0, int(context_tokens)) // self.bucket_tokens

    def observe(self, context_tokens: int, gpu_ms: float) -> bool:
        """Learn a measured chunk read above `context_tokens` rows; False (ignored) for a bad value."""
        if not isinstance(gpu_ms, (int, float)) or not math.isfinite(gpu_ms) or gpu_ms <= 0:
            return False
        key = self._bucket(context_tokens)
        if key not in self._last_ms:
            bisect.insort(self._keys, key)
        self._last_ms[key] = float(gpu_ms)
        return True

    def estimate_ms(self, context_tokens: int) -> float:
        """Estimated ms for the chunk that starts after `context_tokens` committed rows."""
        if not self._keys:
            return self.prior_ms
        key = self._bucket(context_tokens)
        hit = self._last_ms.get(key)
        if hit is not None:
            return hit
        i = bisect.bisect_left(self._keys, key)
        below = self._keys[i - 1] if i > 0 else None
        above = self._keys[i] if i < len(self._keys) else None
        if above is None or (below is not None and key - below < above - key):
            return self._last_ms[below]  # type: ignore[index]
        return self._last_ms[above]

    @property
    def num_buckets(self) -> int:
        return len(self._keys)
