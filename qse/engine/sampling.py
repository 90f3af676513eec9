"""Choosing the next token from logits, on the logits' device.

    logits [vocab] --penalties (repetition, presence, frequency; from the ids seen) --logit_bias
      --grammar mask (engine/grammar) --temperature, top_k, min_p, top_p --draw (seeded)--> id

Everything runs in torch on the device that holds the logits; what comes back to the host is the
chosen id and, when asked, its log-probability and the top alternatives (a few numbers, never the
vocabulary's row). The draw is the exponential race (argmax of p / E, E ~ Exp(1)), the same law as a
multinomial draw without its synchronisation, from a generator on the logits' device seeded by `seed`.

The conductor calls `Sampler(params, vocab_limit=...)` once a turn and `sampler(logits_row)` once a
token on the served executor's thread, or, for rounds launched ahead, `sampler.on_device(logits_row)` and
`sampler.taken(id)` once that id is read back (a grammar's next mask is built from it while the device runs
the next round's forward). The sampler sees every id it returns, so the state that grows with the output
(the counts the penalties read, the grammar's matcher) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .grammar import Grammar, GrammarState

MAX_TOP_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely ids and their log-probabilities, most likely first


@dataclass
class SampleRecord:
    """What the sampler tells the caller besides the id (filled on the executor's thread, read after
    the id it belongs to was yielded): one entry a sampled id when logprobs are asked, and whether the
    grammar ended with a complete answer."""

    logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: "GrammarState | None" = None  # the turn's grammar (the sampler sets it)

    @property
    def grammar_done(self) -> bool:
        """The grammar ended the answer (read once the turn is over: it waits for the grammar's worker)."""
        return self.grammar is not None and self.grammar.is_done


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: every id
    min_p: float = 0.0  # keep ids with p >= min_p * max p
    repetition_penalty: float = 1.0  # > 1 discourages ids already in the prompt or the output
    presence_penalty: float = 0.0  # subtracted once from an id the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to the logits
    top_logprobs: int | None = None  # None: no log-probabilities; k: the chosen id's and the top k
    prompt_ids: tuple[int, ...] = ()  # what repetition_penalty counts besides the output
    grammar: "Grammar | None" = None  # the output is held to it
    record: SampleRecord | None = field(default=None, compare=False)  # where logprobs and the grammar's end go

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs is not None and not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to apply: the argmax of the raw row is the answer."""
        return (self.temperature == 0.0 and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and not self.logit_bias and self.top_logprobs is None
                and self.grammar is None)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sampler:
    def __init__(self, params: SamplingParams, vocab_limit: int | None = None):
        self.params = params
        self.vocab_limit = vocab_limit  # ids past the tokenizer's vocabulary are padding rows
        self.record = params.record
        self.grammar: GrammarState | None = params.grammar.start() if params.grammar is not None else None
        if self.record is not None and self.grammar is not None:
            self.record.grammar = self.grammar  # whether it ended the answer is read after the turn
        self._device: torch.device | None = None
        self._generator: torch.Generator | None = None
        self._counts: torch.Tensor | None = None  # [vocab] int32: occurrences of each id in the output
        self._in_prompt: torch.Tensor | None = None  # [vocab] bool: ids of the prompt (repetition_penalty)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._untaken = False  # a grammar's id chosen on the device that its matcher has not taken yet

    def _setup(self, device: torch.device, vocab: int) -> None:
        p = self.params
        self._device = device
        self._generator = torch.Generator(device=device)
        if p.seed is not None:
            self._generator.manual_seed(p.seed)
        else:
            self._generator.seed()
        if p.has_penalties:
            self._counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            if p.repetition_penalty != 1.0:
                self._in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
                ids = torch.tensor([i for i in p.prompt_ids if 0 <= i < vocab], dtype=torch.long)
                self._in_prompt[ids.to(device)] = True
        if p.logit_bias:
            ids = torch.tensor([i for i, _ in p.logit_bias if 0 <= i < vocab], dtype=torch.long)
            values = torch.tensor([b for i, b in p.logit_bias if 0 <= i < vocab], dtype=torch.float32)
            self._bias = (ids.to(device), values.to(device))

    @property
    def is_on_device(self) -> bool:
        """Whether the id can be chosen without reading it back at once: no log-probabilities to hand back. Such a
        sampler's id may feed the next decode round before it is read; a grammar's matcher then takes it when it
        is read (`taken`), and the next step's mask is built on the host while the device runs that round."""
        return self.params.top_logprobs is None or self.record is None

    def on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """The id as a 0-d long tensor on the logits' device, never read back here (is_on_device samplers);
        the penalties' counts see it on the device. The same choice as __call__. With a grammar, the id must
        be handed to `taken` (once read) before the next step is sampled: its mask follows from it."""
        if not self.is_on_device:
            raise ValueError("this sampler needs the host (log-probabilities): call it instead")
        logits = logits.reshape(-1)
        if self.vocab_limit is not None:
            logits = logits[: self.vocab_limit]
        if self.params.is_plain_greedy:
            return torch.argmax(logits)
        self._check_taken()
        x, logits = self._shaped(logits)
        if self.grammar is not None:
            x = self.grammar.apply(x)
        token = self._choose(x, logits)
        if isinstance(token, int):  # a closing id forced on the host: a fill, no copy
            token = torch.full((), token, dtype=torch.long, device=logits.device)
        if self._counts is not None:
            self._counts[token] += 1  # stays on the device: an index, no read
        self._untaken = self.grammar is not None
        return token

    def taken(self, token: int) -> None:
        """The id `on_device` chose last, read back: the grammar's worker has the matcher take it and builds the
        next mask (no-op without a grammar)."""
        if self._untaken:
            self._untaken = False
            self.grammar.advance(token)

    def _check_taken(self) -> None:
        if self._untaken:
            raise RuntimeError("the grammar's last id chosen on the device was not taken: "
                               "call taken(id) before the next step")

    def _shaped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row in fp32 after penalties and bias (a copy: the model's row stays as it was), and the row."""
        p = self.params
        if self._device is None:
            self._setup(logits.device, logits.shape[-1])
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        if self._counts is not None:
            counts = self._counts
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if self._in_prompt is not None:
                    seen = seen | self._in_prompt
                penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                x = torch.where(seen, penalised, x)
            if p.frequency_penalty != 0.0:
                x = x - p.frequency_penalty * counts.float()
            if p.presence_penalty != 0.0:
                x = x - p.presence_penalty * (counts > 0).float()
        if self._bias is not None:  # (along the vocabulary: a verify shapes its rows at once)
            x.index_add_(x.dim() - 1, self._bias[0], self._bias[1].expand(*x.shape[:-1], -1))
        return x, logits

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.reshape(-1)
        if self.vocab_limit is not None:
            logits = logits[: self.vocab_limit]
        p = self.params
        if p.is_plain_greedy:
            # on the logits' device: 4 bytes come back, not the vocabulary's 1 MB (first maximum on ties,
            # on CPU and CUDA alike)
            return int(torch.argmax(logits))
        self._check_taken()
        x, logits = self._shaped(logits)
        if self.grammar is not None:
            x = self.grammar.apply(x)  # the mask built on the host while the device ran the step; in place
        token = self._choose(x, logits)
        out = self._read_back(token, logits)
        if self._counts is not None:
            self._counts[out] += 1  # stays on the device: an index, no read
        if self.grammar is not None:
            self.grammar.advance(out)  # the next mask is built on the grammar's worker from here
        return out

    def _choose(self, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor | int:
        p = self.params
        if self.grammar is not None and self.grammar.is_closing:
            forced = self.grammar.closing_choice(x)  # an int: decided on the host, nothing to read back
            if forced is not None:
                return forced
        if p.temperature == 0.0:
            return torch.argmax(x)
        probs = self._law(x)
        race = torch.empty_like(probs).exponential_(generator=self._generator)
        return torch.argmax(probs / race)

    def _law(self, x: torch.Tensor) -> torch.Tensor:
        """The draw's law over the last dim of x (shaped logits, one row or [T, vocab]): temperature, top_k,
        softmax, min_p, top_p; unnormalised where top_p or min_p cut it (the race and rejection sampling take
        weights)."""
        p = self.params
        x = x / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p * sorted_p.sum(-1, keepdim=True)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
        return probs

    @property
    def verifies(self) -> str | None:
        """How a drafted id is verified for this turn: "greedy" (kept while it is the argmax: plain greedy),
        "sampled" (rejection sampling against the law: temperature, top-k/p, min-p, a logit bias), or None
        where the law at a row depends on the ids before it in the same verify (penalties count them, a
        grammar's mask follows them) or where each id's log-probabilities are asked: such a turn decodes one
        id a round."""
        p = self.params
        if p.is_plain_greedy:
            return "greedy"
        if p.temperature > 0.0 and not p.has_penalties and p.grammar is None and p.top_logprobs is None:
            return "sampled"
        return None

    def verify(self, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """The ids a verify yields for this turn: logits [len(drafts) + 1, vocab], row j the law after the
        turn's token and drafts[:j]. Greedy: the drafts while each is the row's argmax, then the argmax after
        them; sampled: rejection sampling (qse/engine/speculative.py), every id distributed as the turn's own
        law. At least one id, at most len(drafts) + 1."""
        from .speculative import accept_greedy, accept_sampled

        kind = self.verifies
        if kind is None:
            raise ValueError("this turn's sampling cannot verify drafts (penalties, a grammar or logprobs)")
        rows = logits[: len(drafts) + 1]
        if self.vocab_limit is not None:
            rows = rows[:, : self.vocab_limit]
        draft = torch.tensor([drafts], dtype=torch.long, device=rows.device)
        if kind == "greedy":
            accepted, nxt = accept_greedy(draft, torch.argmax(rows, dim=-1)[None])
        else:
            x, _ = self._shaped(rows)
            accepted, nxt = accept_sampled(draft, self._law(x)[None], None, generator=self._generator)
        a, n = torch.stack([accepted[0], nxt[0]]).tolist()
        return [*drafts[:a], n]

    def _read_back(self, token: torch.Tensor | int, raw: torch.Tensor) -> int:
        """The id (and the asked log-probabilities of the model's own row) in one copy to the host."""
        k = self.params.top_logprobs
        if k is None or self.record is None:
            return int(token)
        if isinstance(token, int):
            token = torch.tensor(token, device=raw.device)
        logp = torch.log_softmax(raw.float(), dim=-1)
        top = torch.topk(logp, k) if k > 0 else None
        parts = [token.reshape(1).float(), logp[token].reshape(1)]
        if top is not None:
            parts += [top.indices.float(), top.values]
        host = torch.cat(parts).cpu().tolist()
        out = int(host[0])
        pairs = list(zip((int(i) for i in host[2:2 + k]), host[2 + k:])) if k > 0 else []
        self.record.logprobs.append(TokenLogprob(out, host[1], pairs))
        return out
