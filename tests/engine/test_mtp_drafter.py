"""The MTP drafter (qse/engine/drafters.py) on a tiny random Qwen3.5 with an MTP head: greedy speculative decoding
with its drafts emits plain greedy decoding's ids, token for token; and check_drafter refuses a drafter that does
not fit the served model, naming both.

The served model's side runs as DecodeRounds runs it (static flow, one sequence): decode_step on the GDN state in
a SlotStates slot and KV rows in pages of a pool; a verify of k + 1 rows steps its GDN rows into scratch slots
(VerifyWindow) and keeps the accepted row's state. The rows' final hidden states come from the forward's
"final_hidden" tap, which DecodeRounds does not hand out yet; so the loop is written here over decode_step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mtp_rig import agreeing_tensors

from qse.engine.drafters import DrafterMismatch, DrafterNeeds, MTPDrafter, PromptLookup, check_drafter
from qse.engine.kv import KVPool, PagedKV
from qse.engine.speculative import accept_greedy
from qse.models.cache import VerifyWindow
from qse.models.inputs import DecodeBatch
from qse.models.linear import DenseLinear
from qse.models.qwen3_5 import Qwen35Model, parse_config
from qse.models.qwen3_5.layout import LoadedWeights, is_linear
from qse.models.qwen3_5.presets import preset_config_dict, random_tensors, tiny_mtp_config_dict

# tiny forwards on one thread: on a shared CPU, OpenMP's spinning makes them many times slower at random
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
PAGE_ROWS = 16
STEPS = 44
PROMPTS = {"short": [5, 9, 2, 400, 17, 33], "pages": list(range(100, 131))}  # the second crosses a page line


def _build(tensors: dict[str, torch.Tensor], cfg) -> Qwen35Model:
    weights = LoadedWeights({n: t for n, t in tensors.items() if not is_linear(n)},
                            {n: DenseLinear(t) for n, t in tensors.items() if is_linear(n)})
    return Qwen35Model(cfg, weights, "cpu", torch.float32)


@pytest.fixture(scope="module")
def random_model() -> Qwen35Model:
    cfg = parse_config(tiny_mtp_config_dict())
    return _build(random_tensors(cfg, seed=5), cfg)


@pytest.fixture(scope="module")
def agreeing_model() -> Qwen35Model:
    """A served model whose MTP head's drafts agree with it often, and not always (mtp_rig.agreeing_tensors)."""
    cfg = parse_config(tiny_mtp_config_dict())
    return _build(agreeing_tensors(random_tensors(cfg, seed=5), cfg), cfg)


