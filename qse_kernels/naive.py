"""The naive twins: plain torch versions of every kernel, readable top to bottom.

These are the correct reference: the model's torch path runs on them, and every Triton kernel in
this package is tested against them. They take one sequence (no batch axis): one session per launch
is part of the exactness contract, since a result must depend on nothing but its own inputs. The batched
decode twins at the end take B sequences of one token each, and loop over them.

Shapes use: T new tokens, L context rows, H / Hkv attention heads, D head dim, Hk / Hv GDN key and
value heads, Dk / Dv their dims, C conv channels, K conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), computed in fp32, cast back to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: (x / rms(x)) * w * silu(gate). x, gate: [..., Dv]; weight [Dv] (not zero-centred).

    The normalised value is rounded to x's dtype before the weight, as the published model does.
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: s = x + h in x's dtype, and rms_norm(s)."""
    s = x + h
    return s, rms_norm(s, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation on one fused projection: gate_up [T, 2I] (gate first) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output's gate: x * sigmoid(gate), both [T, H, D] (gate may be a strided view)."""
    return x * torch.sigmoid(gate)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention layer's q/k norms, then the rotary embedding on both."""
    q = apply_rotary(rms_norm(q, q_weight, eps), cos, sin)
    k = apply_rotary(rms_norm(k, k_weight, eps), cos, sin)
    return q, k


def qk_norm_rotary_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                         start: torch.Tensor) -> torch.Tensor:
    """qk_norm_rotary on a paged KV: returns q; k (normed, rotated) and v [T, Hkv, D] go to sequence rows
    start.. of the pages [P, page_rows, Hkv, D], row r at k_pages[page_table[r // page_rows], r % page_rows].
    start: int32 [1], used on its device (no read back to the host)."""
    q, k = qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, eps)
    page_rows = k_pages.shape[1]
    positions = start.long() + torch.arange(q.shape[0], device=q.device)
    page, row = page_table[positions // page_rows].long(), positions % page_rows
    k_pages[page, row] = k
    v_pages[page, row] = v
    return q


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [T, rotary_dim] for integer positions [T]; halves repeated (rotate-half convention).

    Text-only positions are equal on Qwen3.5's three mrope axes, so the interleaved section layout
    reduces to plain rotary on the first `rotary_dim` dims of each head.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotate the first cos.shape[-1] dims, pass the rest through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return torch.cat((out, rest), dim=-1)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  out_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with carried state, then SiLU.

    x [T, C] new inputs; weight [C, K]; state [K-1, C] the previous K-1 inputs (zeros at the start).
    Returns y [T, C] in x's dtype and the new state [K-1, C] (the last K-1 inputs, in state's dtype).
    Accumulates in fp32 in a fixed tap order, so the result depends only on the inputs.
    """
    width = weight.shape[1]
    seq = torch.cat((state.to(x.dtype), x), dim=0)  # [K-1+T, C]
    t = x.shape[0]
    acc = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    wf = weight.float()
    for j in range(width):
        acc = acc + seq[j : j + t].float() * wf[:, j]
    y = F.silu(acc).to(x.dtype)
    new_state = seq[-(width - 1):].to(state.dtype)
    return y, _hand_over(new_state, out_state)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """Per-token decay (log space) and write strength. a, b [T, Hv] -> g fp32 [T, Hv], beta [T, Hv] fp32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return g, beta


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """fp32, L2-normalised q and k, q scaled by Dk^-1/2, key heads repeated to the value heads."""
    q = l2norm(q.float())
    k = l2norm(k.float())
    q = q * (q.shape[-1] ** -0.5)
    rep = num_v_heads // k.shape[1]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens in chunks of `chunk`, from state S0.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv] fp32; state [Hv, Dk, Dv] fp32.
    Returns o [T, Hv, Dv] (v's dtype) and the new state [Hv, Dk, Dv] fp32 (written into `out_state`,
    which may be `state` itself, when one is given).

    Per token: S <- e^g S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
    In a chunk with cumulative log decay c_i, the u's solve one unit-lower-triangular system
    (I + A) U = beta V - beta e^c K S0 with A_ij = beta_i e^(c_i - c_j) k_i.k_j (j < i), so a chunk
    costs a few matmuls instead of `chunk` rank-one updates.
    """
    out_dtype = v.dtype
    num_tokens, num_v_heads = v.shape[0], v.shape[1]
    q, k = _prepare_qk(q, k, num_v_heads)
    # heads first: [Hv, T, D]
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    v = v.float().transpose(0, 1)
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [Hv, T]
    s = state.float().clone()
    out = torch.empty_like(v)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end]
        c = g[:, start:end].cumsum(-1)  # [Hv, n]
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        diff = (c[:, :, None] - c[:, None, :]).masked_fill(~lower.logical_or(torch.eye(n, dtype=torch.bool, device=q.device)), float("-inf"))
        decay = diff.exp()  # [Hv, n, n]: e^(c_i - c_j) for j <= i, 0 above
        a_mat = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~lower, 0.0)
        system = a_mat + torch.eye(n, device=q.device)
        rhs_v = bc[:, :, None] * vc
        rhs_k = (bc * c.exp())[:, :, None] * kc
        w_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        w_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
        u = w_v - w_k @ s  # [Hv, n, Dv]
        intra = (qc @ kc.transpose(-1, -2)) * decay  # [Hv, n, n], causal
        out[:, start:end] = (qc * c.exp()[:, :, None]) @ s + intra @ u
        tail = (c[:, -1:] - c).exp()  # e^(c_n - c_j)
        s = s * c[:, -1].exp()[:, None, None] + (kc * tail[:, :, None]).transpose(-1, -2) @ u
    return out.transpose(0, 1).to(out_dtype), _hand_over(s, out_state)


def _hand_over(s: torch.Tensor, out_state: torch.Tensor | None) -> torch.Tensor:
    if out_state is None:
        return s
    out_state.copy_(s)
    return out_state


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule one token at a time (decode). Shapes and `out_state` as chunk_gated_delta_rule."""
    out_dtype = v.dtype
    num_v_heads = v.shape[1]
    q, k = _prepare_qk(q, k, num_v_heads)
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        u = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out.to(out_dtype), _hand_over(s, out_state)


