"""A round of one on qse's Triton kernels (interpreted on CPU, the graph path's static form) is the
single-sequence path bit for bit: one row takes the same GEMVs either way, and leaves the same state (GDN state
and every KV row, the row crossing a page line included)."""

from __future__ import annotations

import pytest
import torch

from rounds_rig import PROMPTS, decode_rounds, decode_single, make_engine, prefill, same_state

pytestmark = pytest.mark.usefixtures("few_programs")


@pytest.mark.parametrize("kernels", ["triton"])
def test_a_round_of_one_is_the_single_sequence_path(small_model_dir, cache_dir, kernels):
    engine = make_engine(kernels, small_model_dir, cache_dir)
    [start] = prefill(small_model_dir, cache_dir, [PROMPTS[1]])
    [alone], [alone_state], _ = decode_rounds(engine, [start], max_running=1)
    single, single_state = decode_single(engine, start)
    assert len(alone) == len(single) and all(torch.equal(a, b) for a, b in zip(alone, single))
    assert same_state(alone_state, single_state)
