"""The grammar on the logits (qse/engine/grammar.py): the mask built on the host and applied in place equals the
naive full-vocabulary mask (llguidance's own per-id answer) exactly, at every step; answers sampled from random
logits parse and validate, the closing steps included; whether the grammar ended the answer is read after it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from qse.engine.grammar import Grammar, GrammarError, json_rule
from qse.engine.sampling import SampleRecord, Sampler, SamplingParams

SCHEMA = {"type": "object", "required": ["title", "items"], "additionalProperties": False, "properties": {
    "title": {"type": "string", "maxLength": 12}, "items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "required": ["name", "n"], "additionalProperties": False, "properties": {"name": {"type": "string", "maxLength": 8},
                                                                  "n": {"type": "integer"}}}}}}
ANSWER = '{"title": "build", "items": [{"name": "cpu", "n": 1}, {"name": "disk", "n": 30}]}'


@pytest.fixture(scope="module")
def chat(tiny_engine):
    return tiny_engine.chat


def grammar(chat, max_tokens: int = 256) -> Grammar:
    return Grammar.compile("start: answer\nanswer: " + json_rule(SCHEMA) + "\n",
                           chat.tokenizer.grammar_tokenizer(), max_tokens)


def naive_masked(state, logits: torch.Tensor) -> torch.Tensor:
    """The reference: llguidance's byte per id (its own path, not the bitmask), over the whole vocabulary."""
    vocab = state.grammar.tokenizer.vocab_size
    allowed = torch.frombuffer(bytearray(state._matcher.compute_logit_bias()[:vocab]), dtype=torch.uint8) != 0
    return logits.masked_fill(~allowed, float("-inf"))


def test_the_mask_applied_in_place_equals_the_naive_full_vocabulary_mask_at_every_step(chat):
    g = grammar(chat)
    state = g.start()
    ids = chat.tokenizer.encode(ANSWER) + [g.tokenizer.eos_id]
    gen = torch.Generator().manual_seed(0)
    for token in ids:
        logits = torch.randn(g.tokenizer.vocab_size, generator=gen)
        state.wait()
        expected = naive_masked(state, logits)
        got = state.apply(logits.clone())
        assert torch.equal(got, expected)
        assert bool(torch.isfinite(got[token]))  # the answer's next id is allowed
        assert torch.isinf(got).any()  # and the mask bans something
        state.advance(token)
    assert state.is_done


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_sampled_from_random_logits_parse_and_validate(chat, seed, temperature):
    """Random logits are the random-weight model's: the grammar alone makes the answer valid, and the
    closing steps end it inside a small budget."""
    max_tokens = 40
    g = grammar(chat, max_tokens)
    record = SampleRecord()
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, grammar=g, record=record),
                      vocab_limit=g.tokenizer.vocab_size)
    gen = torch.Generator().manual_seed(100 + seed)
    out = []
    for _ in range(max_tokens):
        token = sampler(torch.randn(g.tokenizer.vocab_size + 7, generator=gen))  # padding rows past the vocab
        if token == g.tokenizer.eos_id:
            break
        out.append(token)
    answer = json.loads(chat.tokenizer.decode(out))
    assert set(answer) <= {"title", "items"} and {"title", "items"} <= set(answer)
    assert all(set(item) == {"name", "n"} and isinstance(item["n"], int) for item in answer["items"])
    assert record.grammar_done and token == g.tokenizer.eos_id


def test_the_same_seed_gives_the_same_answer_and_a_refused_id_is_named(chat):
    g = grammar(chat, 40)
    runs = []
    for _ in range(2):
        sampler = Sampler(SamplingParams(temperature=0.8, seed=5, grammar=g), vocab_limit=g.tokenizer.vocab_size)
        gen = torch.Generator().manual_seed(7)
        runs.append([sampler(torch.randn(g.tokenizer.vocab_size, generator=gen)) for _ in range(12)])
    assert runs[0] == runs[1]
    state = g.start()
    state.wait()
    bad = chat.tokenizer.encode("}")[0]  # an answer cannot start with a closer
    state.advance(bad)
    with pytest.raises(GrammarError, match=f"the grammar refused token {bad}"):
        state.wait()


def test_an_answer_the_budget_cuts_is_not_done(chat):
    g = grammar(chat, 256)
    record = SampleRecord()
    params = replace(SamplingParams(temperature=0.0), grammar=g, record=record)
    sampler = Sampler(params, vocab_limit=g.tokenizer.vocab_size)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        sampler(torch.randn(g.tokenizer.vocab_size, generator=gen))
    assert not record.grammar_done


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_ids_chosen_on_the_device_and_taken_later_equal_the_host_path(chat, temperature):
    """The rounds launched ahead choose a grammar turn's id on the device and hand it to the matcher one step
    later (`taken`): the same ids as the host path, the seeded draws and the closing steps included; an id not
    taken before the next step is refused rather than sampled under a stale mask."""
    max_tokens = 40
    g = grammar(chat, max_tokens)
    params = SamplingParams(temperature=temperature, seed=11, frequency_penalty=0.3, grammar=g)
    host, device = (Sampler(replace(params, record=SampleRecord()), vocab_limit=g.tokenizer.vocab_size)
                    for _ in range(2))
    gen = torch.Generator().manual_seed(21)
    rows = [torch.randn(g.tokenizer.vocab_size + 7, generator=gen) for _ in range(max_tokens)]
    want = []
    for row in rows:
        want.append(host(row))
        if want[-1] == g.tokenizer.eos_id:
            break
    got = []
    for row in rows[:len(want)]:
        token = device.on_device(row)
        assert isinstance(token, torch.Tensor) and token.dim() == 0
        if len(got) == 2:
            with pytest.raises(RuntimeError, match="taken"):
                device.on_device(row)  # the id before was not taken yet
        device.taken(int(token))
        got.append(int(token))
    assert got == want and want[-1] == g.tokenizer.eos_id
    assert device.record.grammar_done and json.loads(chat.tokenizer.decode(got[:-1]))["items"] is not None