def chunk_gated_delta_rule_from_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, chunk: int = 64, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule of gdn_gating(a, b, a_log, dt_bias): the GDN layer's raw projections a, b
    [T, Hv] in, the gating inside the rule (the Triton twin saves the gating's launch)."""
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    return chunk_gated_delta_rule(q, k, v, g, beta, state, chunk, out_state)


def recurrent_gated_delta_rule_from_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_gated_delta_rule of gdn_gating(a, b, a_log, dt_bias), as chunk_gated_delta_rule_from_gates."""
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    return recurrent_gated_delta_rule(q, k, v, g, beta, state, out_state)


# Scores held at once by one attention call (fp32 elements: 64 MiB). A call under it (every grid chunk up to a
# few thousand rows of context, every test's shapes) is the einsum below, readable top to bottom. Past it the
# einsum would hold T x L scores three times over (a 16k prompt read whole took 12.8 GB), so the queries go in
# blocks of this // (H * L) rows through torch's fused attention, which never holds a block's scores either:
# memory grows linearly in the context. Which path a call takes depends only on its shapes, so the same call
# gives the same bits (the exactness contract compares like with like); the two paths agree within rounding.
ATTENTION_SCORE_ELEMENTS = 1 << 24


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention of T queries at absolute positions q_start.. over L = q_start + T rows.

    q [T, H, D]; k, v [L, Hkv, D]. Scores and softmax in fp32; returns [T, H, D] in q's dtype. Past
    ATTENTION_SCORE_ELEMENTS scores: query blocks through the fused attention (each over the rows it sees)."""
    num_q, num_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    block = _query_block(num_q, num_heads, k.shape[0])
    if block >= num_q:
        return _attention_block(q, k.float(), v.float(), q_start, scale)
    out = torch.empty_like(q)
    kf, vf = k.float(), v.float()
    for first in range(0, num_q, block):
        last = min(num_q, first + block)
        rows = q_start + last  # the rows these queries can see
        out[first:last] = _sdpa_block(q[first:last].float(), kf[:rows], vf[:rows], q_start + first, scale).to(q.dtype)
    return out


def _query_block(num_q: int, num_heads: int, num_rows: int) -> int:
    return max(1, min(num_q, ATTENTION_SCORE_ELEMENTS // max(1, num_heads * num_rows)))


def _attention_block(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, q_start: int, scale: float) -> torch.Tensor:
    """attention of q's rows over fp32 kf, vf [L, Hkv, D] (L = q_start + T)."""
    num_q, num_heads, head_dim = q.shape
    num_rows, num_kv = kf.shape[0], kf.shape[1]
    group = num_heads // num_kv
    qf = q.float().view(num_q, num_kv, group, head_dim)
    scores = torch.einsum("tkgd,lkd->kgtl", qf, kf) * scale  # [Hkv, G, T, L]
    q_pos = torch.arange(q_start, q_start + num_q, device=q.device)
    k_pos = torch.arange(num_rows, device=q.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))  # in place: one [T, L] buffer less
    probs = torch.softmax(scores, dim=-1)
    del scores
    out = torch.einsum("kgtl,lkd->tkgd", probs, vf)
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """The same result through torch's fused attention (used on CUDA where the einsum would not fit); queries
    in the same blocks as `attention`, so the boolean mask is never T x L."""
    num_q, num_heads, _ = q.shape
    block = _query_block(num_q, num_heads, k.shape[0])
    if block >= num_q:
        return _sdpa_block(q, k, v, q_start)
    out = torch.empty_like(q)
    for first in range(0, num_q, block):
        last = min(num_q, first + block)
        rows = q_start + last
        out[first:last] = _sdpa_block(q[first:last], k[:rows], v[:rows], q_start + first)
    return out


def _sdpa_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                scale: float | None = None) -> torch.Tensor:
    num_q, num_heads, _ = q.shape
    num_rows, num_kv = k.shape[0], k.shape[1]
    q_pos = torch.arange(q_start, q_start + num_q, device=q.device)
    mask = torch.arange(num_rows, device=q.device)[None, :] <= q_pos[:, None]  # [T, L] bools: the block's only T x L
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask[None, None], enable_gqa=num_heads != num_kv, scale=scale,
    )
    return out[0].transpose(0, 1)


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T through torch (cuBLAS on a GPU: its algorithm depends on the shape)."""
    return F.linear(x, w)


FP8_SCALE_BLOCK = 128  # rows and columns of an FP8 block weight under one scale


def fp8_dequantize(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 w [N, K] with block scales [ceil(N/128), ceil(K/128)] -> fp32 [N, K]."""
    n, k = w.shape
    scale = scale_inv.float().repeat_interleave(FP8_SCALE_BLOCK, 0)[:n].repeat_interleave(FP8_SCALE_BLOCK, 1)[:, :k]
    return w.float() * scale


