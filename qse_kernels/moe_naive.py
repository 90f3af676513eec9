"""The naive twins of qse_kernels/moe.py: Qwen3.5-MoE's sparse MLP block in plain torch, readable top to bottom.

The block (transformers' Qwen3_5MoeSparseMoeBlock) on tokens x [T, H]:

    logits  = x @ router_w^T                          [T, E]   in x's dtype
    probs   = softmax(logits, fp32)                   [T, E]
    ids     = the top_k experts by logit              [T, k]   rank 0 the largest
    weights = probs[ids] / sum(probs[ids]), to x's dtype       (always renormalised: the config has no switch)
    y[t, r] = down[e] @ (silu(gate[e] @ x_t) * up[e] @ x_t)   e = ids[t, r]; gate rows first in gate_up[e]
    shared  = shared_down @ (silu(gate_s @ x_t) * up_s @ x_t)  on every token
    out     = sum_r weights[t, r] * y[t, r] + sigmoid(x_t @ shared_gate_w^T) * shared

Layouts (as transformers stores them): router_w [E, H]; gate_up [E, 2I, H]; down [E, H, I]; the shared expert
fused the way qse fuses a dense MLP, shared_gate_up [2Is, H] (transformers' gate_proj rows, then up_proj's) and
shared_down [H, Is]; shared_gate_w [1, H].

The tie rule: experts are ranked by logit, largest first, and equal logits rank the lower expert index first
(a stable sort). Ranking the logits rather than the probabilities is the same order (softmax is monotone),
except where two different logits round to one probability; there torch.topk (transformers) has no
promised order at all. A NaN logit counts as -inf.

Rounding (the Triton kernels round at the same points): every projection's output is rounded to x's dtype
(as F.linear does), so are silu(gate) and the product with up, the routing weights and the shared gate's
logit; the combine sums in fp32, in rank order r = 0..k-1 and then the shared expert, and rounds once.
transformers instead rounds each weighted expert output and adds them in bf16 in expert-index order: the
same function, identical in fp32 up to the order of the sum, within bf16 rounding otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids [T, k] int64, weights [T, k] in logits' dtype), rank 0 the largest logit;
    equal logits: the lower expert index first. weights are the softmax (fp32, over all E experts) at ids,
    renormalised to sum to one over the k."""
    lf = logits.float()
    lf = torch.where(lf.isnan(), float("-inf"), lf)  # as the kernel: a NaN logit is never picked before a number
    ids = torch.sort(lf, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = torch.softmax(lf, dim=-1).gather(-1, ids)
    return ids, (top / top.sum(-1, keepdim=True)).to(logits.dtype)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: x [M, H], gate_up [2I, H] (gate rows first), down [H, I] -> [M, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """sum_r weights[:, r] * y[:, r] (+ shared_gate * shared) in fp32, in rank order, rounded once to y's dtype.
    y [T, k, H]; weights [T, k]; shared [T, H]; shared_gate [T, 1] fp32."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for r in range(y.shape[1]):
        acc = acc + weights[:, r:r + 1].float() * y[:, r].float()
    if shared is not None:
        acc = acc + shared_gate * shared.float()
    return acc.to(y.dtype)


def _expert_outputs(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """y [T, k, H]: y[t, r] = expert ids[t, r] on x[t], each expert run once on all of its rows."""
    y = x.new_empty(ids.shape[0], ids.shape[1], x.shape[1])
    for e in torch.unique(ids).tolist():
        rows, ranks = torch.where(ids == e)
        y[rows, ranks] = expert_mlp(x[rows], gate_up[e], down[e])
    return y


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The routed experts alone: x [T, H], ids [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I] ->
    sum_r weights[t, r] * expert_{ids[t, r]}(x[t]), [T, H] in x's dtype."""
    return combine(_expert_outputs(x, ids, gate_up, down), weights)


def moe_block(x: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              shared_gate_up: torch.Tensor, shared_down: torch.Tensor, shared_gate_w: torch.Tensor,
              top_k: int) -> torch.Tensor:
    """Qwen3.5-MoE's sparse MLP block on x [T, H] -> [T, H] (layouts in the module docstring)."""
    ids, weights = moe_route(F.linear(x, router_w), top_k)
    shared = expert_mlp(x, shared_gate_up, shared_down)
    shared_gate = torch.sigmoid(F.linear(x, shared_gate_w).float())  # [T, 1]: the logit rounded, then fp32
    return combine(_expert_outputs(x, ids, gate_up, down), weights, shared, shared_gate)


__all__ = ["combine", "expert_mlp", "moe_block", "moe_experts", "moe_route"]
