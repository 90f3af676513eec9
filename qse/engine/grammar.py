"""Grammars on the logits: a turn's output held to a Lark grammar (llguidance), one token at a time.

    GrammarTokenizer (once a tokenizer: llguidance's token trie, the closers' ranks)
      + lark text --Grammar.compile--> Grammar (checked once a request)
      --Grammar.start(budget)--> GrammarState (a turn's matcher)

    every step:  mask (bitmask of the allowed ids, computed on a worker thread while the device runs the
                 step, since llguidance releases the GIL) -> bool on the logits' device -> the sampler
                 fills the rest with -inf;  advance(token) -> the next mask is started at once

Termination. A grammar can only promise a complete answer if the answer fits in the turn's budget. The
pieces that could run on forever are bounded where they are written (the reasoning's tokens, JSON's
whitespace), and in the last `closing_tokens` of the budget the state steers toward the end: the end of
the answer if the grammar allows it, else the text that closes an open value (the chat format's hint),
else a JSON closer (`"`, `}`, `]`), then a separator; the model's own choice only among what is left. An
answer the budget still cuts is reported as cut (finish_reason "length"), never as complete.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# JSON as qse asks llguidance to hold it: compact up to one space after ':' and ',', no other whitespace
# (a random or confused model can otherwise write whitespace for ever)
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ?", "item_separator": ", ?"}
# the closers' ranks in the last tokens of the budget: what ends a value first, then what moves past it
CLOSER_CHARS = {3: set('"}]'), 2: set(",:")}


class GrammarError(ValueError):
    """The grammar (or the JSON schema inside it) cannot be compiled; the message says why."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a runtime dependency: say how to get it rather than fail later
        raise GrammarError("structured outputs need the llguidance package (pip install llguidance)") from exc
    return llguidance


