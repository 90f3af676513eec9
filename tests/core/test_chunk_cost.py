"""The chunk-cost estimator: last measured at about that context, else the nearest, else the prior."""

import pytest

from qse.core.chunk_cost import ChunkCostEstimator


def test_prior_until_measured_then_last_in_bucket():
    est = ChunkCostEstimator(prior_ms=50.0, bucket_tokens=4096)
    assert est.estimate_ms(0) == 50.0
    assert est.observe(0, 44.5)
    assert est.estimate_ms(512) == 44.5  # same bucket
    assert est.observe(1024, 46.0)
    assert est.estimate_ms(3584) == 46.0  # the last measurement of the bucket wins


def test_nearest_bucket_and_tie_goes_to_the_dearer_context():
    est = ChunkCostEstimator(prior_ms=50.0, bucket_tokens=1000)
    est.observe(1000, 10.0)  # bucket 1
    est.observe(5000, 30.0)  # bucket 5
    assert est.estimate_ms(2000) == 10.0  # bucket 2: nearer 1
    assert est.estimate_ms(4000) == 30.0  # bucket 4: nearer 5
    assert est.estimate_ms(3000) == 30.0  # bucket 3: a tie, the larger context
    assert est.estimate_ms(0) == 10.0
    assert est.estimate_ms(99_000) == 30.0
    assert est.num_buckets == 2


def test_bad_measurements_are_ignored():
    est = ChunkCostEstimator(prior_ms=5.0)
    assert not est.observe(0, 0.0)
    assert not est.observe(0, float("nan"))
    assert est.estimate_ms(0) == 5.0


def test_bad_prior_is_an_error_naming_the_value():
    with pytest.raises(ValueError, match="-1"):
        ChunkCostEstimator(prior_ms=-1)

