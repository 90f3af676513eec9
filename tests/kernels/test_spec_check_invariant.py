"""`qse spec-check` (qse/engine/spec_check.py) on qse's row-invariant kernels (QSE_KERNELS=invariant; interpreted
on CPU, the graph path's static form): a verify row's logits are a one-row round's bits, so speculative greedy
decoding emits plain greedy decoding's ids with either drafter, and the check passes with no parting at all."""

from __future__ import annotations

import pytest

from qse.engine.spec_check import run_spec_check
from rounds_rig import PAGE_ROWS, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("few_programs")]


def test_spec_check_passes_with_every_sequence_equal(small_model_dir, cache_dir):
    engine = make_engine("invariant", small_model_dir, cache_dir)
    # 4 ids a sequence after the prefill's: one whole oracle verify of k + 1 = 4 rows
    report = run_spec_check(engine, num_sequences=2, context=12, steps=3, k=3, page_rows=PAGE_ROWS, tolerance=0.0)
    assert report["kernels"] == "invariant" and report["pass"] is True
    assert report["partings"] == [] and report["equal_sequences"] == report["sequences_compared"] == 4
    assert report["runs"][0]["ids_per_verify"] == 4
