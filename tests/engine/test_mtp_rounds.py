"""The MTP head drafting inside DecodeRounds (qse/engine/rounds.py, mtp=True), on a tiny random Qwen3.5 with an MTP
head, on CPU with the torch ops, in the static form of the graph path.

Two sequences of different lengths (each crossing a page line as it decodes) decode greedily by verify, keep and
the rounds' own batched draft (its drafts on the device, the next verify's rows built there); the ids equal plain
greedy decoding's (one-row rounds of both), token for token. Torch's CPU matmul is not row-invariant, so the ids
are compared exactly and nothing else (as tests/engine/test_verify.py does). A head built to agree with the served
model often (tests/engine/test_mtp_drafter.py's) makes every acceptance count from 0 to k turn up."""

from __future__ import annotations

import pytest
import torch
from mtp_rig import agreeing_tensors

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds, mtp_kv_slot, pool_slots_for
from qse.engine.speculative import accept_greedy
from qse.models import ResolvedModel
from qse.models.linear import DenseLinear
from qse.models.qwen3_5 import Qwen35Model, parse_config
from qse.models.qwen3_5.layout import LoadedWeights, is_linear
from qse.models.qwen3_5.presets import random_tensors, tiny_mtp_config_dict

# tiny forwards on one thread: on a shared CPU, OpenMP's spinning makes them many times slower at random
pytestmark = pytest.mark.usefixtures("one_thread")
PAGE_ROWS = 16
PROMPTS = [list(range(100, 113)), [5, 9, 2, 400, 17, 33] * 4 + [8, 1, 7, 3, 2]]  # 13 and 29 rows: lines at 16, 32
STEPS = 24
RUN_EVERY = 5  # every 5th step is a plain round (a run), then the head drafts after it


def _engine(tensors: dict[str, torch.Tensor], cfg) -> Engine:
    weights = LoadedWeights({n: t for n, t in tensors.items() if not is_linear(n)},
                            {n: DenseLinear(t) for n, t in tensors.items() if is_linear(n)})
    model = Qwen35Model(cfg, weights, "cpu", torch.float32)
    return Engine(ResolvedModel(model, None, "tiny-mtp", "random", model.family, "tiny-mtp-test"))


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    """random: the head's drafts are nearly always refused. agreeing: a served model that is nearly a bigram
    model and a head that is that bigram model (mtp_rig.agreeing_tensors): drafts kept often, not always."""
    cfg = parse_config(tiny_mtp_config_dict())
    t = random_tensors(cfg, seed=5)
    out = {"random": _engine(t, cfg)}
    out["agreeing"] = _engine(agreeing_tensors(t, cfg), cfg)
    return out


def _pool(engine, mtp: bool) -> KVPool:
    cfg = engine.cfg
    return KVPool(24, PAGE_ROWS, pool_slots_for(cfg, mtp), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)


def _prefill(engine, rounds, prompt) -> tuple[int, int, torch.Tensor]:
    """The prompt read with its final-hidden taps: (slot, first greedy id, the taps [n, H])."""
    cache = engine.new_cache(kv=PagedKV(rounds.pool))
    taps = engine.model.new_taps(len(prompt))
    logits = engine.model.forward(torch.tensor(prompt), cache, "last", taps=taps)
    return rounds.admit(cache), int(logits[-1].argmax()), taps["final_hidden"]


def plain_greedy(engine, steps: int) -> list[list[int]]:
    rounds = DecodeRounds(engine, _pool(engine, False), max_running=2, graphs="static")
    slots, tokens = [], []
    for prompt in PROMPTS:
        slot, first, _ = _prefill(engine, rounds, prompt)
        slots.append(slot)
        tokens.append([first])
    for _ in range(steps):
        ids = rounds.run(slots, [t[-1] for t in tokens]).argmax(-1).tolist()
        for t, i in zip(tokens, ids):
            t.append(i)
    return tokens


