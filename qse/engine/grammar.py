"""Grammars on the logits: a turn's output held to a Lark grammar (llguidance), one token at a time.

    GrammarTokenizer (once a tokenizer: llguidance's token trie, the closers' ranks)
      + lark text --Grammar.compile--> Grammar (checked once a request)
      --Grammar.start(budget)--> GrammarState (a turn's matcher)

    every step:  advance(token) hands the id to a worker thread, which has the matcher take it and builds the
                 next mask there (llguidance releases the GIL) while the device runs the next step's forward:
                 the bitmask, unpacked on the host into a [vocab] bool of the banned ids in pinned memory;
                 apply(logits) waits for it, copies it to the device (non_blocking) and fills the banned
                 logits with -inf in place: one copy and one kernel, no synchronisation. The closing steps
                 decide on the host mask as well, so a forced id costs the device nothing.

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

import numpy as np
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
        self._closers: list[tuple[int, np.ndarray]] | None = None
        self._closers_on: dict[torch.device, dict[int, torch.Tensor]] = {}
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
        self.closer_ids_on(torch.device(device))
        return self

    def token_text(self, token: int) -> str:
        if self._texts is None:
            with self._lock:
                if self._texts is None:
                    self._texts = [self.ll.decode_str([i]) for i in range(self.vocab_size)]
        return self._texts[token]

    def closer_ids(self) -> list[tuple[int, np.ndarray]]:
        """(rank, ids) best rank first: 3 for ids whose text only closes JSON values, 2 for separators."""
        if self._closers is None:
            by_rank: dict[int, list[int]] = {rank: [] for rank in CLOSER_CHARS}
            for i in range(self.vocab_size):
                text = self.token_text(i)
                if text and not self.ll.is_special_token(i):
                    chars = set(text)
                    for rank, allowed in CLOSER_CHARS.items():
                        if chars <= allowed:
                            by_rank[rank].append(i)
                            break
            self._closers = [(rank, np.array(by_rank[rank], dtype=np.int64)) for rank in sorted(by_rank, reverse=True)]
        return self._closers

    def closer_ids_on(self, device: torch.device) -> dict[int, torch.Tensor]:
        """closer_ids() on `device` (copied once: no copy in a turn's closing steps)."""
        ids = self._closers_on.get(device)
        if ids is None:
            ids = self._closers_on[device] = {rank: torch.from_numpy(a).to(device) for rank, a in self.closer_ids()}
        return ids


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
        tokenizer.closer_ids()  # here (the request's preparation), not in a turn's closing steps on the engine
        return cls(text, tokenizer, max_tokens, closing_tokens)

    def start(self) -> "GrammarState":
        return GrammarState(self)


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qse-grammar")


@dataclass
class GrammarState:
    """One turn's matcher. Invariant: `_next` is the worker's job that leaves in `_banned` the mask of the next
    token (the matcher has taken every id in `ids` once it is done); only the worker touches the matcher
    while a job is pending."""

    grammar: Grammar
    num_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    _is_done: bool = False
    _matcher: Any = None
    _words: torch.Tensor | None = None  # [ceil(vocab / 32)] int32: llguidance's bitmask of the allowed ids
    _banned: torch.Tensor | None = None  # [vocab] uint8 (read as bool), pinned on CUDA hosts: 1 = not allowed
    _copied: Any = None  # the CUDA event after the last copy out of `_banned` (the worker waits for it)
    _next: Future | None = None

    def __post_init__(self):
        llg = _llguidance()
        tok = self.grammar.tokenizer
        self._matcher = llg.LLMatcher(tok.ll, self.grammar.text)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        pin = torch.cuda.is_available()
        self._words = torch.full(((tok.vocab_size + 31) // 32,), -1, dtype=torch.int32, pin_memory=pin)
        self._banned = torch.zeros(tok.vocab_size, dtype=torch.uint8, pin_memory=pin)
        self._next = _WORKER.submit(self._fill)

    # ---- on the worker -------------------------------------------------------------------------
    def _fill(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the device has the previous mask: its buffer may be written again
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        # bit j of word i is id 32 i + j (little-endian words): the banned ids are the zero bits
        bits = np.unpackbits(np.bitwise_not(self._words.numpy().view(np.uint8)), bitorder="little",
                             count=self.grammar.tokenizer.vocab_size)
        np.copyto(self._banned.numpy(), bits)

    def _take(self, token: int) -> None:
        m = self._matcher
        if not m.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {m.get_error()}")
        if m.is_stopped():
            self._is_done = m.is_accepting()
        self._fill()

    # ---- on the sampler's thread ---------------------------------------------------------------
    def wait(self) -> None:
        """Until the next token's mask is built (a refused id raises here)."""
        self._next.result()

    def banned(self, device: torch.device) -> torch.Tensor:
        """[vocab] bool on `device`: the ids the grammar does not allow next (a non-blocking copy on CUDA)."""
        self.wait()
        host = self._banned.view(torch.bool)
        if device.type != "cuda":
            return host
        out = host.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] (a float row the caller owns) with every banned id at -inf, in place."""
        return logits.masked_fill_(self.banned(logits.device), float("-inf"))

    def allowed_host(self) -> np.ndarray:
        """[vocab] bool on the host: the ids allowed next (the mask must be built: wait() first)."""
        return self._banned.numpy() == 0

    @property
    def is_done(self) -> bool:
        """The grammar has ended (it accepts the answer and allows nothing more): waits for the worker's
        pending job, so read it once the turn is over, not between two steps."""
        self.wait()
        return self._is_done

    @property
    def is_closing(self) -> bool:
        return self.grammar.max_tokens - self.num_tokens <= self.grammar.closing_tokens

    def closing_choice(self, logits: torch.Tensor) -> int | torch.Tensor | None:
        """In the last tokens of the budget: the id that moves toward the end (see the module's doc), or None
        to let the (masked) model choose. Decided on the host mask: an int where one id is forced; among several
        best-ranked closers, the model's own preference (a device index, read back with the token)."""
        tok = self.grammar.tokenizer
        self.wait()
        allowed = self.allowed_host()
        if allowed[tok.eos_id]:
            return tok.eos_id
        if tok.closing_hint is not None:
            hint = tok.closing_hint(tok.decode(self.ids[-64:]))
            for n in range(len(hint or ""), 0, -1):  # the longest head of the hint that is one allowed id
                first = tok.ll.tokenize_str(hint[:n])
                if len(first) == 1 and allowed[first[0]]:
                    return first[0]
        for rank, ids in tok.closer_ids():
            open_ids = ids[allowed[ids]]
            if len(open_ids) == 1:
                return int(open_ids[0])
            if len(open_ids) > 1:  # the banned ones are -inf in the masked logits: the best is an allowed one
                on_device = tok.closer_ids_on(logits.device)[rank]
                return on_device[logits[on_device].argmax()]
        return None

    def advance(self, token: int) -> None:
        """The sampled id: the worker has the matcher take it and builds the next mask while the caller goes on."""
        self.num_tokens += 1
        self.ids.append(token)
        if token == self.grammar.tokenizer.eos_id:
            self.wait()
            self._is_done = self._matcher.is_accepting()
            return
        self._next = _WORKER.submit(self._take, token)


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
