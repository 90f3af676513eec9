"""A round of one on qse's Triton kernels (interpreted on CPU, the graph path's static form) is the
single-sequence path bit for bit: one row takes the same GEMVs either way."""

from __future__ import annotations

import pytest
import torch

from rounds_rig import PROMPTS, decode_rounds, decode_single, make_engine, prefill

pytestmark = pytest.mark.usefixtures("few_programs")


@pytest.mark.parametrize("kernels", ["triton"])
def test_a_round_of_one_is_the_single_sequence_path(small_model_dir, cache_dir, kernels):
    engine = make_engine(kernels, small_model_dir, cache_dir)
    [start] = prefill(engine, [PROMPTS[1]])
    alone = decode_rounds(engine, [start], max_running=1)[0]
    assert all(torch.equal(a, b) for a, b in zip(alone, decode_single(engine, start)))
