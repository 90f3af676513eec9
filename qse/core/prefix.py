"""How many leading ids two sequences share: where a re-rendered prompt departs from what was read.

Sessions are long (10^4 to 10^5 ids) and usually share almost everything, so blocks are compared first
(a list slice compares in C) and only the last block id by id.
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK = 4096


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """The length of the longest common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i + BLOCK <= n and a[i : i + BLOCK] == b[i : i + BLOCK]:
        i += BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["common_prefix"]
