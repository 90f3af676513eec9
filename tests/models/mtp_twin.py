"""The MTP head's naive twin (tests/models/test_mtp_forward.py, test_qwen3_5_moe_mtp.py): the head's formula written
out in float64 on a model's own tensors, its layer's MLP the model's kind (dense, or the MoE family's sparse block,
each written here from its formula)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# an MLP's twin: (cfg, the model's tensors in float64, the layer's prefix, h [T, H]) -> [T, H]
MLP = Callable[[object, dict[str, torch.Tensor], str, torch.Tensor], torch.Tensor]


def weights(model) -> dict[str, torch.Tensor]:
    out = {n: t.double() for n, t in model.w.items()}
    out.update({n: lin.weight.double() for n, lin in model.lin.items()})
    out.setdefault("lm_head.weight", out["embed_tokens.weight"])
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [T, heads, D]: the first rotary_dim dims turn by position * theta^(-2i / rotary_dim), pair (i, i + half)."""
    half = rotary_dim // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = positions.double()[:, None, None] * freq  # [T, 1, half]
    a, b, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin(), rest), dim=-1)


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def dense_mlp(cfg, w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    m = p + "mlp."
    return _swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])


def moe_mlp(cfg, w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    """The sparse block a row at a time: softmax over the router's logits, the top k renormalised, each chosen
    expert's SwiGLU weighted by its share; plus the shared expert behind its sigmoid gate."""
    m, width, top_k = p + "mlp.", cfg.moe_intermediate_size, cfg.num_experts_per_tok
    probs = (h @ w[m + "gate.weight"].T).softmax(-1)  # [T, E]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        share, chosen = probs[t].topk(top_k)
        for weight, e in zip(share / share.sum(), chosen.tolist()):
            gate_up = w[m + "experts.gate_up_proj"][e]  # [2I, H]: the gate rows, then the up rows
            out[t] += weight * _swiglu(h[t : t + 1], gate_up[:width], gate_up[width:], w[m + "experts.down_proj"][e])[0]
    s = m + "shared_expert."
    shared = _swiglu(h, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
    return out + torch.sigmoid(h @ w[m + "shared_expert_gate.weight"].T) * shared


def naive_mtp(model, next_ids: torch.Tensor, hidden: torch.Tensor, mlp: MLP = dense_mlp) -> torch.Tensor:
    """g [T, H] float64 of the rows (next_ids[t], hidden[t]) at positions 0 .. T - 1, from the formula:
    fc(cat(norm_e(embed(x)), norm_h(h))) -> one gated-attention decoder layer (its MLP: `mlp`) -> norm."""
    cfg, w, eps = model.cfg, weights(model), model.cfg.rms_norm_eps
    p, a = "mtp.layers.0.", "mtp.layers.0.self_attn."
    num_rows, heads, kv_heads, d = len(next_ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e = w["embed_tokens.weight"][next_ids]
    u = torch.cat((_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden.double(), w["mtp.pre_fc_norm_hidden.weight"], eps)), dim=-1)
    x = u @ w["mtp.fc.weight"].T
    h = _norm(x, w[p + "input_layernorm.weight"], eps)
    qg = (h @ w[a + "q_proj.weight"].T).view(num_rows, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (h @ w[a + "k_proj.weight"].T).view(num_rows, kv_heads, d)
    v = (h @ w[a + "v_proj.weight"].T).view(num_rows, kv_heads, d)
    positions = torch.arange(num_rows)
    q = _rotate(_norm(q, w[a + "q_norm.weight"], eps), positions, cfg.rotary_dim, cfg.rope_theta)
    k = _rotate(_norm(k, w[a + "k_norm.weight"], eps), positions, cfg.rotary_dim, cfg.rope_theta)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # query head i reads kv head i // group
    scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(num_rows, num_rows, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + out.reshape(num_rows, heads * d) @ w[a + "o_proj.weight"].T
    h = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + mlp(cfg, w, p, h)
    return _norm(x, w["mtp.norm.weight"], eps)


def naive_logits(model, g: torch.Tensor) -> torch.Tensor:
    return g @ weights(model)["lm_head.weight"].T


def naive_draft(model, next_ids: torch.Tensor, hidden: torch.Tensor, k: int, mlp: MLP = dense_mlp) -> list[int]:
    """k greedy drafts by the rule: the last row's argmax, then a row of (draft, the last row's g) a draft."""
    ids, rows = next_ids.clone(), hidden.double().clone()
    drafts = []
    for _ in range(k):
        g = naive_mtp(model, ids, rows, mlp)
        drafts.append(int(naive_logits(model, g[-1:]).argmax()))
        ids, rows = torch.cat((ids, torch.tensor(drafts[-1:]))), torch.cat((rows, g[-1:]))
    return drafts
