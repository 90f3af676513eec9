"""The Qwen3.5 text model's forward, one sequence at a time, readable top to bottom.

Layers come in a 3 : 1 pattern: Gated DeltaNet (GDN) layers carry a recurrent state [Hv, Dk, Dv]
(fp32) and a conv state [K-1, C]; gated full-attention layers write K/V rows. `forward` reads T new
tokens at absolute positions [pos, pos + T) on top of a SequenceCache and updates it in place.
T == 1 takes the recurrent step (decode); any other T takes the chunked rule (chunk 64).

The per-op functions come from an `ops` namespace: the naive torch twins by default, Triton
kernels on the engine's fast path. Both give the same result up to rounding; the exactness
contract (replay == fresh prefill) needs only that one path is used on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import torch
import torch.nn.functional as F

import qse_kernels.naive as naive_ops

from ..cache import ContiguousKV, SequenceCache
from ..linear import DenseLinear
from .config import TextConfig
from .layout import LoadedWeights

GDN_CHUNK = 64

Logits = Literal["last", "all", "none", "row"]


@dataclass
class Step:
    """What one forward needs besides the ids and the cache, kept on the device so that a CUDA graph
    can hold it: a captured forward reads its position from `start`, never from the host."""

    start: torch.Tensor  # int32 [1]: the position of the first id
    num_tokens: int
    pos: int | None = None  # the same position on the host (eager); None inside a captured graph
    logit_row: torch.Tensor | None = None  # long [1]: the row whose logits logits="row" returns
    max_rows: int | None = None  # a bound on pos + T (sizes the attention launch; exact when eager)


class InputError(ValueError):
    """Bad ids or positions handed to the model."""


def default_ops() -> SimpleNamespace:
    return SimpleNamespace(
        rms_norm=naive_ops.rms_norm,
        gated_rms_norm=naive_ops.gated_rms_norm,
        causal_conv1d=naive_ops.causal_conv1d,
        gdn_gating=naive_ops.gdn_gating,
        chunk_gated_delta_rule=naive_ops.chunk_gated_delta_rule,
        recurrent_gated_delta_rule=naive_ops.recurrent_gated_delta_rule,
        attention=naive_ops.attention,
        paged_attention=naive_ops.paged_attention,
        dense_matmul=naive_ops.dense_matmul,
    )


class Qwen35Model:
    family = "qwen3_5"

    def __init__(self, cfg: TextConfig, weights: LoadedWeights, device: torch.device | str, dtype: torch.dtype,
                 ops: SimpleNamespace | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.w = weights.tensors
        self.lin = weights.linears
        self.ops = ops or default_ops()
        if self.device.type == "cuda" and ops is None:
            # the einsum twin materialises fp32 scores; on a GPU the fused kernel is the reference
            # (naive.paged_attention takes it on CUDA by itself)
            self.ops.attention = naive_ops.sdpa_attention
        self.embed = self.w["embed_tokens.weight"]
        self.lm_head = DenseLinear(self.embed) if cfg.tie_word_embeddings else DenseLinear(self.w["lm_head.weight"])
        self.attn_slot = {layer: slot for slot, layer in enumerate(cfg.attention_layers)}
        self.gdn_slot = {layer: slot for slot, layer in enumerate(cfg.gdn_layers)}
        rd = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=self.device) / rd))
        self._mm_out_fp32: bool | None = None  # whether torch.mm(out_dtype=float32) works here (tried once)
        self.skipped_tensors = len(weights.skipped)
        self.mtp_tensors = len(weights.mtp)

    # ---- state -------------------------------------------------------------------------------
    def new_cache(self, kv=None, capacity: int = 1024) -> SequenceCache:
        cfg = self.cfg
        if kv is None:
            kv = ContiguousKV(len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device, capacity)
        n = len(cfg.gdn_layers)
        recurrent = [torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                 dtype=torch.float32, device=self.device) for _ in range(n)]
        conv = [torch.zeros(cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim, dtype=self.dtype, device=self.device)
                for _ in range(n)]
        return SequenceCache(kv=kv, recurrent=recurrent, conv=conv, length=0)

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 1:
            raise InputError(f"ids must be a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise InputError("empty input: at least one token id is needed")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, logits: Logits = "last",
                check: bool = True, logit_row: int | None = None) -> torch.Tensor | None:
        """Read ids [T] at positions [cache.length, cache.length + T); returns logits (fp32) per `logits`
        ("row": the logits of row `logit_row` only)."""
        if check:
            self.check_ids(ids)
        pos = cache.length
        num_tokens = ids.shape[0]
        if pos + num_tokens > self.cfg.max_position_embeddings:
            raise InputError(f"position {pos + num_tokens} exceeds the model window {self.cfg.max_position_embeddings}")
        if not cache.kv.ensure(pos + num_tokens):
            raise MemoryError(f"KV store cannot hold {pos + num_tokens} rows")
        if logits == "row" and not (logit_row is not None and 0 <= logit_row < num_tokens):
            raise InputError(f"logit_row {logit_row!r} must name one of the {num_tokens} rows read")
        step = Step(torch.tensor([pos], dtype=torch.int32, device=self.device), num_tokens, pos,
                    None if logit_row is None else torch.tensor([logit_row], device=self.device), pos + num_tokens)
        out = self.forward_step(ids.to(self.device), cache, step, logits)
        cache.length = pos + num_tokens
        return out

    @torch.inference_mode()
    def forward_step(self, ids: torch.Tensor, cache: SequenceCache, step: Step, logits: Logits) -> torch.Tensor | None:
        """The forward itself: device work only, no host reads, no checks, cache.length untouched (what a
        CUDA graph captures). A paged KV store is written and read through its page table on the device."""
        num_tokens = step.num_tokens
        x = F.embedding(ids, self.embed)  # [T, h]
        positions = step.start.long() + torch.arange(num_tokens, device=self.device)
        emb = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [T, rotary_dim]
        rows = _PagedRows.of(cache.kv, positions)
        for layer, kind in enumerate(self.cfg.layer_types):
            p = f"layers.{layer}."
            h = self.ops.rms_norm(x, self.w[p + "input_layernorm.weight"], self.cfg.rms_norm_eps)
            if kind == "full_attention":
                h = self._attention(layer, h, cache, step, rows, cos, sin)
            else:
                h = self._gdn(layer, h, cache)
            x = x + h
            h = self.ops.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
            x = x + self._mlp(p, h)
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        elif logits == "row":
            x = x.index_select(0, step.logit_row)
        x = self.ops.rms_norm(x, self.w["norm.weight"], self.cfg.rms_norm_eps)
        return self._logits(x)  # [T or 1, vocab]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head in fp32 output: bf16 logits would round to ~0.03 at the usual magnitudes, and
        that rounding, not the state, would decide near-ties and distances between distributions."""
        weight = self.lm_head.weight
        if x.is_cuda and x.dtype != torch.float32 and self._mm_out_fp32 is not False:
            try:
                out = torch.mm(x, weight.t(), out_dtype=torch.float32)
                self._mm_out_fp32 = True
                return out
            except (RuntimeError, TypeError, NotImplementedError):
                self._mm_out_fp32 = False
        if x.dtype == torch.float32:
            return self.lm_head.matmul(x)
        return torch.nn.functional.linear(x.float(), weight.float())

    def _mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A linear layer: dense weights through the op set's matmul (cuBLAS, or qse's grid-invariant
        GEMM), other formats through their own."""
        lin = self.lin[name]
        if isinstance(lin, DenseLinear):
            return self.ops.dense_matmul(x, lin.weight)
        return lin.matmul(x)

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        gate = self._mm(p + "mlp.gate_proj.weight", h)
        up = self._mm(p + "mlp.up_proj.weight", h)
        return self._mm(p + "mlp.down_proj.weight", F.silu(gate) * up)

    def _attention(self, layer: int, h: torch.Tensor, cache: SequenceCache, step: Step, rows: "_PagedRows | None",
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, a = self.cfg, f"layers.{layer}.self_attn."
        num_tokens, num_heads, num_kv, head_dim = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self._mm(a + "q_proj.weight", h).view(num_tokens, num_heads, 2 * head_dim)
        q, gate = qg[..., :head_dim], qg[..., head_dim:].reshape(num_tokens, num_heads * head_dim)
        k = self._mm(a + "k_proj.weight", h).view(num_tokens, num_kv, head_dim)
        v = self._mm(a + "v_proj.weight", h).view(num_tokens, num_kv, head_dim)
        q = self.ops.rms_norm(q, self.w[a + "q_norm.weight"], cfg.rms_norm_eps)
        k = self.ops.rms_norm(k, self.w[a + "k_norm.weight"], cfg.rms_norm_eps)
        q = naive_ops.apply_rotary(q, cos, sin)
        k = naive_ops.apply_rotary(k, cos, sin)
        slot = self.attn_slot[layer]
        if rows is not None:  # paged: rows written and read through the page table on the device
            k_pages, v_pages = rows.pool.k[:, slot], rows.pool.v[:, slot]  # [P, page_rows, Hkv, D]
            k_pages[rows.page, rows.row] = k
            v_pages[rows.page, rows.row] = v
            out = self.ops.paged_attention(q, k_pages, v_pages, rows.table, step.start, max_rows=step.max_rows)
        else:
            pos = step.pos
            assert pos is not None, "a contiguous KV store needs the host position (it cannot be captured)"
            cache.kv.write(slot, pos, k, v)
            keys, values = cache.kv.read(slot, pos + num_tokens)  # [L, Hkv, D]
            out = self.ops.attention(q, keys, values, pos)  # [T, H, D]
        out = out.reshape(num_tokens, num_heads * head_dim) * torch.sigmoid(gate)
        return self._mm(a + "o_proj.weight", out)

    def _gdn(self, layer: int, h: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        cfg, g_ = self.cfg, f"layers.{layer}.linear_attn."
        num_tokens = h.shape[0]
        slot = self.gdn_slot[layer]
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = self._mm(g_ + "in_proj_qkv.weight", h)  # [T, C]
        z = self._mm(g_ + "in_proj_z.weight", h).view(num_tokens, hv, dv)
        b = self._mm(g_ + "in_proj_b.weight", h)  # [T, Hv]
        a = self._mm(g_ + "in_proj_a.weight", h)  # [T, Hv]
        conv_w = self.w[g_ + "conv1d.weight"][:, 0, :]  # [C, K]
        qkv, new_conv = self.ops.causal_conv1d(qkv, conv_w, cache.conv[slot])
        cache.conv[slot].copy_(new_conv)
        kd = cfg.gdn_key_dim
        q = qkv[:, :kd].reshape(num_tokens, hk, dk)
        k = qkv[:, kd : 2 * kd].reshape(num_tokens, hk, dk)
        v = qkv[:, 2 * kd :].reshape(num_tokens, hv, dv)
        g, beta = self.ops.gdn_gating(a, b, self.w[g_ + "A_log"], self.w[g_ + "dt_bias"])
        state = cache.recurrent[slot]
        if num_tokens == 1:
            o, new_state = self.ops.recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            o, new_state = self.ops.chunk_gated_delta_rule(q, k, v, g, beta, state, GDN_CHUNK)
        state.copy_(new_state)  # fp32 hand-over, same address
        o = self.ops.gated_rms_norm(o, z, self.w[g_ + "norm.weight"], cfg.rms_norm_eps)
        return self._mm(g_ + "out_proj.weight", o.reshape(num_tokens, hv * dv))

    # ---- cold verbs --------------------------------------------------------------------------
    def weights_nbytes(self) -> int:
        dense = sum(t.numel() * t.element_size() for t in self.w.values())
        return dense + sum(l.nbytes_per_use for l in self.lin.values())


@dataclass
class _PagedRows:
    """Where a forward's T rows go in a paged KV store (one computation shared by every attention layer)."""

    pool: "object"  # the KVPool: .k, .v [P, slots, page_rows, Hkv, D]
    table: torch.Tensor  # int32 [pages]: the session's page ids
    page: torch.Tensor  # long [T]
    row: torch.Tensor  # long [T]

    @classmethod
    def of(cls, kv, positions: torch.Tensor) -> "_PagedRows | None":
        table_of = getattr(kv, "device_table", None)
        if table_of is None:
            return None
        table = table_of()
        page_rows = kv.pool.page_rows
        return cls(kv.pool, table, table[positions // page_rows].long(), positions % page_rows)