class GrammarTokenizer:
    """llguidance's view of one tokenizer (its token trie: about a second to build, so once a tokenizer).

    decode: ids -> text (for the closing hint); closing_hint: text so far -> the text that closes the
    value left open there, or None (the chat format's, e.g. an open tool-call parameter)."""

    def __init__(self, ll: Any, vocab_size: int, eos_id: int, decode: Callable[[list[int]], str],
                 closing_hint: Callable[[str], str | None] | None = None):
        self.ll = ll
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.decode = decode
        self.closing_hint = closing_hint
        self._ranks: dict[torch.device, torch.Tensor] = {}
        self._texts: list[str] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_tiktoken(cls, encoding: Any, vocab_size: int, eos_id: int, decode: Callable[[list[int]], str],
                      closing_hint: Callable[[str], str | None] | None = None) -> "GrammarTokenizer":
        _llguidance()
        import llguidance.tiktoken

        ll = llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=vocab_size, eos_token=eos_id)
        return cls(ll, vocab_size, eos_id, decode, closing_hint)

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int, eos_id: int, decode: Callable[[list[int]], str],
                closing_hint: Callable[[str], str | None] | None = None) -> "GrammarTokenizer":
        """tokenizer: a Hugging Face `tokenizers.Tokenizer`."""
        llg = _llguidance()
        ll = llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_id)
        return cls(ll, vocab_size, eos_id, decode, closing_hint)

    def warm(self, device: torch.device | str = "cpu") -> "GrammarTokenizer":
        """Build the closers' table now (a pass over the vocabulary) rather than in a turn's last tokens."""
        self.closer_ranks(torch.device(device))
        return self

    def token_text(self, token: int) -> str:
        if self._texts is None:
            with self._lock:
                if self._texts is None:
                    self._texts = [self.ll.decode_str([i]) for i in range(self.vocab_size)]
        return self._texts[token]

    def closer_ranks(self, device: torch.device) -> torch.Tensor:
        """[vocab] float: 3 for ids whose text only closes JSON values, 2 for separators, else 0."""
        ranks = self._ranks.get(device)
        if ranks is None:
            values = torch.zeros(self.vocab_size)
            for i in range(self.vocab_size):
                text = self.token_text(i)
                if text and not self.ll.is_special_token(i):
                    chars = set(text)
                    for rank, allowed in CLOSER_CHARS.items():
                        if chars <= allowed:
                            values[i] = rank
                            break
            ranks = self._ranks[device] = values.to(device)
        return ranks


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one tokenizer; `start` gives a turn its own state."""

    text: str  # llguidance's serialized grammar
    tokenizer: GrammarTokenizer
    max_tokens: int  # the turn's budget
    closing_tokens: int  # the last tokens of the budget in which the state steers toward the end

    @classmethod
    def compile(cls, lark: str, tokenizer: GrammarTokenizer, max_tokens: int,
                closing_tokens: int | None = None) -> "Grammar":
        """closing_tokens: None for half the budget, at most 32."""
        llg = _llguidance()
        text = llg.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer.ll)
        if is_error:
            raise GrammarError("; ".join(messages) if messages else "the grammar does not compile")
        if closing_tokens is None:
            closing_tokens = min(32, max_tokens // 2)
        return cls(text, tokenizer, max_tokens, closing_tokens)

    def start(self) -> "GrammarState":
        return GrammarState(self)


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qse-grammar")


@dataclass
class GrammarState:
    """One turn's matcher. Invariant: `_next` is the mask for the next token (being computed or done)."""

    grammar: Grammar
    num_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    is_done: bool = False  # the grammar has ended (it accepts the answer and allows nothing more)
    _matcher: Any = None
    _bitmask: torch.Tensor | None = None
    _next: Future | None = None

    def __post_init__(self):
        llg = _llguidance()
        tok = self.grammar.tokenizer
        self._matcher = llg.LLMatcher(tok.ll, self.grammar.text)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._bitmask = torch.full(((tok.vocab_size + 31) // 32,), -1, dtype=torch.int32,
                                   pin_memory=torch.cuda.is_available())
        self._next = _WORKER.submit(self._fill)

    def _fill(self) -> None:
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)

    def allowed(self, device: torch.device) -> torch.Tensor:
        """[vocab] bool on `device`: the ids the grammar allows next."""
        self._next.result()
        words = self._bitmask.to(device, non_blocking=True)
        bits = (words.unsqueeze(-1) >> torch.arange(32, device=device, dtype=torch.int32)) & 1
        return bits.reshape(-1)[: self.grammar.tokenizer.vocab_size].bool()

    @property
    def is_closing(self) -> bool:
        return self.grammar.max_tokens - self.num_tokens <= self.grammar.closing_tokens

    def closing_choice(self, allowed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """In the last tokens of the budget: the id that moves toward the end (see the module's doc), or
        None to let the (masked) model choose."""
        tok = self.grammar.tokenizer
        if bool(allowed[tok.eos_id]):
            return torch.tensor(tok.eos_id, device=allowed.device)
        if tok.closing_hint is not None:
            hint = tok.closing_hint(tok.decode(self.ids[-64:]))
            for n in range(len(hint or ""), 0, -1):  # the longest head of the hint that is one allowed id
                first = tok.ll.tokenize_str(hint[:n])
                if len(first) == 1 and bool(allowed[first[0]]):
                    return torch.tensor(first[0], device=allowed.device)
        ranks = tok.closer_ranks(allowed.device)
        ranked = torch.where(allowed, ranks, torch.full_like(ranks, -1.0))
        top = ranked.max()
        if float(top) <= 0:
            return None
        # among the best-ranked closers, the model's own preference
        return torch.where(ranked == top, logits.float(), torch.full_like(logits, float("-inf"),
                                                                          dtype=torch.float32)).argmax()

    def advance(self, token: int) -> None:
        """The sampled id: the matcher takes it and the next mask starts on the worker."""
        self.num_tokens += 1
        self.ids.append(token)
        m = self._matcher
        if token == self.grammar.tokenizer.eos_id:
            self.is_done = m.is_accepting()
            return
        if not m.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {m.get_error()}")
        if m.is_stopped():
            self.is_done = m.is_accepting()
        self._next = _WORKER.submit(self._fill)


# ---- JSON pieces -------------------------------------------------------------------------------


def json_rule(schema: dict[str, Any] | bool) -> str:
    """A Lark right-hand side for JSON that validates against `schema`, in qse's compact style."""
    body = dict(schema) if isinstance(schema, dict) else ({} if schema else {"not": {}})
    style = dict(JSON_STYLE)
    style.update(body.get("x-guidance") or {})
    body["x-guidance"] = style
    return "%json " + json.dumps(body, ensure_ascii=False)


ANY_JSON_OBJECT = {"type": "object"}


def check_schema(schema: Any, tokenizer: GrammarTokenizer) -> None:
    """Compile a schema alone, so a bad one is refused with llguidance's reason before a turn starts."""
    llg = _llguidance()
    try:
        text = llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, (dict, bool)) else {},
                                                      defaults=JSON_STYLE)
    except Exception as exc:  # the converter raises ValueError-like errors with the reason
        raise GrammarError(str(exc)) from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer.ll)
    if is_error:
        raise GrammarError("; ".join(messages) if messages else "the schema does not compile")


__all__ = ["ANY_JSON_OBJECT", "Grammar", "GrammarError", "GrammarState", "GrammarTokenizer", "check_schema",
           "json_rule"]
