"""Batched decode rounds (qse/engine/rounds.py) on the tiny model, on CPU with the torch ops, in the static
form of the graph path (the same buffers, staging and calls as under CUDA graphs, without capturing).

Torch's CPU matmul is not row-invariant (one row alone and the same row among others round differently), so
these tests compare greedy tokens; the logits are compared bit for bit where the kernels are row-invariant
(tests/kernels/test_rounds_triton.py, QSE_KERNELS=invariant)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds, buckets_for
from qse.models.inputs import InputError

PAGE_ROWS = 16
STEPS = 5
# different lengths and contents; decoding crosses page lines (16, 32, 48)
PROMPTS = {"a": list(range(300, 313)), "b": list(range(900, 930)), "c": [7, 8, 9] * 15 + [11, 12]}


def _pool(engine, num_pages: int = 64) -> KVPool:
    cfg = engine.cfg
    return KVPool(num_pages, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                  engine.dtype, engine.device)


def _prefill(engine, pool, prompt):
    """A paged cache holding the prompt, and its greedy first token."""
    cache = engine.new_cache(kv=PagedKV(pool))
    logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
    return cache, int(logits[-1].argmax())


def _alone(engine, prompt, steps: int = STEPS) -> list[int]:
    """Today's single-sequence decode: Engine.forward of one token at a time on a contiguous cache."""
    cache = engine.new_cache()
    logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits, _ = engine.forward(cache, engine.ids_tensor(tokens[-1:]), "last")
        tokens.append(int(logits[-1].argmax()))
    return tokens


def _greedy(rounds, slots: dict[str, int], tokens: dict[str, list[int]], steps: int) -> None:
    """`steps` rounds of every sequence in `slots`, appending each one's greedy token."""
    for _ in range(steps):
        names = list(slots)
        logits = rounds.run([slots[n] for n in names], [tokens[n][-1] for n in names])
        for name, row in zip(names, logits.argmax(-1).tolist()):
            tokens[name].append(row)


@pytest.fixture(scope="module")
def solo(tiny_engine):
    """Each prompt's greedy tokens alone on today's path: the first, then STEPS + 3 more."""
    return {name: _alone(tiny_engine, prompt, STEPS + 3) for name, prompt in PROMPTS.items()}


def _prefix(tokens: dict[str, list[int]], steps: int = STEPS) -> dict[str, list[int]]:
    return {name: row[: steps + 1] for name, row in tokens.items()}


def test_buckets_pad_to_at_most_twice_the_rows():
    assert buckets_for(1) == (1,)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(24) == (1, 2, 4, 8, 16, 24)


def test_batched_greedy_equals_alone_and_the_single_sequence_path(tiny_engine, solo):
    """Three sequences of different lengths decoded together for STEPS rounds: each one's tokens equal the
    same sequence through the rounds alone (B = 1) and through today's Engine.forward T = 1 path."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=4, graphs="static")
    assert not rounds.capture
    slots, tokens = {}, {}
    for name, prompt in PROMPTS.items():
        cache, first = _prefill(tiny_engine, pool, prompt)
        slots[name], tokens[name] = rounds.admit(cache), [first]
    _greedy(rounds, slots, tokens, STEPS)
    assert tokens == _prefix(solo)
    for name, prompt in PROMPTS.items():
        assert rounds.release(slots[name]).length == len(prompt) + STEPS
    for name, prompt in PROMPTS.items():  # alone through the same API
        one = DecodeRounds(tiny_engine, _pool(tiny_engine), max_running=1, graphs="static")
        cache, first = _prefill(tiny_engine, one.pool, prompt)
        alone = {name: [first]}
        _greedy(one, {name: one.admit(cache)}, alone, STEPS)
        assert alone[name] == _prefix(solo)[name]


def test_batched_logits_stay_near_the_rows_decoded_alone(tiny_engine):
    """The rows agree with the single-sequence path to the CPU matmul's rounding (a wrong position, page or
    slot would be far off)."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=3, graphs="static")
    names = list(PROMPTS)
    caches = {n: _prefill(tiny_engine, pool, PROMPTS[n]) for n in names}
    slots = [rounds.admit(caches[n][0]) for n in names]
    batched = rounds.run(slots, [caches[n][1] for n in names]).clone()
    for row, name in enumerate(names):
        ref_cache = tiny_engine.new_cache()
        tiny_engine.forward(ref_cache, tiny_engine.ids_tensor(PROMPTS[name]), "none")
        ref, _ = tiny_engine.forward(ref_cache, tiny_engine.ids_tensor([caches[name][1]]), "last")
        torch.testing.assert_close(batched[row], ref[0], rtol=1e-4, atol=1e-4)


