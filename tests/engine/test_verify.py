"""Verify rounds (qse/engine/rounds.py: DecodeRounds.verify and keep) on the tiny model, on CPU with the torch
ops, in the static form of the graph path.

A verify reads T rows a slot (its next token and T - 1 drafts) in one forward and keeps the state after the
accepted row. Torch's CPU matmul is not row-invariant (a forward of 6 rows rounds differently from one of 2),
so here the greedy tokens are compared exactly and the logits and states to the matmul's rounding; the bits are
compared where the kernels are row-invariant (tests/kernels/test_verify_invariant.py)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.drafters import PromptLookup
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds
from qse.engine.speculative import accept_greedy
from qse.models.inputs import InputError

PAGE_ROWS = 16
WIDTH = 4  # the verify window: the next token and 3 drafts
# different lengths; the first's window crosses its page line (16), the second's fills a page exactly
PROMPTS = {"a": list(range(300, 314)), "b": list(range(900, 929)), "c": [7, 8, 9, 10] * 9 + [7, 8]}
STEPS = 12


def _pool(engine, num_pages: int = 64) -> KVPool:
    cfg = engine.cfg
    return KVPool(num_pages, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                  engine.dtype, engine.device)


def _rounds(engine, max_running: int = 3, width: int = WIDTH) -> DecodeRounds:
    return DecodeRounds(engine, _pool(engine), max_running=max_running, graphs="static", verify_width=width)


def _admit(engine, rounds, prompt) -> tuple[int, int]:
    cache = engine.new_cache(kv=PagedKV(rounds.pool))
    logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
    return rounds.admit(cache), int(logits[-1].argmax())


def _plain(engine, prompt, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through one-row rounds: the first token, then `steps` more, and each round's logits."""
    rounds = DecodeRounds(engine, _pool(engine), max_running=1, graphs="static")
    slot, token = _admit(engine, rounds, prompt)
    tokens, rows = [token], []
    for _ in range(steps):
        logits = rounds.run([slot], [tokens[-1]])
        rows.append(logits[0].clone())
        tokens.append(int(logits[0].argmax()))
    return tokens, rows


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return {name: _plain(tiny_engine, prompt, STEPS) for name, prompt in PROMPTS.items()}


def _states(rounds, slot):
    return rounds.states.recurrent[:, slot].clone(), rounds.states.conv[:, slot].clone()


def test_a_verify_of_the_greedy_continuation_gives_the_plain_rows(tiny_engine, plain):
    """Three slots verify [token, its next 3 greedy ids]: row j's logits are plain decoding's round j (to the CPU
    matmul's rounding), every draft is accepted, and after keep the slot decodes on as plain did."""
    rounds = _rounds(tiny_engine)
    names = list(PROMPTS)
    slots = {n: _admit(tiny_engine, rounds, PROMPTS[n])[0] for n in names}
    before = {n: _states(rounds, slots[n]) for n in names}
    logits = rounds.verify([slots[n] for n in names], [plain[n][0][:WIDTH] for n in names]).clone()
    assert logits.shape == (3, WIDTH, tiny_engine.cfg.vocab_size)
    for i, name in enumerate(names):
        for j in range(WIDTH):
            torch.testing.assert_close(logits[i, j], plain[name][1][j], rtol=1e-4, atol=1e-4)
        # nothing is kept before keep(): the slot's own state is the one before the verify
        for got, want in zip(_states(rounds, slots[name]), before[name]):
            assert torch.equal(got, want)
    drafts = torch.tensor([plain[n][0][1:WIDTH] for n in names])
    accepted, nxt = accept_greedy(drafts, logits.argmax(-1))
    assert accepted.tolist() == [WIDTH - 1] * 3
    assert nxt.tolist() == [plain[n][0][WIDTH] for n in names]
    rounds.keep([slots[n] for n in names], accepted.tolist())
    for name, prompt in PROMPTS.items():
        assert rounds._caches[slots[name]].length == len(prompt) + WIDTH
    after = rounds.run([slots[n] for n in names], nxt.tolist())
    for i, name in enumerate(names):
        torch.testing.assert_close(after[i], plain[name][1][WIDTH], rtol=1e-4, atol=1e-4)


def test_a_refused_draft_keeps_the_state_of_the_last_accepted_row(tiny_engine, plain):
    """Drafts wrong from the second on: one is accepted, the slot keeps row 1's state (its length grows by 2),
    and decoding goes on as plain did; a slot whose first draft is wrong keeps row 0's."""
    rounds = _rounds(tiny_engine, max_running=2)
    ta, tb = plain["a"][0], plain["b"][0]
    sa, _ = _admit(tiny_engine, rounds, PROMPTS["a"])
    sb, _ = _admit(tiny_engine, rounds, PROMPTS["b"])
    wrong = lambda t: (t + 1) % tiny_engine.cfg.vocab_size  # noqa: E731
    rows = [[ta[0], ta[1], wrong(ta[2]), ta[3]], [tb[0], wrong(tb[1]), tb[2], tb[3]]]
    logits = rounds.verify([sa, sb], rows)
    accepted, nxt = accept_greedy(torch.tensor([r[1:] for r in rows]), logits.argmax(-1))
    assert accepted.tolist() == [1, 0]
    assert nxt.tolist() == [ta[2], tb[1]]
    rounds.keep([sa, sb], accepted.tolist())
    assert rounds._caches[sa].length == len(PROMPTS["a"]) + 2
    assert rounds._caches[sb].length == len(PROMPTS["b"]) + 1
    tokens = {"a": [ta[2]], "b": [tb[1]]}
    for _ in range(3):
        logits = rounds.run([sa, sb], [tokens["a"][-1], tokens["b"][-1]])
        tokens["a"].append(int(logits[0].argmax()))
        tokens["b"].append(int(logits[1].argmax()))
    assert tokens["a"] == ta[2:6]
    assert tokens["b"] == tb[1:5]


