"""Served sessions with the MTP head (QSE_SPECULATE=mtp's book: the head's KV slot in every page, grid chunks read
with the final-hidden taps): the session's state is the same bits as without the head, and the head holds rows of
the whole prompt (its grid chunks' and its tail's) close to a head prefill of the prompt in one piece.

A tiny Qwen3.5 with an MTP head in float64 (tests/engine/mtp_rig.py), on the torch ops; the graph path in its
static form (the chunk graph's buffers and calls, uncaptured) and eagerly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qse.engine.rounds import mtp_kv_slot, pool_slots_for
from qse.sessions.grid import GridSessions
from qse.sessions.served import ServedSessions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mtp_rig import agreeing_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
GRID = 16
PROMPT = [7 + (i * 11) % 400 for i in range(61)]  # three grid chunks and a tail of 13


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return agreeing_engine(tiny_engine.resolved.chat)


def _served(engine, graphs, mtp: bool) -> ServedSessions:
    book = GridSessions(engine, grid=GRID, pool_bytes=4 << 20, graphs=graphs, who="the served model",
                        kv_slots=pool_slots_for(engine.cfg, mtp), chunk_hidden=mtp)
    return ServedSessions(book, max_running=2, verify_width=4 if mtp else 0, mtp=mtp)


@pytest.mark.parametrize("graphs", [False, "static"], ids=["eager", "static-graph"])
def test_the_head_reads_every_prompt_row_and_the_state_is_unchanged(engine, graphs):
    with_head, plain = _served(engine, graphs, True), _served(engine, graphs, False)
    turns = {}
    for served in (with_head, plain):
        turn, logits = served.begin("s", PROMPT)
        turns[served] = (turn, logits)
    (turn, logits), (plain_turn, plain_logits) = turns[with_head], turns[plain]
    session, plain_session = turn.session, plain_turn.session
    committed = session.committed
    assert committed == 3 * GRID == plain_session.committed
    # the grid state (what the session keeps) is the same bits: the taps only add the last layer's MLP and norm
    for layer in range(len(engine.cfg.attention_layers)):
        assert all(torch.equal(a, b) for a, b in zip(session.kv.read(layer, committed),
                                                     plain_session.kv.read(layer, committed)))
    assert all(torch.equal(a, b) for a, b in zip(session.cache.state_tensors(), plain_session.cache.state_tensors()))
    # the tail: its last layer over every row with the taps, one row without: a rounding apart (fp32 logits)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-6)

    first = int(logits[-1].argmax())
    with_head.start_drafts(turn, first)
    assert turn.drafts is not None and turn.drafts.shape == (3,)
    # the head's rows of the whole prompt against a head prefill of it in one piece (the prompt read at once)
    model, head = engine.model, engine.model.mtp_head()
    cold = engine.new_cache()
    taps = model.new_taps(len(PROMPT))
    model.forward(torch.tensor(PROMPT), cold, "last", taps=taps)
    ref = head.new_cache(capacity=len(PROMPT))
    head.forward(torch.tensor(PROMPT[1:] + [first]), taps["final_hidden"], ref)
    want_k, want_v = ref.kv.read(0, len(PROMPT))
    got_k, got_v = session.kv.read(mtp_kv_slot(engine.cfg), len(PROMPT))
    torch.testing.assert_close(got_k, want_k, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_v, want_v, rtol=1e-9, atol=1e-9)
    with_head.finish(turn)
    plain.finish(plain_turn)


def test_the_head_s_rows_of_an_admitted_sequence_are_refused(engine):
    served = _served(engine, False, True)
    turn, _ = served.begin("s", PROMPT)
    with pytest.raises(ValueError, match="not admitted"):
        served.rounds.mtp_rows(turn.cache.kv, 0, PROMPT[1:4], torch.zeros(3, engine.cfg.hidden_size,
                                                                         dtype=engine.dtype))
    served.finish(turn)
