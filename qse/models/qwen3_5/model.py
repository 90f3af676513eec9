"""The Qwen3.5 text model's forward, one sequence at a time, readable top to bottom.

Layers come in a 3 : 1 pattern: Gated DeltaNet (GDN) layers carry a recurrent state [Hv, Dk, Dv]
(fp32) and a conv state [K-1, C]; gated full-attention layers write K/V rows. `forward` reads T new
tokens at absolute positions [pos, pos + T) on top of a SequenceCache and updates it in place.
T == 1 takes the recurrent step (decode); any other T takes the chunked rule (chunk 64).

Taps: forward, forward_layers and decode_step take `taps`, output buffers by name (TAPS) that the forward
fills in place besides its logits: "final_hidden" is each row's hidden state after the final norm (what the head
reads, and what the MTP head pairs with the next id; see mtp.py). Without taps nothing extra runs.

`decode_step` is the batched decode: B sequences, one new token each at its own position, in one forward.
The GEMMs run over [B, hidden]; each GDN layer steps B states (slots of a SlotStates) and each attention
layer attends each row over its own sequence's pages. Every op in it is row-wise or per sequence, so a
row's result is the one it would get alone wherever the op set's GEMMs are row-invariant (the invariant
kernels; cuBLAS and torch's CPU matmul choose their algorithm by the row count).

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

from ..cache import ContiguousKV, SequenceCache, SlotStates, VerifyWindow
from ..inputs import DecodeBatch, InputError, Step
from ..linear import DenseLinear
from ..state import SECTION, VIEW, StateManifest, StateTensor
from .config import TextConfig
from .layout import LoadedWeights
from .mtp import MTPHead

GDN_CHUNK = 64

# Projections that read the same input, fused into one GEMM each: one launch instead of two to four (a
# one-token forward is ~500 launches of a few microseconds each), and the tiny b/a projections stop being
# GEMMs of their own. The members become views of the fused weight, so no memory is added.
FUSED_PROJECTIONS = {
    "linear_attn.in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}

Logits = Literal["last", "all", "none", "row"]
# what a forward can hand out besides its logits (the `taps` buffers), by name: a drafter's requires() names these
TAPS = ("final_hidden",)


def default_ops() -> SimpleNamespace:
    return SimpleNamespace(
        rms_norm=naive_ops.rms_norm,
        add_rms_norm=naive_ops.add_rms_norm,
        qk_norm_rotary=naive_ops.qk_norm_rotary,
        qk_norm_rotary_paged=naive_ops.qk_norm_rotary_paged,
        silu_mul=naive_ops.silu_mul,
        sigmoid_gate=naive_ops.sigmoid_gate,
        gated_rms_norm=naive_ops.gated_rms_norm,
        causal_conv1d=naive_ops.causal_conv1d,
        chunk_gated_delta_rule_from_gates=naive_ops.chunk_gated_delta_rule_from_gates,
        recurrent_gated_delta_rule_from_gates=naive_ops.recurrent_gated_delta_rule_from_gates,
        attention=naive_ops.attention,
        paged_attention=naive_ops.paged_attention,
        dense_matmul=naive_ops.dense_matmul,
        qk_norm_rotary_paged_rows=naive_ops.qk_norm_rotary_paged_rows,
        paged_decode_attention=naive_ops.paged_decode_attention,
        causal_conv1d_slots=naive_ops.causal_conv1d_slots,
        recurrent_gated_delta_rule_slots=naive_ops.recurrent_gated_delta_rule_slots,
        gdn_decode_slots=naive_ops.gdn_decode_slots,
        causal_conv1d_window=naive_ops.causal_conv1d_window,
        recurrent_gated_delta_rule_window=naive_ops.recurrent_gated_delta_rule_window,
    )


class Qwen35Model:
    family = "qwen3_5"
    TAPS = TAPS

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
        self.fused: dict[str, tuple[DenseLinear, tuple[int, ...]]] = {}
        self._fuse_projections()
        self._mtp_head: MTPHead | None = None

    def _fuse_projections(self) -> None:
        """Concatenate each FUSED_PROJECTIONS group whose members are all dense, of one dtype and device (the
        model's layers, and the MTP head's: `mtp.layers.{i}.{group}`)."""
        prefixes = [f"layers.{layer}." for layer in range(self.cfg.num_hidden_layers)]
        prefixes += [f"mtp.layers.{layer}." for layer in range(self.cfg.mtp_num_hidden_layers)]
        for prefix in prefixes:
            for group, members in FUSED_PROJECTIONS.items():
                parent = group.rsplit(".", 1)[0]
                names = [f"{prefix}{parent}.{m}.weight" for m in members]
                lins = [self.lin.get(n) for n in names]
                if not all(isinstance(l, DenseLinear) for l in lins):
                    continue
                weights = [l.weight for l in lins]
                if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
                    continue
                fused = torch.cat(weights, dim=0)
                widths = tuple(int(w.shape[0]) for w in weights)
                for name, part in zip(names, fused.split(widths, dim=0)):
                    self.lin[name] = DenseLinear(part)
                self.fused[f"{prefix}{group}"] = (DenseLinear(fused), widths)

    def _projections(self, layer: int, group: str, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of a FUSED_PROJECTIONS group's members (views of one GEMM's output where it is fused)."""
        fused = self.fused.get(f"layers.{layer}.{group}")
        if fused is not None:
            lin, widths = fused
            return self.ops.dense_matmul(h, lin.weight).split(widths, dim=-1)
        parent = group.rsplit(".", 1)[0]
        return tuple(self._mm(f"layers.{layer}.{parent}.{m}.weight", h) for m in FUSED_PROJECTIONS[group])

    # ---- state -------------------------------------------------------------------------------
    def _gdn_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One GDN layer's recurrent state [Hv, Dk, Dv] (fp32) and conv state [K-1, C] (model dtype)."""
        cfg = self.cfg
        return ((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                (cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim))

    def manifest(self) -> StateManifest:
        """A sequence's state by name: per GDN layer i its recurrent and conv sections (`gdn.{i}.recurrent`,
        `gdn.{i}.conv`: SequenceCache.state_tensors() is the recurrent states, then the conv states), per
        attention slot its K and V rows [Hkv, D] a token (`kv.{slot}.k`, `kv.{slot}.v`)."""
        cfg, n = self.cfg, len(self.cfg.gdn_layers)
        rec, conv = self._gdn_state_shapes()
        tensors = [StateTensor(f"gdn.{i}.recurrent", SECTION, rec, torch.float32, i) for i in range(n)]
        tensors += [StateTensor(f"gdn.{i}.conv", SECTION, conv, self.dtype, n + i) for i in range(n)]
        row = (cfg.num_key_value_heads, cfg.head_dim)
        for slot in range(len(cfg.attention_layers)):
            tensors += [StateTensor(f"kv.{slot}.k", VIEW, row, self.dtype, slot, 0),
                        StateTensor(f"kv.{slot}.v", VIEW, row, self.dtype, slot, 1)]
        return StateManifest(tuple(tensors))

    def new_cache(self, kv=None, capacity: int = 1024) -> SequenceCache:
        cfg = self.cfg
        if kv is None:
            kv = ContiguousKV(len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device, capacity)
        n = len(cfg.gdn_layers)
        rec, conv = self._gdn_state_shapes()
        # the layers' states are rows of one stack a kind (SequenceCache.stacked: whole-state copies in two)
        recurrent = torch.zeros(n, *rec, dtype=torch.float32, device=self.device)
        conv_state = torch.zeros(n, *conv, dtype=self.dtype, device=self.device)
        return SequenceCache(kv=kv, recurrent=list(recurrent.unbind(0)), conv=list(conv_state.unbind(0)), length=0,
                             stacked=(recurrent, conv_state))

    def new_slot_states(self, num_slots: int) -> SlotStates:
        """Zeroed GDN state for num_slots sequences (what decode_step steps in place)."""
        n = len(self.cfg.gdn_layers)
        rec, conv = self._gdn_state_shapes()
        return SlotStates(torch.zeros(n, num_slots, *rec, dtype=torch.float32, device=self.device),
                          torch.zeros(n, num_slots, *conv, dtype=self.dtype, device=self.device))

    def check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 1:
            raise InputError(f"ids must be a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise InputError("empty input: at least one token id is needed")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")

    def new_taps(self, num_rows: int, names: tuple[str, ...] = TAPS) -> dict[str, torch.Tensor]:
        """Buffers for the taps `names` of a forward of num_rows rows ("final_hidden": [rows, hidden], model dtype)."""
        _check_taps(names)
        return {name: torch.empty(num_rows, self.cfg.hidden_size, dtype=self.dtype, device=self.device) for name in names}

    def mtp_head(self) -> MTPHead:
        """The checkpoint's MTP head (mtp.py) on this model's weights, embedding and head; a ValueError when the
        config has none."""
        if self._mtp_head is None:
            self._mtp_head = MTPHead(self)
        return self._mtp_head

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, logits: Logits = "last",
                check: bool = True, logit_row: int | None = None,
                taps: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Read ids [T] at positions [cache.length, cache.length + T); returns logits (fp32) per `logits`
        ("row": the logits of row `logit_row` only). taps: buffers [T, ...] filled for every row (TAPS)."""
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
        if taps is not None:
            _check_taps(taps, num_tokens)
        # filled on the device, not copied from the host: a pageable copy would wait for the stream
        step = Step(torch.full((1,), pos, dtype=torch.int32, device=self.device), num_tokens, pos,
                    None if logit_row is None else torch.full((1,), logit_row, dtype=torch.long, device=self.device),
                    pos + num_tokens, logit_row)
        # host ids (checked above on the host): pinned ones go without a wait (Engine.host_ids)
        ids = ids.to(self.device, non_blocking=ids.device.type == "cpu" and ids.is_pinned())
        out = self.forward_step(ids, cache, step, logits, taps=taps)
        cache.length = pos + num_tokens
        return out

    @torch.inference_mode()
    def forward_step(self, ids: torch.Tensor, cache: SequenceCache, step: Step, logits: Logits,
                     taps: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The forward itself: device work only, no host reads, no checks, cache.length untouched (what a
        CUDA graph captures). A paged KV store is written and read through its page table on the device."""
        return self.forward_layers(ids, cache, step, logits, taps=taps)

    @torch.inference_mode()
    def forward_layers(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], cache: SequenceCache, step: Step,
                       logits: Logits = "none", first: int = 0, stop: int | None = None,
                       taps: dict[str, torch.Tensor] | None = None):
        """Layers [first, stop) of forward_step (stop None: to the end, and then as forward_step returns).
        inputs: the ids when first == 0, else what the range before handed over: (residual, normed, cos,
        sin), the rotary tables computed once a forward. A range that stops early returns that tuple for
        the next. Running the layers in ranges, each on the hand-over of the one before, runs the same
        kernels on the same values as one forward: the same bits (the reader's chunk groups overlap one
        chunk's later ranges with the next chunk's earlier ones).

        taps: buffers by name (TAPS) filled in place for every row; only a range that reaches the last layer has
        them. With taps the last layer runs for every row whatever `logits` asks (the kept-row shortcut is off)."""
        num_layers = len(self.cfg.layer_types)
        stop = num_layers if stop is None else stop
        if not 0 <= first < stop <= num_layers:
            raise ValueError(f"layers [{first}, {stop}) must lie in [0, {num_layers}) and hold one layer at least")
        if stop < num_layers and logits != "none":
            raise ValueError(f"a range that stops before the last layer returns no logits; got logits={logits!r}")
        if taps is not None and stop < num_layers:
            raise ValueError(f"a range that stops before the last layer has no taps; got stop={stop}")
        num_tokens = step.num_tokens
        eps, last = self.cfg.rms_norm_eps, num_layers - 1
        if first == 0:
            x = F.embedding(inputs, self.embed)  # [T, h]
            positions = step.start.long() + torch.arange(num_tokens, device=self.device)
            emb = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((emb, emb), dim=-1)
            cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [T, rotary_dim]
            # each residual add runs with the norm after it (the next layer's input norm, or the final norm)
            h = self.ops.rms_norm(x, self.w["layers.0.input_layernorm.weight"], eps)
        else:
            x, h, cos, sin = inputs
        paged = _PagedStore.of(cache.kv)
        # One row's logits (a question's answer, a summary's next token): past the last layer's mixing only
        # that row matters, so the last layer's queries, attention, MLP and norms run for it alone (the
        # keys and values, and a GDN layer's state, are still written for every row). At 32k of context
        # that is one query of attention instead of a question's 320.
        # (Taps want every row's final hidden: the last layer then runs for all of them.)
        keep, keep_host = None, None
        if num_tokens > 1 and taps is None and logits == "row":
            keep, keep_host = step.logit_row, step.logit_row_host
        elif num_tokens > 1 and taps is None and logits == "last":
            keep, keep_host = torch.full((1,), num_tokens - 1, dtype=torch.long, device=self.device), num_tokens - 1
        for layer in range(first, stop):
            kind = self.cfg.layer_types[layer]
            p = f"layers.{layer}."
            only = keep if layer == last else None
            if kind == "full_attention":
                h = self._attention(layer, h, cache, step, paged, cos, sin, only, keep_host)
            else:
                h = self._gdn(layer, h, cache, step.valid)
                if only is not None:
                    h = h.index_select(0, only)
            if layer == last:
                if logits == "none" and taps is None:
                    return None  # the last layer's KV rows and state are written; nothing reads its output
                if only is not None:
                    x = x.index_select(0, only)
            next_norm = f"layers.{layer + 1}.input_layernorm.weight" if layer < last else "norm.weight"
            x, h = self._post_mixer(p, x, h, self.w[next_norm], eps)
        if stop < num_layers:
            return x, h, cos, sin
        if taps is not None:
            _fill_taps(taps, h)
            if logits == "none":
                return None
        # h: the final norm of every row kept (a row's norm does not depend on the others)
        if keep is None and logits == "last":
            h = h[-1:]
        elif keep is None and logits == "row":
            h = h.index_select(0, step.logit_row)
        return self._logits(h)  # [T or 1, vocab]

    @torch.inference_mode()
    def decode_step(self, ids: torch.Tensor, states: SlotStates, batch: DecodeBatch,
                    window: VerifyWindow | None = None, taps: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One new token for each of B sequences: ids [B] at batch.positions, on the GDN states in slots
        batch.slots of `states` and the KV pages batch.tables, both written in place. Returns the logits
        fp32 [B, vocab]. Device work only, no host reads, no checks (what a CUDA graph captures per batch
        size); the layers run as in forward_layers for T = 1, the attention and GDN ops per sequence.

        window: a verify (speculative decoding): the B rows are T rows of each of B / T sequences, row-major,
        each at its own position (batch.positions, batch.tables one entry a row); a GDN layer steps each
        sequence's rows one after another into the window's scratch slots (VerifyWindow), so that every row
        runs the ops a one-row step of it would run, and the sequences' own slots are not written. Returns the
        logits of every row.

        taps: buffers [B, ...] by name (TAPS), filled in place (a graph may hold them: no checks here)."""
        eps, last = self.cfg.rms_norm_eps, len(self.cfg.layer_types) - 1
        x = F.embedding(ids, self.embed)  # [B, h]
        emb = batch.positions.long().to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # [B, rotary_dim]: a position a row
        h = self.ops.rms_norm(x, self.w["layers.0.input_layernorm.weight"], eps)
        for layer, kind in enumerate(self.cfg.layer_types):
            p = f"layers.{layer}."
            if kind == "full_attention":
                h = self._attention_rows(layer, h, batch, cos, sin)
            else:
                h = self._gdn_rows(layer, h, states, batch.slots, window)
            next_norm = f"layers.{layer + 1}.input_layernorm.weight" if layer < last else "norm.weight"
            x, h = self._post_mixer(p, x, h, self.w[next_norm], eps)
        if taps is not None:
            _fill_taps(taps, h)
        head_rows = getattr(self.ops, "head_rows", None)  # the op set's row-invariant fp32 head, where it has one
        if head_rows is not None:
            return head_rows(h, self.lm_head.weight)
        return self._logits(h)  # [B, vocab]

    def _attention_rows(self, layer: int, h: torch.Tensor, batch: DecodeBatch, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
        """_attention of one token per sequence on a paged KV: row b's k and v go to its own position and
        pages, and its query attends over its own rows [0, positions[b]]."""
        cfg, a = self.cfg, f"layers.{layer}.self_attn."
        num_rows, num_heads, num_kv, head_dim = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self._projections(layer, "self_attn.qkv_proj", h)
        qg = qg.view(num_rows, num_heads, 2 * head_dim)
        q, gate = qg[..., :head_dim], qg[..., head_dim:]
        k = k.view(num_rows, num_kv, head_dim)
        v = v.view(num_rows, num_kv, head_dim)
        slot = self.attn_slot[layer]
        k_pages, v_pages = batch.pool.k[:, slot], batch.pool.v[:, slot]  # [P, page_rows, Hkv, D]
        q = self.ops.qk_norm_rotary_paged_rows(q, k, v, self.w[a + "q_norm.weight"], self.w[a + "k_norm.weight"], cos,
                                               sin, cfg.rms_norm_eps, k_pages, v_pages, batch.tables, batch.positions)
        out = self.ops.paged_decode_attention(q, k_pages, v_pages, batch.tables, batch.positions,
                                              max_rows=batch.max_rows, gate=gate)
        return self._mm(a + "o_proj.weight", out.reshape(num_rows, num_heads * head_dim))

    def _gdn_rows(self, layer: int, h: torch.Tensor, states: SlotStates, slots: torch.Tensor,
                  window: VerifyWindow | None = None) -> torch.Tensor:
        """_gdn of one token per sequence, sequence b's conv and recurrent state in slot slots[b]; with a window,
        of its T rows a sequence, stepped in turn (decode_step)."""
        cfg, g_ = self.cfg, f"layers.{layer}.linear_attn."
        num_rows = h.shape[0]
        i = self.gdn_slot[layer]
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        qkv, z, b, a = self._projections(layer, "linear_attn.in_proj", h)
        z = z.view(num_rows, hv, dv)
        if window is None:  # the conv, the rule and the norm (one launch where gdn_decode fuses them)
            o = self.ops.gdn_decode_slots(qkv, z, a, b, self.w[g_ + "conv1d.weight"][:, 0, :], self.w[g_ + "A_log"],
                                          self.w[g_ + "dt_bias"], self.w[g_ + "norm.weight"], cfg.rms_norm_eps,
                                          states.conv[i], states.recurrent[i], slots)
            return self._mm(g_ + "out_proj.weight", o.reshape(num_rows, hv * dv))
        if hasattr(self.ops, "causal_conv1d_window") and hasattr(self.ops, "recurrent_gated_delta_rule_window"):
            # all rows of all sequences in one launch of each op: the bits of the one-row steps of the loop below
            hk, dk, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.gdn_key_dim
            qkv = self.ops.causal_conv1d_window(qkv, self.w[g_ + "conv1d.weight"][:, 0, :], states.conv[i],
                                                window.slots, window.scratch)
            q = qkv[:, :kd].reshape(num_rows, hk, dk)
            k = qkv[:, kd : 2 * kd].reshape(num_rows, hk, dk)
            v = qkv[:, 2 * kd :].reshape(num_rows, hv, dv)
            o = self.ops.recurrent_gated_delta_rule_window(q, k, v, a, b, self.w[g_ + "A_log"], self.w[g_ + "dt_bias"],
                                                           states.recurrent[i], window.slots, window.scratch)
        else:  # an op set without the window ops: the rows one after another through the one-row ops
            conv, recurrent, width = states.conv[i], states.recurrent[i], window.width
            steps = []
            for j in range(width):  # row j of every sequence: from row j - 1's state (row 0: its own slot's)
                source = window.slots if j == 0 else window.scratch[:, j - 1]
                target = window.scratch[:, j]
                conv.index_copy_(0, target, conv.index_select(0, source))
                recurrent.index_copy_(0, target, recurrent.index_select(0, source))
                steps.append(self._gdn_step_rows(layer, qkv[j::width], a[j::width], b[j::width], states, target))
            o = torch.stack(steps, 1).reshape(num_rows, hv, dv)
        o = self.ops.gated_rms_norm(o, z, self.w[g_ + "norm.weight"], cfg.rms_norm_eps)
        return self._mm(g_ + "out_proj.weight", o.reshape(num_rows, hv * dv))

    def _gdn_step_rows(self, layer: int, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, states: SlotStates,
                       slots: torch.Tensor) -> torch.Tensor:
        """The conv and the recurrent rule of one new row per slot (slots[r] stepped in place): o [R, Hv, Dv]."""
        cfg, g_ = self.cfg, f"layers.{layer}.linear_attn."
        num_rows, i = qkv.shape[0], self.gdn_slot[layer]
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = self.ops.causal_conv1d_slots(qkv, self.w[g_ + "conv1d.weight"][:, 0, :], states.conv[i], slots)
        kd = cfg.gdn_key_dim
        q = qkv[:, :kd].reshape(num_rows, hk, dk)
        k = qkv[:, kd : 2 * kd].reshape(num_rows, hk, dk)
        v = qkv[:, 2 * kd :].reshape(num_rows, hv, dv)
        return self.ops.recurrent_gated_delta_rule_slots(q, k, v, a, b, self.w[g_ + "A_log"], self.w[g_ + "dt_bias"],
                                                         states.recurrent[i], slots)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head in fp32 output: bf16 logits would round to ~0.03 at the usual magnitudes, and
        that rounding, not the state, would decide near-ties and distances between distributions."""
        weight = self.lm_head.weight
        head_row = getattr(self.ops, "head_row", None)  # one row (decode, a question's answer): the ops' own GEMV
        if head_row is not None and x.shape[0] == 1:
            return head_row(x, weight)
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
        return lin.matmul(x, self.ops)

    def _post_mixer(self, p: str, x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """After layer prefix p's mixer (its output h): the residual add and the post-attention norm, then the MLP
        with the next add and norm (weight norm_w): (x, h) for the next layer. One method so that a family may
        fuse across the norm."""
        x, h = self.ops.add_rms_norm(x, h, self.w[p + "post_attention_layernorm.weight"], eps)
        return self._mlp_add_norm(p, x, h, norm_w, eps)

    def _mlp_add_norm(self, p: str, x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer prefix p's MLP on its normed rows h, added to the residual stream x, and the next norm (weight
        norm_w): (x + mlp(h), its norm). One method so that a family may fuse the MLP's end with the add."""
        return self.ops.add_rms_norm(x, self._mlp(p, h), norm_w, eps)

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        fused = self.fused.get(p + "mlp.gate_up_proj")
        if fused is not None:
            act = self.ops.silu_mul(self.ops.dense_matmul(h, fused[0].weight))
        else:
            act = F.silu(self._mm(p + "mlp.gate_proj.weight", h)) * self._mm(p + "mlp.up_proj.weight", h)
        return self._mm(p + "mlp.down_proj.weight", act)

    def _attention(self, layer: int, h: torch.Tensor, cache: SequenceCache, step: Step, paged: "_PagedStore | None",
                   cos: torch.Tensor, sin: torch.Tensor, only: torch.Tensor | None = None,
                   only_host: int | None = None) -> torch.Tensor:
        """only: long [1], the one row whose output is wanted (every row's keys and values are written);
        only_host: the same on the host, needed by a contiguous KV store."""
        cfg, a = self.cfg, f"layers.{layer}.self_attn."
        num_tokens, num_heads, num_kv, head_dim = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = self._projections(layer, "self_attn.qkv_proj", h)
        qg = qg.view(num_tokens, num_heads, 2 * head_dim)
        q, gate = qg[..., :head_dim], qg[..., head_dim:]
        k = k.view(num_tokens, num_kv, head_dim)
        v = v.view(num_tokens, num_kv, head_dim)
        norm_args = (self.w[a + "q_norm.weight"], self.w[a + "k_norm.weight"], cos, sin, cfg.rms_norm_eps)
        slot = self.attn_slot[layer]
        if paged is not None:  # paged: rows written and read through the page table on the device
            k_pages, v_pages = paged.pool.k[:, slot], paged.pool.v[:, slot]  # [P, page_rows, Hkv, D]
            # the norm's kernel stores the normed, rotated k and the raw v at rows start.. itself
            q = self.ops.qk_norm_rotary_paged(q, k, v, *norm_args, k_pages, v_pages, paged.table, step.start)
        else:
            q, k = self.ops.qk_norm_rotary(q, k, *norm_args)
        start = step.start
        if only is not None:
            q, gate, num_tokens = q.index_select(0, only), gate.index_select(0, only), 1
            start = (step.start + only).to(torch.int32)
        if paged is not None:  # the output gate rides in the attention kernel's epilogue
            out = self.ops.paged_attention(q, k_pages, v_pages, paged.table, start, max_rows=step.max_rows, gate=gate)
        else:
            pos = step.pos
            assert pos is not None, "a contiguous KV store needs the host position (it cannot be captured)"
            cache.kv.write(slot, pos, k, v)
            keys, values = cache.kv.read(slot, pos + k.shape[0])  # [L, Hkv, D]
            if only is not None:
                assert only_host is not None, "a contiguous KV store needs the kept row on the host"
                pos += only_host
            out = self.ops.sigmoid_gate(self.ops.attention(q, keys, values, pos), gate)
        out = out.reshape(num_tokens, num_heads * head_dim)  # [T, H * D]
        return self._mm(a + "o_proj.weight", out)

    def _gdn(self, layer: int, h: torch.Tensor, cache: SequenceCache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """valid: long [1], rows at or past it are padding (Step.valid): they leave the conv window and the
        recurrent state as the real rows left them."""
        cfg, g_ = self.cfg, f"layers.{layer}.linear_attn."
        num_tokens = h.shape[0]
        slot = self.gdn_slot[layer]
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # qkv [T, C], z [T, Hv * Dv], b and a [T, Hv]: views of one GEMM's output where it is fused
        qkv, z, b, a = self._projections(layer, "linear_attn.in_proj", h)
        z = z.view(num_tokens, hv, dv)
        conv_w = self.w[g_ + "conv1d.weight"][:, 0, :]  # [C, K]
        before = cache.conv[slot].clone() if valid is not None else None
        conv_in = qkv
        qkv, _ = self.ops.causal_conv1d(qkv, conv_w, cache.conv[slot], out_state=cache.conv[slot])
        if valid is not None:
            qkv, a = _neutral_padding(qkv, a, valid)
            cache.conv[slot].copy_(_conv_window(before, conv_in, valid))
        kd = cfg.gdn_key_dim
        q = qkv[:, :kd].reshape(num_tokens, hk, dk)
        k = qkv[:, kd : 2 * kd].reshape(num_tokens, hk, dk)
        v = qkv[:, 2 * kd :].reshape(num_tokens, hv, dv)
        # the rule takes the raw a and b (g = -e^A_log softplus(a + dt_bias), beta = sigmoid(b)): decode gates
        # them in its own kernel; a chunk in the gating kernel first (qse_kernels.gdn_chunk.GATE_IN_PREPARE)
        gates = (a, b, self.w[g_ + "A_log"], self.w[g_ + "dt_bias"])
        state = cache.recurrent[slot]
        # the new state is written over the old one, in place (the cache and a CUDA graph hold its address)
        if num_tokens == 1:
            o, _ = self.ops.recurrent_gated_delta_rule_from_gates(q, k, v, *gates, state, out_state=state)
        else:
            o, _ = self.ops.chunk_gated_delta_rule_from_gates(q, k, v, *gates, state, GDN_CHUNK, out_state=state)
        o = self.ops.gated_rms_norm(o, z, self.w[g_ + "norm.weight"], cfg.rms_norm_eps)
        return self._mm(g_ + "out_proj.weight", o.reshape(num_tokens, hv * dv))

    # ---- cold verbs --------------------------------------------------------------------------
    def weights_nbytes(self) -> int:
        dense = sum(t.numel() * t.element_size() for t in self.w.values())
        return dense + sum(l.nbytes_per_use for l in self.lin.values())

    def cast(self, dtype: torch.dtype) -> "Qwen35Model":  # (or the subclass's own type)
        """The same weights cast to `dtype` (an upcast is exact), on the torch ops, on this device: a twin that
        code above the adapter path can build without naming the family. Dense weights only (a block-scaled
        format has no exact cast): another Linear is a ValueError naming it."""
        linears = {}
        for name, lin in self.lin.items():
            if not isinstance(lin, DenseLinear):
                raise ValueError(f"{name} is {type(lin).__name__}: only dense weights cast to another dtype")
            linears[name] = DenseLinear(lin.weight.to(dtype))
        weights = LoadedWeights({k: t.to(dtype) for k, t in self.w.items()}, linears)
        return type(self)(self.cfg, weights, self.device, dtype)  # (a family built on this one casts as its own)


# a padded row's raw decay gate: softplus of it underflows to exactly 0 in fp32 (qse_kernels.norms._gdn_gates and
# naive.gdn_gating alike), so the row's decay is e^0 = 1
_PAD_GATE = -1.0e4


def _neutral_padding(qkv: torch.Tensor, a: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's rule inputs with the rows at or past `valid` inert: q, k and v zero (what the rule's kernels
    load for rows past the end) and decay 1; their write strength may stay what b gives, since with k and v zero
    a row writes nothing. The rule then leaves the state as the real rows left it, bit for bit, and the real
    rows' outputs are theirs alone (the rule is causal)."""
    pad = (torch.arange(qkv.shape[0], device=qkv.device) >= valid)[:, None]
    return qkv.masked_fill(pad, 0.0), a.masked_fill(pad, _PAD_GATE)


def _conv_window(before: torch.Tensor, conv_in: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The conv's carried window after the first `valid` rows of conv_in: the last K - 1 inputs of the sequence
    `before` (the window before them, [K - 1, C]) then those rows, as the conv itself keeps them (through the
    inputs' dtype, as naive.causal_conv1d)."""
    keep = before.shape[0]
    at = valid + torch.arange(keep, device=before.device)  # positions in cat(before, conv_in)
    from_before = before.to(conv_in.dtype).index_select(0, at.clamp(max=keep - 1))
    from_rows = conv_in.index_select(0, (at - keep).clamp(min=0))
    return torch.where((at < keep)[:, None], from_before, from_rows).to(before.dtype)


def _check_taps(taps, num_rows: int | None = None) -> None:
    """Tap names must be known (TAPS); buffers, where given, must hold num_rows rows."""
    unknown = [name for name in taps if name not in TAPS]
    if unknown:
        raise ValueError(f"unknown tap {unknown[0]!r}: a forward hands out {TAPS}")
    if num_rows is not None:
        for name, buf in taps.items():
            if buf.shape[0] != num_rows:
                raise ValueError(f"tap {name!r} holds {buf.shape[0]} rows; the forward reads {num_rows}")


def _fill_taps(taps: dict[str, torch.Tensor], final_hidden: torch.Tensor) -> None:
    out = taps.get("final_hidden")
    if out is not None:
        out.copy_(final_hidden)


@dataclass
class _PagedStore:
    """A paged KV store as the attention layers see it: the pool and the session's page table on the device
    (the rows' places are computed from the table and `start` by the kernels that write and read them)."""

    pool: "object"  # the KVPool: .k, .v [P, slots, page_rows, Hkv, D]
    table: torch.Tensor  # int32 [pages]: the session's page ids

    @classmethod
    def of(cls, kv) -> "_PagedStore | None":
        table_of = getattr(kv, "device_table", None)
        if table_of is None:
            return None
        return cls(kv.pool, table_of())
