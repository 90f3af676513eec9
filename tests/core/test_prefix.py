"""common_prefix: the block comparison gives what an id-by-id walk gives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qse.core import prefix
from qse.core.prefix import common_prefix


def _walk(a, b, limit=None):
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@given(n=st.integers(0, 3 * prefix.BLOCK + 5), cut=st.integers(0, 3 * prefix.BLOCK + 5),
       extra=st.integers(0, 7), limit=st.one_of(st.none(), st.integers(0, 4 * prefix.BLOCK)))
def test_block_comparison_equals_the_walk(n, cut, extra, limit):
    a = list(range(n))
    b = a[:cut] + [-1] * extra + a[cut + extra :]
    assert common_prefix(a, b, limit) == _walk(a, b, limit)


def test_edges():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], limit=2) == 2