def mtp_greedy(engine, steps: int, k: int, prompt_rows: bool = True) -> tuple[list[list[int]], list[int]]:
    """Greedy decoding of both prompts by the rounds' MTP drafts: verify [next, drafts] (built on the device), keep,
    draft after it; every RUN_EVERY-th step a plain round and a draft after it. Each sequence's ids (the first,
    then at least `steps` more) and every verify's accepted counts. prompt_rows False: no mtp_prefill (the first
    round is a plain one)."""
    rounds = DecodeRounds(engine, _pool(engine, True), max_running=2, graphs="static", verify_width=k + 1, mtp=True)
    slots, tokens, first_drafts = [], [], []
    for prompt in PROMPTS:
        slot, first, hidden = _prefill(engine, rounds, prompt)
        slots.append(slot)
        tokens.append([first])
        if prompt_rows:
            drafts = rounds.mtp_prefill(slot, prompt[1:] + [first], hidden)
            assert drafts.shape == (k,) and drafts.dtype == torch.long
            first_drafts.append(drafts)
    nxt = torch.tensor([t[0] for t in tokens])
    rows = torch.cat((nxt[:, None], torch.stack(first_drafts)), 1) if prompt_rows else None
    counts, step = [], 0
    while min(len(t) for t in tokens) <= steps:
        if rows is None or step % RUN_EVERY == RUN_EVERY - 1:
            nxt = rounds.run(slots, nxt).argmax(-1)  # the round's tokens on the device
            for t, i in zip(tokens, nxt.tolist()):
                t.append(i)
            drafts = rounds.draft(slots, nxt)  # after a run: the head's row of it, accepted 0
        else:
            logits = rounds.verify(slots, rows)
            accepted, nxt = accept_greedy(rows[:, 1:], logits.argmax(-1))
            kept = accepted.tolist()
            rounds.keep(slots, kept)
            for t, r, a, n in zip(tokens, rows.tolist(), kept, nxt.tolist()):
                t += r[1 : 1 + a] + [n]
            counts += kept
            # the counts as the device has them (a launch-ahead caller's), or as the host read them back
            drafts = rounds.draft(slots, nxt, accepted if step % 2 else kept)
        assert drafts.shape == (2, k)
        rows = torch.cat((nxt[:, None], drafts), 1)
        step += 1
    for slot, prompt, t in zip(slots, PROMPTS, tokens):  # each sequence's length is its committed ids'
        assert rounds._caches[slot].length == len(prompt) + len(t) - 1
    return [t[: steps + 1] for t in tokens], counts


@pytest.fixture(scope="module")
def plain(engines) -> dict[str, list[list[int]]]:
    return {name: plain_greedy(engine, STEPS) for name, engine in engines.items()}


