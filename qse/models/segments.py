"""Encoding a prompt that grows by a turn at a time without encoding all of it again.

A coding agent resends its whole session every turn (100k tokens: ~400k characters, ~25 ms of BPE on one core).
A tokenizer splits text at its special tokens first and encodes the stretches between them one by one, each on
its own (tiktoken's encode, and Hugging Face's added-token extraction for tokens that are not normalized and strip
nothing); the chat template puts a special token between every two messages. So a prompt's ids are the ids of
its stretches in order, and a stretch sent again is looked up, not encoded:

    segments = SegmentedEncoder(specials, encode_stretch, max_chars, prepare=nfc)
    ids = segments.encode(text)         == the tokenizer's own encode(text), id for id
    segments.resize(0)                  keep nothing (the tokenizers start so; `qse serve` sets QSE_TOKEN_CACHE_MB)

Only the stretches of a new turn are encoded. The kept stretches are bounded by their characters (least recently
used first out); a stretch shorter than MIN_KEPT_CHARS is encoded each time (cheaper than keeping it).

Where a tokenizer does not split this way (a special token that strips the whitespace beside it, one matched
after normalisation, a pre-tokenizer that treats the text's first piece apart), `hf_splits_at_added_tokens` says
so and the tokenizer encodes whole texts as before.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping

MIN_KEPT_CHARS = 64


class SegmentedEncoder:
    """`encode(text)`: `prepare(text)` split at every special token (leftmost, the longest at a place), the
    specials' ids, and each stretch between them `encode_stretch(stretch)`, kept up to `max_chars` characters."""

    def __init__(self, specials: Mapping[str, int], encode_stretch: Callable[[str], list[int]],
                 max_chars: int = 0, prepare: Callable[[str], str] | None = None):
        self.max_chars = 0
        self._specials = dict(specials)
        self._encode_stretch = encode_stretch
        self._prepare = prepare
        # longest first: at one place the longest special wins, as the tokenizers' own matching does
        names = sorted(self._specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None
        self._kept: OrderedDict[str, array] = OrderedDict()
        self._kept_chars = 0
        self._lock = threading.Lock()  # encode runs on several threads (the server renders off its loop)
        self.hits = self.misses = 0
        self.resize(max_chars)

    def resize(self, max_chars: int) -> None:
        """Keep up to `max_chars` characters of stretches from now on (0: keep none)."""
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        with self._lock:
            self.max_chars = max_chars
            self._trim()

    def _trim(self) -> None:
        while self._kept_chars > self.max_chars:
            old, _ = self._kept.popitem(last=False)
            self._kept_chars -= len(old)

    @staticmethod
    def splits_cleanly(specials: Iterable[str]) -> bool:
        """No special inside another: then where the text splits does not depend on the order the tokenizer
        tries its specials in (tiktoken's is a set's)."""
        names = [n for n in specials if n]
        return all(a == b or a not in b for a in names for b in names)

    def encode(self, text: str) -> list[int]:
        if self._prepare is not None:
            text = self._prepare(text)
        if self._split is None:
            return list(self._stretch(text))
        out: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # re.split with one group: the matches sit at the odd places
                out.append(self._specials[part])
            elif part:
                out.extend(self._stretch(part))
        return out

    def _stretch(self, part: str) -> list[int] | array:
        if len(part) < MIN_KEPT_CHARS or self.max_chars == 0:
            return self._encode_stretch(part)
        with self._lock:
            ids = self._kept.get(part)
            if ids is not None:
                self._kept.move_to_end(part)
                self.hits += 1
                return ids
            self.misses += 1
        ids = array("i", self._encode_stretch(part))  # outside the lock: another thread's lookups go on
        if len(part) <= self.max_chars:
            with self._lock:
                if part not in self._kept:
                    self._kept[part] = ids
                    self._kept_chars += len(part)
                    self._trim()
        return ids

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"stretches": len(self._kept), "chars": self._kept_chars, "hits": self.hits,
                    "misses": self.misses}


def chars_for_mib(mib: int) -> int:
    """The characters of stretches `mib` MiB holds: a kept character costs about 2 bytes (1 of ASCII text, and
    its share of the ids: ~4 characters an id, 4 bytes an id)."""
    if mib < 0:
        raise ValueError(f"a token cache of {mib} MiB: expected a size >= 0 (0: none)")
    return mib * (1 << 20) // 2


def keep_stretches(segments: "SegmentedEncoder | None", max_chars: int) -> bool:
    """A tokenizer's keep_stretches: resize its encoder; False where it has none (it encodes texts whole)."""
    if segments is None:
        return False
    segments.resize(max_chars)
    return True


# Hugging Face normalizers and pre-tokenizers that act on each piece of the text alone, whatever came before it
_PIECEWISE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "Replace", "StripAccents"}
_PIECEWISE_PRE_TOKENIZERS = {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "UnicodeScripts"}


def hf_splits_at_added_tokens(tokenizer_json: Mapping[str, Any], added: Iterable[Any]) -> tuple[bool, str]:
    """Whether a Hugging Face tokenizer.json encodes a text as its stretches between added tokens, each alone
    (then SegmentedEncoder gives its ids), and if not, why: every added token matched as it is written (not
    normalised) and stripping nothing beside it, a normalizer and pre-tokenizer that act on each piece alone
    (ByteLevel without a prefix space; no Metaspace, which marks the text's first piece apart)."""
    for token in added:
        for flag in ("lstrip", "rstrip", "single_word", "normalized"):
            if getattr(token, flag, False):
                return False, f"added token {token.content!r} has {flag}"
    why = _piecewise(tokenizer_json.get("normalizer"), _PIECEWISE_NORMALIZERS, "normalizers", "normalizer")
    if why is None:
        why = _piecewise(tokenizer_json.get("pre_tokenizer"), _PIECEWISE_PRE_TOKENIZERS, "pretokenizers",
                         "pre_tokenizer")
    if not SegmentedEncoder.splits_cleanly(getattr(t, "content", "") for t in added):
        why = "one added token holds another"
    return why is None, why or ""


def _piecewise(node: Any, allowed: set[str], list_key: str, what: str) -> str | None:
    if node is None:
        return None
    kind = node.get("type") if isinstance(node, dict) else None
    if kind == "Sequence":
        for part in node.get(list_key) or []:
            why = _piecewise(part, allowed, list_key, what)
            if why is not None:
                return why
        return None
    if kind == "ByteLevel" and what == "pre_tokenizer":
        return "its ByteLevel pre-tokenizer adds a prefix space" if node.get("add_prefix_space") else None
    return None if kind in allowed else f"its {what} {kind!r}"
