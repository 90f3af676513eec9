"""A verify (DecodeRounds.verify and keep) on the whole model over qse's row-invariant kernels (QSE_KERNELS=
invariant; interpreted on CPU, the graph path's static form): each verify row's logits are the bits a one-row
round gives the same token at the same position, and the state a slot keeps after its accepted row is the
state those one-row rounds leave, every GDN section and every KV row (what speculative greedy decoding needs
to emit exactly plain greedy decoding's ids)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.kv import PagedKV
from qse.engine.rounds import DecodeRounds
from rounds_rig import PAGE_ROWS, PROMPTS, make_engine, make_pool, prefill, same_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("few_programs")]

WIDTH = 3  # the next token and two drafts


def test_verify_rows_and_the_kept_state_are_the_one_row_rounds_bits(small_model_dir, cache_dir):
    engine = make_engine("invariant", small_model_dir, cache_dir)
    starts = prefill(small_model_dir, cache_dir, PROMPTS)
    # plain: each sequence alone, WIDTH one-row rounds of its greedy ids
    plain = []
    for state, token in starts:
        rounds = DecodeRounds(engine, make_pool(engine), max_running=1, graphs="static")
        slot = rounds.admit(engine.restore_cache(state, PagedKV(rounds.pool)))
        tokens, rows, kept = [token], [], {}
        for step in range(WIDTH):
            logits = rounds.run([slot], [tokens[-1]])
            rows.append(logits[0].clone())
            tokens.append(int(logits[0].argmax()))
            kept[step] = engine.cache_state(rounds.store(slot))
        plain.append((tokens, rows, kept))
    # the verify: both sequences together (a bucket of two), [token, its two greedy ids]; the second one's
    # window crosses its page line; keep all of the first's rows and only the first of the second's
    rounds = DecodeRounds(engine, make_pool(engine), max_running=2, graphs="static", verify_width=WIDTH)
    slots = [rounds.admit(engine.restore_cache(state, PagedKV(rounds.pool))) for state, _ in starts]
    logits = rounds.verify(slots, [tokens[:WIDTH] for tokens, _, _ in plain])
    for i, (_, rows, _) in enumerate(plain):
        for j in range(WIDTH):
            assert torch.equal(logits[i, j], rows[j]), (i, j)
    accepted = [WIDTH - 1, 0]
    rounds.keep(slots, accepted)
    for slot, (_, _, kept), count in zip(slots, plain, accepted):
        assert same_state(engine.cache_state(rounds.store(slot)), kept[count])
    assert engine.cache_state(rounds.store(slots[1])).length == len(PROMPTS[1]) + 1
    assert len(PROMPTS[1]) == PAGE_ROWS  # its rows 1 and 2 were written past the page line, then let go
