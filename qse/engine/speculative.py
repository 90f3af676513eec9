"""Verifying a drafter's tokens against the served model: how many are accepted, and the token after them.

A drafter proposes k ids after a row; the served model reads the row's token and the k drafts in one forward of
k + 1 rows, and its distribution at each of them decides (batched: one row of drafts a running turn):

    drafts      d0   d1   d2                    (k = 3)
    target      p0   p1   p2   p3               (p_i: the served model's next-token law after d0..d_{i-1})
    greedy      argmax p_i == d_i while it holds: a accepted, then argmax p_a (the bonus token when a == k)
    sampled     d_i kept with probability min(1, p_i(d_i) / q_i(d_i)) while kept; at the first refusal the token
                is drawn from max(0, p_i - q_i), renormalised; with all k kept, from p_k

Greedy verification emits exactly the ids plain greedy decoding would, whatever the drafts (a draft only
decides how many come from one forward). Sampled verification (rejection sampling, as in Leviathan et al. and
Chen et al., 2023) emits ids with exactly the served model's law: each emitted id is distributed as p_i. `q`
None stands for a deterministic drafter (a one-hot law at its draft: prompt lookup, the MTP head's greedy
pick): a draft is then kept with probability p_i(d_i), and a refusal draws from p_i without d_i.

Everything stays on the tensors' device: the counts and the next ids come back as tensors (a round reads them
back with its ids), and the draws are exponential races (argmax of w / E, E ~ Exp(1)), the sampler's law for a
multinomial draw without its synchronisation.
"""

from __future__ import annotations

import torch


def _check(drafts: torch.Tensor, target: torch.Tensor, what: str) -> tuple[int, int]:
    if drafts.dim() != 2:
        raise ValueError(f"drafts must be [batch, k] ids, got shape {tuple(drafts.shape)}")
    batch, k = drafts.shape
    if target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(f"{what} must hold k + 1 = {k + 1} rows for each of the {batch} turns, got shape "
                         f"{tuple(target.shape)}")
    return batch, k


def accept_greedy(drafts: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [batch], next [batch]): per turn, the drafts kept (the longest prefix where the served
    model's greedy pick equals the draft) and the served model's pick after them. target_ids: [batch, k + 1]
    greedy picks, row i the pick after the row's token and drafts d0..d_{i-1}."""
    _, k = _check(drafts, target_ids, "target_ids")
    kept = (drafts == target_ids[:, :k]).to(torch.int64).cumprod(dim=1)
    accepted = kept.sum(dim=1)
    return accepted, target_ids.gather(1, accepted[:, None]).squeeze(1)


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row with probability proportional to `weights` (rows of non-negative numbers)."""
    e = torch.empty_like(weights, dtype=torch.float32).exponential_(1.0, generator=generator)
    return (weights.to(torch.float32) / e).argmax(dim=-1)


def accept_sampled(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [batch], next [batch]) by rejection sampling. target_probs: [batch, k + 1, vocab], the served
    model's law at each row (after the sampler's temperature, top-k/p, penalties and mask); draft_probs:
    [batch, k, vocab], the law each draft was drawn from, or None for one-hot drafters."""
    batch, k = _check(drafts, target_probs, "target_probs")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be [batch, k, vocab] = {(batch, k, target_probs.shape[2])}, got "
                         f"{tuple(draft_probs.shape)}")
    p = target_probs.to(torch.float32)
    p_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # p_i(d_i), [batch, k]
    if draft_probs is None:
        keep = p_draft
    else:
        q_draft = draft_probs.to(torch.float32).gather(2, drafts[..., None]).squeeze(-1)
        # a draft its own law gave no weight cannot have been drawn from it: never kept
        keep = torch.where(q_draft > 0, (p_draft / q_draft.clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1.0),
                           torch.zeros_like(p_draft))
    u = torch.rand(keep.shape, generator=generator, device=keep.device)
    accepted = (u < keep).to(torch.int64).cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=p.device)
    law = p[rows, accepted]  # p_a: the row after the last kept draft, [batch, vocab]
    refused = accepted < k
    if bool(refused.any()):
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(law).scatter_(1, drafts[rows, at][:, None], 1.0)
        else:
            q_at = draft_probs.to(torch.float32)[rows, at]
        residual = (law - q_at).clamp(min=0.0)
        # a residual of no weight (p_a == q_a to the last bit) leaves the target's own law to draw from
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, law, residual)
        law = torch.where(refused[:, None], residual, law)
    return accepted, _race(law, generator)


__all__ = ["accept_greedy", "accept_sampled"]
