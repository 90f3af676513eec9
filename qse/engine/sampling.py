"""Choosing the next token from logits: greedy, or temperature / top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams, vocab_limit: int | None = None):
        self.params = params
        self.vocab_limit = vocab_limit  # ids past the tokenizer's vocabulary are padding rows
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.reshape(-1)
        if self.vocab_limit is not None:
            logits = logits[: self.vocab_limit]
        if self.params.temperature == 0.0:
            # on the logits' device: 4 bytes come back, not the vocabulary's 1 MB (first maximum on ties,
            # on CPU and CUDA alike)
            return int(torch.argmax(logits))
        logits = logits.float().cpu()  # the seeded generator lives on the CPU: the same draws on any device
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < self.params.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
