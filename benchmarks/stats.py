"""Order statistics the served benchmarks report: one rule for their p50 / p90 / p99."""

from __future__ import annotations


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-quantile of values sorted ascending, as the value at rank round(q * (n - 1))."""
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


__all__ = ["nearest_rank"]