@pytest.mark.parametrize("head", ["random", "agreeing"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_rounds_emit_plain_greedy_ids(engines, plain, head, k):
    tokens, counts = mtp_greedy(engines[head], STEPS, k)
    assert tokens == plain[head], (head, k)
    print(f"{head} head, k={k}: {sum(counts)} of {k * len(counts)} drafts kept, counts {sorted(set(counts))}")
    if head == "agreeing":  # every accept path: no draft kept, some, all
        assert set(counts) == set(range(k + 1)), counts


def test_without_the_prompt_rows_the_drafts_are_worse_not_wrong(engines, plain):
    """No mtp_prefill: the head's prompt rows are whatever the pages held; the first round is a plain one and
    the ids are still plain greedy's."""
    tokens, _ = mtp_greedy(engines["agreeing"], 12, 2, prompt_rows=False)
    assert tokens == [t[:13] for t in plain["agreeing"]]


def test_the_head_s_rows_share_the_target_s_pages(engines):
    """The head's rows sit in the KV slot past the model's attention layers, in the sequence's own pages: the
    prefill writes them there and nowhere else, and a draft's rows reach past the round into pages it ensured."""
    engine = engines["random"]
    rounds = DecodeRounds(engine, _pool(engine, True), max_running=2, graphs="static", verify_width=4, mtp=True)
    slot_kv = mtp_kv_slot(engine.cfg)
    assert slot_kv == len(engine.cfg.attention_layers) == rounds.pool.num_slots - 1
    prompt = PROMPTS[0]
    rounds.pool.k.fill_(float("nan"))
    slot, first, hidden = _prefill(engine, rounds, prompt)
    cache = rounds._caches[slot]
    rounds.mtp_prefill(slot, prompt[1:] + [first], hidden)
    page = cache.kv.pages[0]
    assert torch.isfinite(rounds.pool.k[page, slot_kv, : len(prompt)]).all()  # the prompt's rows, 0 .. n - 1
    head_cache = engine.model.mtp_head().new_cache()
    want = engine.model.mtp_head().forward(torch.tensor(prompt[1:] + [first]), hidden, head_cache)
    assert torch.isfinite(want).all()
    # a verify of 4 rows and drafts of 3 after it: rows up to length + 3 + 2, past the page line at 16
    assert rounds.pages_needed([slot], 4) == 1
    rows = [[first, 1, 2, 3]]
    rounds.verify([slot], rows)
    rounds.keep([slot], [3])
    assert len(cache.kv.pages) == 2
    drafts = rounds.draft([slot], [4], [3])
    assert drafts.shape == (1, 3)
    second = cache.kv.pages[1]
    # the head's rows of the verify (13 .. 16) and the drafts' (17, 18), across the line
    assert torch.isfinite(rounds.pool.k[second, slot_kv, : 19 - PAGE_ROWS]).all()


def test_rounds_whose_head_reads_its_rows_alone_leave_it_as_drafting_ones_do(engines):
    """A round after which no turn will verify lets the head read the round's rows and draft nothing (k = 0: the
    output head, most of a draft's cost, unread). Its KV rows are the same as after one-id drafts, so the next
    real draft is the same ids: torch.equal after runs with k = 0 and runs with k = 1."""
    engine = engines["agreeing"]
    drafts = {}
    for k_between in (0, 1):
        rounds = DecodeRounds(engine, _pool(engine, True), max_running=2, graphs="static", verify_width=4, mtp=True)
        slots, nxt = [], []
        for prompt in PROMPTS:
            slot, first, hidden = _prefill(engine, rounds, prompt)
            rounds.mtp_prefill(slot, prompt[1:] + [first], hidden)
            slots.append(slot)
            nxt.append(first)
        ids = torch.tensor(nxt)
        for _ in range(6):  # across the page line at 16 (the first prompt's 13 rows + 6)
            ids = rounds.run(slots, ids).argmax(-1)
            between = rounds.draft(slots, ids, k=k_between)
            assert between.shape == (2, k_between) and between.dtype == torch.long
        ids = rounds.run(slots, ids).argmax(-1)
        drafts[k_between] = rounds.draft(slots, ids, k=3).clone()
    assert drafts[0].shape == (2, 3) and torch.equal(drafts[0], drafts[1])


def test_refusals_name_what_is_wrong(engines):
    engine = engines["random"]
    with pytest.raises(ValueError, match=r"KV slot 1 of the pool, which has 1 slots: build it with "
                                         r"pool_slots_for\(cfg, mtp=True\) = 2"):
        DecodeRounds(engine, _pool(engine, False), max_running=1, graphs="static", verify_width=3, mtp=True)
    with pytest.raises(ValueError, match="verify_width >= 2"):
        DecodeRounds(engine, _pool(engine, True), max_running=1, graphs="static", mtp=True)
    rounds = DecodeRounds(engine, _pool(engine, True), max_running=2, graphs="static", verify_width=3, mtp=True)
    slot, first, hidden = _prefill(engine, rounds, PROMPTS[0])
    with pytest.raises(ValueError, match="follows the round of its slots"):
        rounds.draft([slot], [first])
    with pytest.raises(ValueError, match="1..2 ids"):
        rounds.mtp_prefill(slot, PROMPTS[0][1:] + [first], hidden, k=3)
    with pytest.raises(ValueError, match="pairs 1..13 of them"):
        rounds.mtp_prefill(slot, list(range(14)), torch.zeros(14, engine.cfg.hidden_size))
    rounds.mtp_prefill(slot, PROMPTS[0][1:] + [first], hidden)
    rounds.verify([slot], [[first, 1, 2]])
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        rounds.draft([slot], [first], [3])
    with pytest.raises(ValueError, match=r"0..2 ids \(verify_width - 1\); got k=3"):
        rounds.draft([slot], [first], [0], k=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rounds.draft([slot], [engine.cfg.vocab_size])
    other, token, _ = _prefill(engine, rounds, PROMPTS[1])
    with pytest.raises(ValueError, match=r"the last round ran \[0\]; got \[0, 1\]"):
        rounds.draft([slot, other], [first, token])
    plain = DecodeRounds(engine, _pool(engine, True), max_running=1, graphs="static", verify_width=3)
    with pytest.raises(ValueError, match="no MTP head"):
        plain.draft([0], [first])


def test_the_head_s_slot_starts_at_zero_and_the_target_s_slots_are_untouched(engines):
    """Rows the head never wrote (a prompt's grid chunks, a restored session's pages) hold zeros, never NaN: its
    attention over them stays finite. The target's slots are not written."""
    engine = engines["random"]
    pool = _pool(engine, True)
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    DecodeRounds(engine, pool, max_running=1, graphs="static", verify_width=3, mtp=True)
    head = mtp_kv_slot(engine.cfg)
    assert torch.equal(pool.k[:, head], torch.zeros_like(pool.k[:, head]))
    assert torch.equal(pool.v[:, head], torch.zeros_like(pool.v[:, head]))
    assert pool.k[:, :head].isnan().all() and pool.v[:, :head].isnan().all()