def test_sequences_join_and_leave_between_rounds(tiny_engine, solo):
    """a and b start; c joins after two rounds; a leaves after three and its slot goes to d (a again from its
    prompt); everyone's tokens equal their tokens alone."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=3, graphs="static")
    slots, tokens = {}, {}

    def join(name, prompt):
        cache, first = _prefill(tiny_engine, pool, prompt)
        slots[name], tokens[name] = rounds.admit(cache), [first]

    join("a", PROMPTS["a"])
    join("b", PROMPTS["b"])
    _greedy(rounds, slots, tokens, 2)
    join("c", PROMPTS["c"])
    _greedy(rounds, slots, tokens, 1)
    gone = slots.pop("a")
    rounds.release(gone, keep=False).kv.release_all()
    join("d", PROMPTS["a"])
    assert slots["d"] == gone  # the freed slot is taken again
    _greedy(rounds, slots, tokens, STEPS)
    assert tokens["a"] == solo["a"][:4]
    assert tokens["b"] == solo["b"] and tokens["c"] == _prefix(solo, STEPS + 1)["c"]
    assert tokens["d"] == _prefix(solo)["a"]


def test_a_padded_bucket_gives_the_same_tokens(tiny_engine, solo):
    """Three rows in the bucket of 4 (one padding row) and in a bucket of exactly 3."""
    got = {}
    for buckets in ((1, 2, 4), (1, 2, 3, 4)):
        pool = _pool(tiny_engine)
        rounds = DecodeRounds(tiny_engine, pool, max_running=4, graphs="static", buckets=buckets)
        slots, tokens = {}, {}
        for name, prompt in PROMPTS.items():
            cache, first = _prefill(tiny_engine, pool, prompt)
            slots[name], tokens[name] = rounds.admit(cache), [first]
        _greedy(rounds, slots, tokens, STEPS)
        got[buckets] = tokens
    assert got[(1, 2, 4)] == got[(1, 2, 3, 4)] == _prefix(solo)


def test_tokens_from_the_previous_rounds_device_tensor(tiny_engine, solo):
    """Round n+1 takes round n's on-device argmax (rows kept in order) without the host reading it; the
    tokens read back afterwards are the greedy ones."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=4, graphs="static")
    names = list(PROMPTS)
    firsts, slots = {}, []
    for name in names:
        cache, firsts[name] = _prefill(tiny_engine, pool, PROMPTS[name])
        slots.append(rounds.admit(cache))
    launched = []
    ids = torch.tensor([firsts[n] for n in names], device=tiny_engine.device)
    for _ in range(STEPS):
        ids = rounds.run(slots, ids).argmax(-1)
        launched.append(ids)
    got = torch.stack(launched, dim=1).tolist()  # read back once, at the end
    for row, name in enumerate(names):
        assert [firsts[name], *got[row]] == _prefix(solo)[name]