class FaultyOracle:
    """Drafts plain greedy's own continuation with one id wrong at a place that moves (the d-th draft of the
    n-th proposal, d = n mod (k + 1); k + 1: all right): every acceptance count from 0 to k turns up."""

    def __init__(self, continuation: list[int], k: int, vocab: int):
        self.continuation, self.k, self.vocab, self.calls = continuation, k, vocab, 0

    def propose(self, emitted: int) -> list[int]:
        drafts = (self.continuation[emitted: emitted + self.k] + [0] * self.k)[: self.k]
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if wrong < self.k:
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
        return drafts


def _speculative(engine, prompt, steps: int, width: int, drafter) -> tuple[list[int], list[int]]:
    """Greedy decoding by verify and keep: the first token, then at least `steps` more (a verify may emit
    several), and each verify's accepted count. drafter(prompt + tokens, tokens) proposes width - 1 ids."""
    rounds = _rounds(engine, max_running=1, width=width)
    slot, token = _admit(engine, rounds, prompt)
    tokens, counts = [token], []
    while len(tokens) <= steps:
        drafts = drafter(prompt + tokens, tokens)
        logits = rounds.verify([slot], [[tokens[-1]] + drafts])
        accepted, nxt = accept_greedy(torch.tensor([drafts]), logits.argmax(-1))
        counts.append(int(accepted[0]))
        rounds.keep([slot], counts[-1:])
        tokens += drafts[: counts[-1]] + [int(nxt[0])]
    return tokens[: steps + 1], counts


def test_speculative_greedy_equals_plain_greedy(tiny_engine, plain):
    """Drafts right and wrong at every place, windows across page lines: the ids equal plain greedy decoding's,
    token for token, and every acceptance count from 0 to 3 came up."""
    vocab = tiny_engine.cfg.vocab_size
    for name, prompt in PROMPTS.items():
        oracle = FaultyOracle(plain[name][0][1:], WIDTH - 1, vocab)
        tokens, counts = _speculative(tiny_engine, prompt, STEPS, WIDTH, lambda ids, out: oracle.propose(len(out) - 1))
        assert tokens == plain[name][0], name
        assert set(counts) == set(range(WIDTH)), counts


def test_speculative_greedy_with_prompt_lookup_equals_plain_greedy(tiny_engine, plain):
    """The n-gram drafter over the prompt and the output (its short proposals padded: padding is a draft too)."""
    for name, prompt in PROMPTS.items():
        def lookup(ids, out):
            return (PromptLookup(ids, k=WIDTH - 1).propose() + [0] * WIDTH)[: WIDTH - 1]
        tokens, _ = _speculative(tiny_engine, prompt, STEPS, WIDTH, lookup)
        assert tokens == plain[name][0], name


def test_refusals_name_what_is_wrong(tiny_engine):
    rounds = _rounds(tiny_engine, max_running=2)
    slot, token = _admit(tiny_engine, rounds, PROMPTS["a"])
    with pytest.raises(ValueError, match="verify_width"):
        DecodeRounds(tiny_engine, rounds.pool, max_running=1, graphs="static", verify_width=1)
    with pytest.raises(ValueError, match="2..4 rows"):
        rounds.verify([slot], [[token] * 5])
    with pytest.raises(ValueError, match="2..4 rows"):
        rounds.verify([slot], [[token]])
    other, _ = _admit(tiny_engine, rounds, PROMPTS["b"])
    with pytest.raises(ValueError, match="same number of rows"):
        rounds.verify([slot, other], [[token] * 3, [token] * 2])
    with pytest.raises(InputError, match="outside the vocabulary"):
        rounds.verify([slot], [[token, tiny_engine.cfg.vocab_size]])
    with pytest.raises(ValueError, match="no verify to keep"):
        rounds.keep([slot], [0])
    length = rounds._caches[slot].length
    rounds.verify([slot], [[token, token]])
    with pytest.raises(ValueError, match="keep\\(\\) its accepted rows first"):
        rounds.run([slot], [token])
    with pytest.raises(ValueError, match="must lie in"):
        rounds.keep([slot], [WIDTH])
    rounds.keep([slot], [0])
    assert rounds._caches[slot].length == length + 1
    plain = DecodeRounds(tiny_engine, _pool(tiny_engine), max_running=1, graphs="static")
    with pytest.raises(ValueError, match="verify_width"):
        plain.verify([0], [[token, token]])
