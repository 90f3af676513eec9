"""The MTP head of a Qwen3.5 checkpoint: one more decoder layer that drafts the token after the next.

Every published Qwen3.5 ships one MTP layer (`mtp_num_hidden_layers: 1`, tensors `mtp.*`, layout.py). For the
row at position t it reads the target's hidden state h_t and the id x_{t+1} that follows it:

    u_t = fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)])      fc [H, 2H]; the embedding's half first
    g_t = norm(layer(u_t))                                 a full-attention layer (gated attention, the MLP)
    logits of x_{t+2} = head(g_t)                          the model's own embedding and head

- h_t is the target's hidden state after its final norm: what its head reads (the forward's "final_hidden" tap).
- The layer's MLP is the model's kind, run by the model's own `_mlp(prefix, h)`: dense here, the sparse block of
  the head's own router and experts in the MoE family (qse/models/qwen3_5_moe/model.py), whose model names the
  head's tensors (its `expected_mtp_shapes`; else this family's layout's).
- Every norm is the zero-centred RMSNorm, x / rms(x) * (1 + w), as in the model.
- The layer's attention has KV rows of its own, one a position: the row of (x_{t+1}, h_t) sits at position t
  (h_t's) and its rotary angle is t's, the model's rotary (partial, the same theta).
- A draft of k > 1 reuses the one layer: d_j comes from the row pairing d_{j-1} with g of the row before (the
  head's own output, after its norm), one position further.

This is how vLLM and SGLang run the published heads (vllm/model_executor/models/qwen3_5_mtp.py
Qwen3_5MultiTokenPredictor.forward and vllm/v1/spec_decode/eagle.py EagleProposer.propose, where the target's
hidden comes from Qwen3NextModel.forward after `self.norm`; sglang/srt/models/qwen3_5_mtp.py).

One sequence's state is an MTPCache: the layer's KV rows at positions [0, length) and g at length - 1, where a
draft starts. A turn, after a prompt of n ids and the first sampled id x_n:

    forward(x_1 .. x_n, h_0 .. h_{n-1})        rows 0 .. n-1 (in chunks or at once: the same rows)
    draft(k)                                   d_0 = argmax head(g_{n-1}); d_j from the row (d_{j-1}, g) at n - 1 + j
                                               (rows n .. n + k - 2 are written, then dropped: length stays n)
    the target verifies [x_n, d_0 .. d_{k-1}]  a accepted, then its next id b; its final hiddens H_0 .. H_a
    forward([d_0 .. d_{a-1}, b], H_0 .. H_a)   rows n .. n + a; then draft again

Rows of many sequences at once (`forward_rows`, `draft_rows`: what batched decode rounds run, qse/engine/rounds.py):
each row at its own position over its own sequence's pages (a DecodeBatch: positions, a page table a row), as the
model's decode_step runs its attention layers; device work only, no host reads, fixed shapes (a CUDA graph holds
them). A sequence's rows may sit in any KV slot of the pool (`kv_slot`), e.g. one beside the target's own layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..cache import ContiguousKV, KVStore
from ..inputs import DecodeBatch
from .layout import expected_mtp_shapes

if TYPE_CHECKING:
    from .model import Qwen35Model


@dataclass
class MTPCache:
    """One sequence's MTP state: the layer's KV rows (slot `slot` of `kv`) at positions [0, length), and the
    head's output at row length - 1 (None after a rollback: forward the accepted rows before the next draft)."""

    kv: KVStore
    length: int = 0
    last_hidden: torch.Tensor | None = None  # [1, H]: g at row length - 1
    slot: int = 0  # the KV slot of `kv` the layer's rows live in (0: a store of its own)

    def rollback_to(self, length: int) -> None:
        """Keep rows [0, length) (rows above are left to be written over)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll the MTP head back to {length} rows: it holds {self.length}")
        if length < self.length:
            self.length, self.last_hidden = length, None


class MTPHead:
    """The MTP layer of `model`'s checkpoint, on the model's weights, embedding, head and op set."""

    def __init__(self, model: "Qwen35Model"):
        cfg = model.cfg
        if cfg.mtp_num_hidden_layers != 1:
            raise ValueError(f"qse drafts with one MTP layer; this config has mtp_num_hidden_layers="
                             f"{cfg.mtp_num_hidden_layers} (use a checkpoint that ships its MTP head)")
        names = set(model.w) | set(model.lin)
        shapes_of = getattr(model, "expected_mtp_shapes", expected_mtp_shapes)  # a family's own table (the MoE's)
        missing = [name for name in shapes_of(cfg) if name not in names]
        if missing:
            raise ValueError(f"the model holds no {missing[0]!r} (and {len(missing) - 1} more MTP tensors): load "
                             "the checkpoint with its config's MTP head")
        self.model, self.cfg = model, cfg
        self.prefix = "mtp.layers.0."
        self.hidden_size = cfg.hidden_size  # fc is [H, 2H] (the loader checked it): the target's hidden is H wide
        self.vocab_size = int(model.embed.shape[0])
        # what the head reads of the target besides its hidden states: the embedding and head it shares
        self.shared_tensors = ("embed_tokens.weight",) + (() if cfg.tie_word_embeddings else ("lm_head.weight",))

    @property
    def ops(self):
        return self.model.ops  # the model's op set, whichever the engine picked (it may swap it after load)

    def new_cache(self, kv: KVStore | None = None, capacity: int = 1024, slot: int = 0) -> MTPCache:
        """kv: slot `slot` of it holds the layer's rows (a ContiguousKV, or a PagedKV of a pool: of one slot, or
        the target's own pages with a slot for the head beside its layers'); None: a ContiguousKV of `capacity`
        rows."""
        cfg, model = self.cfg, self.model
        if kv is None:
            kv = ContiguousKV(1, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device, capacity)
        return MTPCache(kv, slot=slot)

    # ---- the verbs -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, cache: MTPCache) -> torch.Tensor:
        """Rows at positions [cache.length, + T): row i pairs the target's final hidden hidden[i] [T, H] (at
        position cache.length + i) with next_ids[i] [T], the id after it. Writes their KV rows, advances
        cache.length, and returns g [T, H] (the head's output after its norm; logits() of it: the law of the
        id after next_ids[i])."""
        num_rows = next_ids.shape[0]
        if next_ids.dim() != 1 or num_rows == 0 or tuple(hidden.shape) != (num_rows, self.hidden_size):
            raise ValueError(f"the MTP head reads ids [T] and hidden states [T, {self.hidden_size}] (T >= 1); got "
                             f"{tuple(next_ids.shape)} and {tuple(hidden.shape)}")
        pos = cache.length
        if pos + num_rows > self.cfg.max_position_embeddings:
            raise ValueError(f"MTP position {pos + num_rows} exceeds the model window {self.cfg.max_position_embeddings}")
        if not cache.kv.ensure(pos + num_rows):
            raise MemoryError(f"the MTP head's KV store cannot hold {pos + num_rows} rows")
        g = self._rows(next_ids.to(self.model.device), hidden.to(self.model.dtype), cache.kv, pos, cache.slot)
        cache.length = pos + num_rows
        cache.last_hidden = g[-1:]
        return g

    @torch.inference_mode()
    def draft(self, cache: MTPCache, k: int) -> torch.Tensor:
        """k greedy drafts (long [k], on the device, no host reads) after the cache's last row: the id after next
        of row length - 1, then one row a draft reusing the layer. cache.length does not move (the draft rows
        above it are written over by the next forward)."""
        if k < 1:
            raise ValueError(f"a draft holds k >= 1 ids, got {k}")
        if cache.last_hidden is None:
            raise ValueError("the MTP head has no row to draft from: forward the context (or the accepted rows) first")
        if not cache.kv.ensure(cache.length + k - 1):
            raise MemoryError(f"the MTP head's KV store cannot hold {cache.length + k - 1} rows")
        g = cache.last_hidden
        drafts = [self.logits(g).argmax(-1)]  # [1] each
        for j in range(1, k):
            g = self._rows(drafts[-1], g, cache.kv, cache.length + j - 1, cache.slot)
            drafts.append(self.logits(g).argmax(-1))
        return torch.cat(drafts)

    @torch.inference_mode()
    def forward_rows(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: DecodeBatch,
                     kv_slot: int) -> torch.Tensor:
        """R rows of any sequences at once: row r pairs hidden[r] [R, H] (the target's final hidden at position
        batch.positions[r]) with next_ids[r] [R]; its K/V go to that position of the pages batch.tables[r], slot
        kv_slot of batch.pool, and it attends over that sequence's rows [0, positions[r]] (rows of one sequence
        in one call see each other: every row's K/V are written before any attends). Returns g [R, H]. Device
        work only (batch.slots is not read)."""
        return self._layer(next_ids, hidden, lambda h: self._attention_rows(h, batch, kv_slot))

    @torch.inference_mode()
    def draft_rows(self, g: torch.Tensor, batch: DecodeBatch, kv_slot: int, k: int) -> torch.Tensor:
        """k greedy drafts for each of B sequences (long [B, k], on the device): row b starts from g[b] [B, H],
        the head's output at position batch.positions[b] of its pages batch.tables[b]; draft j > 0 comes from
        the row (draft j - 1, g of the row before) at positions[b] + j, written to slot kv_slot (above the
        sequence's kept rows: the next forward writes them over). Device work only, fixed shapes."""
        drafts = [self.logits_rows(g).argmax(-1)]  # [B] each
        for j in range(1, k):
            step = DecodeBatch(batch.positions + j, batch.slots, batch.tables, batch.pool, batch.max_rows)
            g = self.forward_rows(drafts[-1], g, step, kv_slot)
            drafts.append(self.logits_rows(g).argmax(-1))
        return torch.stack(drafts, dim=1)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """The model's head on the MTP output g [T, H]: fp32 [T, vocab]."""
        return self.model._logits(g)

    def logits_rows(self, g: torch.Tensor) -> torch.Tensor:
        """The head on the rows of many sequences: the op set's batched head where it has one (decode_step's)."""
        head_rows = getattr(self.ops, "head_rows", None)
        if head_rows is not None:
            return head_rows(g, self.model.lm_head.weight)
        return self.model._logits(g)

    # ---- the layer -----------------------------------------------------------------------------
    def _rows(self, next_ids: torch.Tensor, hidden: torch.Tensor, kv: KVStore, pos: int, slot: int = 0) -> torch.Tensor:
        """g [T, H] of the rows (next_ids, hidden) at positions [pos, pos + T), their KV rows written to kv."""
        return self._layer(next_ids, hidden, lambda h: self._attention(h, kv, pos, slot))

    def _layer(self, next_ids: torch.Tensor, hidden: torch.Tensor, attention) -> torch.Tensor:
        """g [T, H]: fc, the decoder layer (its attention: `attention(h) -> [T, H]`) and the head's norm."""
        model, ops, w, eps = self.model, self.ops, self.model.w, self.cfg.rms_norm_eps
        p = self.prefix
        e = F.embedding(next_ids, model.embed)  # [T, H]
        u = torch.cat((ops.rms_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                       ops.rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)), dim=-1)  # [T, 2H]
        x = model._mm("mtp.fc.weight", u)  # [T, H]: the layer's residual stream
        h = ops.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        x, h = ops.add_rms_norm(x, attention(h), w[p + "post_attention_layernorm.weight"], eps)
        _, g = model._mlp_add_norm(p, x, h, w["mtp.norm.weight"], eps)
        return g

    def _qkv(self, h: torch.Tensor):
        """The attention's projections of h [T, H]: q, gate [T, heads, D], k, v [T, kv heads, D]."""
        cfg, model = self.cfg, self.model
        a = self.prefix + "self_attn."
        num_rows, num_heads, num_kv, head_dim = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        fused = model.fused.get(self.prefix + "self_attn.qkv_proj")
        if fused is not None:
            qg, k, v = self.ops.dense_matmul(h, fused[0].weight).split(fused[1], dim=-1)
        else:
            qg, k, v = (model._mm(a + f"{m}.weight", h) for m in ("q_proj", "k_proj", "v_proj"))
        qg = qg.view(num_rows, num_heads, 2 * head_dim)  # per head: its query, then its output gate
        return (qg[..., :head_dim], qg[..., head_dim:], k.view(num_rows, num_kv, head_dim),
                v.view(num_rows, num_kv, head_dim))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] of the model's rotary at positions [T]."""
        model = self.model
        emb = positions.to(torch.float32)[:, None] * model.inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos().to(model.dtype), emb.sin().to(model.dtype)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return self.model._mm(self.prefix + "self_attn.o_proj.weight",
                              out.reshape(out.shape[0], cfg.num_attention_heads * cfg.head_dim))

    def _attention(self, h: torch.Tensor, kv: KVStore, pos: int, slot: int = 0) -> torch.Tensor:
        """The gated attention of rows at positions [pos, pos + T) over the head's own rows [0, pos + T)."""
        cfg, model, ops = self.cfg, self.model, self.ops
        a = self.prefix + "self_attn."
        num_rows = h.shape[0]
        q, gate, k, v = self._qkv(h)
        cos, sin = self._rotary(torch.arange(pos, pos + num_rows, device=model.device))  # [T, rotary_dim]
        norm_args = (model.w[a + "q_norm.weight"], model.w[a + "k_norm.weight"], cos, sin, cfg.rms_norm_eps)
        table_of = getattr(kv, "device_table", None)
        if table_of is not None:  # paged: rows written and read through the page table on the device (a graph
            # captured at a position holds no host copy)
            table, pool = table_of(), kv.pool
            k_pages, v_pages = pool.k[:, slot], pool.v[:, slot]  # [P, page_rows, Hkv, D]
            start = torch.full((1,), pos, dtype=torch.int32, device=model.device)
            q = ops.qk_norm_rotary_paged(q, k, v, *norm_args, k_pages, v_pages, table, start)
            out = ops.paged_attention(q, k_pages, v_pages, table, start, max_rows=pos + num_rows, gate=gate)
        else:
            q, k = ops.qk_norm_rotary(q, k, *norm_args)
            kv.write(slot, pos, k, v)
            keys, values = kv.read(slot, pos + num_rows)  # [L, Hkv, D]
            out = ops.sigmoid_gate(ops.attention(q, keys, values, pos), gate)
        return self._out(out)

    def _attention_rows(self, h: torch.Tensor, batch: DecodeBatch, slot: int) -> torch.Tensor:
        """The gated attention of rows each at its own position and pages (Qwen35Model._attention_rows)."""
        cfg, model, ops = self.cfg, self.model, self.ops
        a = self.prefix + "self_attn."
        q, gate, k, v = self._qkv(h)
        cos, sin = self._rotary(batch.positions.long())  # [R, rotary_dim]: a position a row
        k_pages, v_pages = batch.pool.k[:, slot], batch.pool.v[:, slot]  # [P, page_rows, Hkv, D]
        q = ops.qk_norm_rotary_paged_rows(q, k, v, model.w[a + "q_norm.weight"], model.w[a + "k_norm.weight"], cos,
                                          sin, cfg.rms_norm_eps, k_pages, v_pages, batch.tables, batch.positions)
        out = ops.paged_decode_attention(q, k_pages, v_pages, batch.tables, batch.positions,
                                         max_rows=batch.max_rows, gate=gate)
        return self._out(out)


__all__ = ["MTPCache", "MTPHead"]