def test_carried_rows_read_the_last_rounds_sampled_ids_and_new_rows_their_host_ids(tiny_engine, solo):
    """carry: rows that go on read the previous round's ids from `sampled` (written on the device, sent back
    one round later), in a new order; a row joining later brings its host id; the tokens are the greedy ones."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=4, graphs="static")
    firsts, slots = {}, {}
    for name in PROMPTS:
        cache, firsts[name] = _prefill(tiny_engine, pool, PROMPTS[name])
        slots[name] = rounds.admit(cache)
    tokens = {"a": [firsts["a"]], "b": [firsts["b"]]}
    order, back = ["a", "b"], None
    for step in range(STEPS):
        if step == 2:  # c joins with its host id; the carried rows change places
            tokens["c"] = [firsts["c"]]
            new = ["c", "b", "a"]
            carry = [-1, order.index("b"), order.index("a")]
            host = [firsts["c"], 0, 0]
        else:
            new = order
            carry = [order.index(n) for n in new] if step else None
            host = [0] * len(new) if step else [tokens[n][-1] for n in new]
        logits = rounds.run([slots[n] for n in new], host, carry)
        rounds.sampled[:len(new)].copy_(logits.argmax(-1))
        if back is not None:  # the last round's ids, read while this one is launched
            for name, token in zip(order, back.ids()):
                tokens[name].append(token)
        back, order = rounds.send_back(len(new)), new
    for name, token in zip(order, back.ids()):
        tokens[name].append(token)
    want = _prefix(solo)
    assert tokens["a"] == want["a"] and tokens["b"] == want["b"]
    assert tokens["c"] == want["c"][:len(tokens["c"])] and len(tokens["c"]) == STEPS - 1


def test_released_state_continues_on_the_single_sequence_path(tiny_engine, solo):
    """release writes the slot's state back: the cache then decodes on through Engine.forward as if it had
    never left it."""
    pool = _pool(tiny_engine)
    rounds = DecodeRounds(tiny_engine, pool, max_running=2, graphs="static")
    cache, first = _prefill(tiny_engine, pool, PROMPTS["b"])
    tokens = {"b": [first]}
    _greedy(rounds, {"b": rounds.admit(cache)}, tokens, 2)
    assert rounds.release(0) is cache and cache.length == len(PROMPTS["b"]) + 2
    for _ in range(STEPS - 2):
        logits, _ = tiny_engine.forward(cache, tiny_engine.ids_tensor(tokens["b"][-1:]), "last")
        tokens["b"].append(int(logits[-1].argmax()))
    assert tokens["b"] == _prefix(solo)["b"]


def test_refusals_name_what_is_wrong(tiny_engine):
    pool = _pool(tiny_engine, num_pages=6)
    rounds = DecodeRounds(tiny_engine, pool, max_running=2, graphs="static")
    assert pool.num_free == 5  # one page is the padding rows' scratch
    with pytest.raises(ValueError, match="PagedKV"):
        rounds.admit(tiny_engine.new_cache())
    first, _ = _prefill(tiny_engine, pool, list(range(40, 40 + 2 * PAGE_ROWS)))  # two full pages
    second, _ = _prefill(tiny_engine, pool, list(range(60, 60 + 2 * PAGE_ROWS)))
    third, _ = _prefill(tiny_engine, pool, [5])
    a, b = rounds.admit(first), rounds.admit(second)
    assert (a, b) == (0, 1) and rounds.admit(third) is None
    with pytest.raises(ValueError, match="already admitted"):
        rounds.admit(first)
    with pytest.raises(ValueError, match="at most once"):
        rounds.run([a, a], [1, 2])
    with pytest.raises(ValueError, match="slot 7 holds no sequence"):
        rounds.run([7], [1])
    with pytest.raises(InputError, match="token id 248320"):
        rounds.run([a], [tiny_engine.cfg.vocab_size])
    with pytest.raises(ValueError, match="1..2 rows"):
        rounds.run([], [])
    assert pool.num_free == 0 and rounds.pages_needed([a, b]) == 2 and not rounds.can_run([a])
    with pytest.raises(MemoryError, match="needs 2"):
        rounds.run([a, b], [1, 2])
    assert (first.length, second.length) == (2 * PAGE_ROWS, 2 * PAGE_ROWS)  # a refused round changes nothing