def _fp8_blocks(w: torch.Tensor, depth: int) -> tuple[torch.Tensor, int]:
    """w as fp32 [N, KB, 128], zero past column `depth` (e4m3 widens to fp32 exactly), and KB."""
    num_kb = -(-depth // FP8_SCALE_BLOCK)
    wf = torch.zeros(w.shape[0], num_kb * FP8_SCALE_BLOCK, dtype=torch.float32, device=w.device)
    wf[:, :depth] = w.float()
    return wf.view(w.shape[0], num_kb, FP8_SCALE_BLOCK), num_kb


def fp8_block_gemv(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """qse_kernels.fp8.fp8_gemv's arithmetic: 128 fp32 lanes a row; lane j adds (w * x) * scale over the column
    blocks in order; then the lanes are summed in pairs (2i, 2i + 1), pairs of pairs, down to one."""
    num_cols, depth = w.shape
    wb, num_kb = _fp8_blocks(w, depth)
    xf = torch.zeros(num_kb * FP8_SCALE_BLOCK, dtype=torch.float32, device=x.device)
    xf[:depth] = x.reshape(-1).float()
    scale = scale_inv.float().repeat_interleave(FP8_SCALE_BLOCK, 0)[:num_cols]  # [N, KB]: each row's
    terms = (wb * xf.view(num_kb, FP8_SCALE_BLOCK)) * scale[:, :, None]
    lanes = torch.zeros(num_cols, FP8_SCALE_BLOCK, dtype=torch.float32, device=x.device)
    for kb in range(num_kb):
        lanes = lanes + terms[:, kb]
    while lanes.shape[-1] > 1:
        pairs = lanes.view(num_cols, -1, 2)
        lanes = pairs[..., 0] + pairs[..., 1]
    return lanes.view(*x.shape[:-1], num_cols).to(x.dtype if out_dtype is None else out_dtype)


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """qse_kernels.fp8.fp8_gemm's arithmetic: for each 128-column block in order, the block's dot (exact, in
    fp64, rounded once to fp32) times the block's scale, added to an fp32 accumulator; x's dtype out."""
    num_cols, depth = w.shape
    wb, num_kb = _fp8_blocks(w, depth)
    x2 = x.reshape(-1, depth)
    xf = torch.zeros(x2.shape[0], num_kb * FP8_SCALE_BLOCK, dtype=torch.float64, device=x.device)
    xf[:, :depth] = x2.double()
    scale = scale_inv.float().repeat_interleave(FP8_SCALE_BLOCK, 0)[:num_cols]  # [N, KB]
    acc = torch.zeros(x2.shape[0], num_cols, dtype=torch.float32, device=x.device)
    for kb in range(num_kb):
        cols = slice(kb * FP8_SCALE_BLOCK, (kb + 1) * FP8_SCALE_BLOCK)
        part = (xf[:, cols] @ wb[:, kb].double().T).float()
        acc = acc + part * scale[:, kb]
    return acc.view(*x.shape[:-1], num_cols).to(x.dtype)


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows [0, num_rows) of a paged store [P, page_rows, ...] as one contiguous tensor."""
    page_rows = pages.shape[1]
    used = page_table[: -(-num_rows // page_rows)].long()
    return pages[used].reshape(-1, *pages.shape[2:])[:num_rows]


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    start: torch.Tensor, max_rows: int | None = None, scale: float | None = None,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """attention over a paged KV (the twin of the Triton paged kernel): gather, then attend, then
    sigmoid_gate(out, gate) when a gate [T, H, D] is given (the Triton kernel gates in its epilogue). Reads
    the start position back to the host (fine for the reference path; the Triton kernel reads it on device)."""
    q_start = int(start.reshape(-1)[0])
    num_rows = q_start + q.shape[0]
    k, v = gather_pages(k_pages, page_table, num_rows), gather_pages(v_pages, page_table, num_rows)
    if q.is_cuda and scale is None:
        out = sdpa_attention(q, k, v, q_start)
    else:
        out = attention(q, k, v, q_start, scale)
    return out if gate is None else sigmoid_gate(out, gate)


# ---- batched decode: B sequences, one new token each, every one at its own position -----------------
# The twins loop over the sequences and call the one-sequence twins above, so row b has the bits of that
# sequence decoded alone (the Triton kernels take the batch in one launch and keep each row's arithmetic).
# A sequence's GDN state is row slots[b] of a slot stack [S, ...] (updated in place); its KV rows live in
# the pages page_tables[b] (int32 [B, >= pages used]). Rows that share a slot (padding) run one after the
# other here and race in the kernels: what they leave in that slot is undefined.


def qk_norm_rotary_paged_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                              k_pages: torch.Tensor, v_pages: torch.Tensor, page_tables: torch.Tensor,
                              positions: torch.Tensor) -> torch.Tensor:
    """qk_norm_rotary_paged for B sequences of one token: q [B, H, D], k, v [B, Hkv, D], cos, sin [B, RD];
    row b's k and v go to position positions[b] (int32 [B]) of the pages page_tables[b]. Returns q."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b:b + 1] = qk_norm_rotary_paged(q[b:b + 1], k[b:b + 1], v[b:b + 1], q_weight, k_weight, cos[b:b + 1],
                                            sin[b:b + 1], eps, k_pages, v_pages, page_tables[b], positions[b:b + 1])
    return out


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_tables: torch.Tensor,
                           positions: torch.Tensor, max_rows: int | None = None, scale: float | None = None,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention for B sequences of one query each: q [B, H, D], row b at position positions[b] over
    rows [0, positions[b]] of the pages page_tables[b]; gate [B, H, D] or None. Returns [B, H, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b:b + 1] = paged_attention(q[b:b + 1], k_pages, v_pages, page_tables[b], positions[b:b + 1], max_rows,
                                       scale, None if gate is None else gate[b:b + 1])
    return out


def causal_conv1d_slots(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """causal_conv1d of one new input per sequence: x [B, C], weight [C, K], states [S, K-1, C] (row slots[b]
    is sequence b's state, updated in place). Returns y [B, C]."""
    y = torch.empty_like(x)
    for b, slot in enumerate(slots.tolist()):
        y[b:b + 1], _ = causal_conv1d(x[b:b + 1], weight, states[slot], out_state=states[slot])
    return y


def recurrent_gated_delta_rule_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """recurrent_gated_delta_rule_from_gates of one token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], the raw
    gates a, b [B, Hv]; states [S, Hv, Dk, Dv] fp32 (row slots[b] is sequence b's, updated in place).
    Returns o [B, Hv, Dv] in v's dtype."""
    out = torch.empty_like(v)
    for i, slot in enumerate(slots.tolist()):
        out[i:i + 1], _ = recurrent_gated_delta_rule_from_gates(
            q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1], b[i:i + 1], a_log, dt_bias, states[slot],
            out_state=states[slot])
    return out


def gdn_decode_heads(qkv: torch.Tensor, states: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(Hk, Hv, Dk, Dv, key_dim) of a GDN decode step from the conv's input qkv [B, 2 * Hk * Dk + Hv * Dv] and the
    recurrent states [S, Hv, Dk, Dv], or a ValueError naming the shapes that do not agree."""
    if qkv.dim() != 2 or states.dim() != 4:
        raise ValueError(f"qkv must be [B, C] and states [S, Hv, Dk, Dv]; got {tuple(qkv.shape)}, {tuple(states.shape)}")
    num_v_heads, dk, dv = states.shape[1:]
    key_dim, odd = divmod(qkv.shape[1] - num_v_heads * dv, 2)
    if odd or key_dim <= 0 or key_dim % dk or num_v_heads % (key_dim // dk):
        raise ValueError(f"qkv's {qkv.shape[1]} channels must be 2 * Hk * {dk} + {num_v_heads} * {dv} with Hk "
                         f"dividing {num_v_heads} (states {tuple(states.shape)})")
    return key_dim // dk, num_v_heads, dk, dv, key_dim


def gdn_decode_slots(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A GDN layer's decode step between its two projections, one new row for each of B sequences: the conv
    of qkv [B, C] (causal_conv1d_slots on conv_states [S, K-1, C]), the rule on its q, k, v with the raw gates
    a, b [B, Hv] (recurrent_gated_delta_rule_slots on states [S, Hv, Dk, Dv]), and the gated norm by z [B, Hv,
    Dv] (gated_rms_norm); slot slots[b] of both stacks stepped in place. Returns [B, Hv, Dv] in qkv's dtype."""
    return gdn_decode_through((causal_conv1d_slots, recurrent_gated_delta_rule_slots, gated_rms_norm), qkv, z, a, b,
                              conv_weight, a_log, dt_bias, norm_weight, eps, conv_states, states, slots)


def gdn_decode_through(ops, qkv, z, a, b, conv_weight, a_log, dt_bias, norm_weight, eps, conv_states, states, slots):
    """gdn_decode_slots as its three steps, ops = (conv_slots, rule_slots, gated_norm): this module's, or the
    Triton kernels' (gdn_decode's three launches)."""
    conv_slots, rule_slots, gated_norm = ops
    num_k_heads, num_v_heads, dk, dv, key_dim = gdn_decode_heads(qkv, states)
    num_rows = qkv.shape[0]
    y = conv_slots(qkv, conv_weight, conv_states, slots)
    q = y[:, :key_dim].reshape(num_rows, num_k_heads, dk)
    k = y[:, key_dim:2 * key_dim].reshape(num_rows, num_k_heads, dk)
    v = y[:, 2 * key_dim:].reshape(num_rows, num_v_heads, dv)
    o = rule_slots(q, k, v, a, b, a_log, dt_bias, states, slots)
    return gated_norm(o, z, norm_weight, eps)


# ---- a speculative verify: the T rows of each of B sequences, row-major (sequence b's are b * T .. b * T + T - 1)
# Row j of sequence b steps the GDN state from slot scratch[b, j - 1] (row 0: slots[b], only read) into slot
# scratch[b, j]: the one-row twins above, one row after another, so each row has the bits of its one-row step.


def _window_sources(slots: torch.Tensor, scratch: torch.Tensor) -> list[list[tuple[int, int]]]:
    """For each sequence, (source slot, target slot) of each of its rows."""
    return [list(zip([own, *row[:-1]], row)) for own, row in zip(slots.tolist(), scratch.tolist())]


def causal_conv1d_window(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         scratch: torch.Tensor) -> torch.Tensor:
    """causal_conv1d of a verify's rows: x [B * T, C], weight [C, K], states [S, K-1, C]; slots [B], scratch
    [B, T] integer tensors (see above). Returns y [B * T, C]."""
    y = torch.empty_like(x)
    for b, steps in enumerate(_window_sources(slots, scratch)):
        for j, (source, target) in enumerate(steps):
            r = b * len(steps) + j
            y[r:r + 1], _ = causal_conv1d(x[r:r + 1], weight, states[source], out_state=states[target])
    return y


def recurrent_gated_delta_rule_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor,
) -> torch.Tensor:
    """recurrent_gated_delta_rule_from_gates of a verify's rows: q, k [B * T, Hk, Dk], v [B * T, Hv, Dv], the
    raw gates a, b [B * T, Hv]; states [S, Hv, Dk, Dv] fp32; slots [B], scratch [B, T] (see above). Returns o
    [B * T, Hv, Dv] in v's dtype."""
    out = torch.empty_like(v)
    for i, steps in enumerate(_window_sources(slots, scratch)):
        for j, (source, target) in enumerate(steps):
            r = i * len(steps) + j
            out[r:r + 1], _ = recurrent_gated_delta_rule_from_gates(
                q[r:r + 1], k[r:r + 1], v[r:r + 1], a[r:r + 1], b[r:r + 1], a_log, dt_bias, states[source],
                out_state=states[target])
    return out


__all__ = [
    "causal_conv1d_window", "recurrent_gated_delta_rule_window",
    "causal_conv1d_slots", "gdn_decode_heads", "gdn_decode_slots", "gdn_decode_through", "paged_decode_attention", "qk_norm_rotary_paged_rows", "recurrent_gated_delta_rule_slots",
    "dense_matmul", "gather_pages", "paged_attention", "rms_norm", "gated_rms_norm", "qk_norm_rotary_paged", "rotary_cos_sin", "apply_rotary", "causal_conv1d", "gdn_gating",
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "chunk_gated_delta_rule_from_gates",
    "recurrent_gated_delta_rule_from_gates", "attention", "sdpa_attention", "l2norm",
]