class Target:
    """One sequence of the served model, run as DecodeRounds runs a slot: GDN state in slot 0, a verify's rows
    stepped into scratch slots 1 .. width, KV rows in pages of a pool; rows' final hiddens through the tap."""

    def __init__(self, model: Qwen35Model, prompt: list[int], width: int):
        cfg = model.cfg
        self.model = model
        self.pool = KVPool(64, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim,
                           model.dtype, model.device)
        self.kv = PagedKV(self.pool)
        cache = model.new_cache(kv=self.kv)
        taps = model.new_taps(len(prompt))
        logits = model.forward(torch.tensor(prompt), cache, "last", taps=taps)
        self.first, self.prompt_hidden = int(logits[-1].argmax()), taps["final_hidden"]
        self.states = model.new_slot_states(1 + width)
        self.states.load(0, cache)
        self.length = len(prompt)

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] and final hiddens [T, H] of ids at positions length .. length + T - 1 (T > 1: a
        verify, nothing kept until keep())."""
        num_rows = len(ids)
        assert self.kv.ensure(self.length + num_rows)
        table = self.kv.device_table()[None].repeat(num_rows, 1)
        positions = torch.arange(self.length, self.length + num_rows, dtype=torch.int32)
        batch = DecodeBatch(positions, torch.zeros(num_rows, dtype=torch.long), table, self.pool,
                            self.pool.num_pages * PAGE_ROWS)
        window = VerifyWindow(torch.tensor([0]), torch.arange(1, num_rows + 1)[None]) if num_rows > 1 else None
        taps = self.model.new_taps(num_rows)
        logits = self.model.decode_step(torch.tensor(ids), self.states, batch, window, taps=taps)
        return logits, taps["final_hidden"]

    def keep(self, accepted: int, verified: bool) -> None:
        if verified:
            self.states.keep(torch.tensor([0]), torch.tensor([1 + accepted]))
        self.length += accepted + 1


def plain_greedy(model, prompt: list[int], steps: int) -> list[int]:
    target = Target(model, prompt, 1)
    tokens = [target.first]
    for _ in range(steps):
        logits, _ = target.rows(tokens[-1:])
        target.keep(0, verified=False)
        tokens.append(int(logits[0].argmax()))
    return tokens


def mtp_greedy(model, prompt: list[int], steps: int, k: int) -> tuple[list[int], list[int]]:
    """Greedy decoding by MTP drafts, verify and keep: the first id, then at least `steps` more, and each verify's
    accepted count."""
    target = Target(model, prompt, k + 1)
    drafter = MTPDrafter(model.mtp_head(), k=k)
    check_drafter(drafter, model)
    drafter.extend(prompt[1:] + [target.first], target.prompt_hidden)
    tokens, counts = [target.first], []
    while len(tokens) <= steps:
        assert len(drafter) == target.length  # the head holds a row for each of the target's committed rows
        drafts = drafter.propose()
        logits, hidden = target.rows(tokens[-1:] + drafts)
        accepted, nxt = accept_greedy(torch.tensor([drafts]), logits.argmax(-1)[None])
        count = int(accepted[0])
        target.keep(count, verified=True)
        drafter.extend(drafts[:count] + [int(nxt[0])], hidden[: count + 1])
        tokens += drafts[:count] + [int(nxt[0])]
        counts.append(count)
    return tokens[: steps + 1], counts


@pytest.mark.parametrize("head", ["random", "agreeing"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_speculative_greedy_equals_plain_greedy(random_model, agreeing_model, head, k):
    model = random_model if head == "random" else agreeing_model
    for name, prompt in PROMPTS.items():
        want = plain_greedy(model, prompt, STEPS)
        tokens, counts = mtp_greedy(model, prompt, STEPS, k)
        assert tokens == want, (name, k)
        accepted = sum(counts)
        print(f"{head} head, k={k}, {name}: {accepted} of {k * len(counts)} drafts accepted in {len(counts)} "
              f"verifies, counts {sorted(set(counts))}")
        if head == "agreeing":  # the accept paths are covered: drafts kept, and refused too
            assert 0 in counts and max(counts) == k, counts


# ---- what a drafter needs of the served model ----------------------------------------------------------------
def _stub_model(preset: str, taps=("final_hidden",), names=("embed_tokens.weight", "lm_head.weight")):
    return SimpleNamespace(cfg=parse_config(preset_config_dict(preset)), TAPS=taps, w=dict.fromkeys(names), lin={})


def _stub_head(preset: str):
    cfg = parse_config(preset_config_dict(preset))
    return SimpleNamespace(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                           shared_tensors=("embed_tokens.weight",), new_cache=lambda kv, capacity: None)


def test_prompt_lookup_needs_nothing_of_the_model():
    assert PromptLookup().requires() == DrafterNeeds()
    check_drafter(PromptLookup(), _stub_model("qwen3.5-9b", taps=(), names=()))


def test_the_mtp_drafter_needs_the_final_hidden_and_the_shared_head(random_model):
    drafter = MTPDrafter(random_model.mtp_head(), k=2)
    assert drafter.requires() == DrafterNeeds(hidden_size=64, vocab_size=512, taps=("final_hidden",),
                                              tensors=("embed_tokens.weight", "lm_head.weight"))
    check_drafter(drafter, random_model)


def test_a_head_of_another_size_is_refused_by_name():
    drafter = MTPDrafter(_stub_head("qwen3.5-0.8b"))
    with pytest.raises(DrafterMismatch, match="drafter 'mtp' does not fit the served model: it reads hidden "
                                              "states 1024 wide, the model's are 4096"):
        check_drafter(drafter, _stub_model("qwen3.5-9b"))
    check_drafter(MTPDrafter(_stub_head("qwen3.5-9b")), _stub_model("qwen3.5-9b"))


def test_a_vocabulary_a_tap_or_a_tensor_the_model_lacks_is_named(random_model):
    drafter = MTPDrafter(random_model.mtp_head())
    other = parse_config(tiny_mtp_config_dict(vocab_size=1024))
    with pytest.raises(DrafterMismatch, match="its vocabulary has 512 ids, the model's 1024"):
        check_drafter(drafter, SimpleNamespace(cfg=other, TAPS=("final_hidden",), w={}, lin={}))
    same = random_model.cfg
    with pytest.raises(DrafterMismatch, match=r"tap 'final_hidden', the model hands out \(\)"):
        check_drafter(drafter, SimpleNamespace(cfg=same, TAPS=(), w={}, lin={}))
    with pytest.raises(DrafterMismatch, match="tensor 'embed_tokens.weight'"):
        check_drafter(drafter, SimpleNamespace(cfg=same, TAPS=("final_hidden",), w={}, lin={}))


def test_the_drafter_rolls_back_and_refuses_bad_k(random_model):
    with pytest.raises(ValueError, match="k .* must be an integer >= 1, got 0"):
        MTPDrafter(random_model.mtp_head(), k=0)
    drafter = MTPDrafter(random_model.mtp_head(), k=2)
    hidden = torch.randn(6, 64)
    drafter.extend([1, 2, 3, 4, 5, 6], hidden)
    want = drafter.propose()
    assert len(drafter) == 6 and len(want) == 2
    drafter.rollback_to(4)
    drafter.extend([5, 6], hidden[4:])
    assert drafter.propose() == want


def test_mtp_measure_times_the_drafts(tmp_path):
    """The draft-cost benchmark's CPU rehearsal: a row a draft length, each with the extends a verify hands
    back and the ratio to a decode round it derives from what it records."""
    out = subprocess.run([sys.executable, "benchmarks/mtp_measure.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [written] = list(tmp_path.glob("mtp_measure-*.json"))
    result = json.loads(written.read_text())
    assert result["device"] == "cpu" and result["preset"] == "tiny-mtp" and "command" in result
    assert [r["k"] for r in result["rows"]] == [1, 2, 3]
    for r in result["rows"]:
        assert r["draft_ms"] > 0 and r["draft_graph_ms"] is None and sorted(r["extend_ms"]) == [
            str(n) for n in range(1, r["k"] + 2)]
        assert r["x_decode_round"] == round((r["draft_ms"] + r["extend_ms"][str(r["k"] + 1)]) / r["decode_round_ms"], 4)
    assert result["output_head_nbytes"] == 512 * 64 * 4
