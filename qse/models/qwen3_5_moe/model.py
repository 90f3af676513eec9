"""The Qwen3.5-MoE text model: the dense family's forward (qse/models/qwen3_5/model.py: embedding, GDN and gated
attention layers, norms, head; prefill, batched decode, verify windows, state) with a sparse MLP in every layer.

A layer's MLP on its normed rows h [T, H] (transformers' Qwen3_5MoeSparseMoeBlock; the block's math, tie rule and
rounding are written in qse_kernels/moe_naive.py):

    logits = h @ router^T                  [T, E]   softmax in fp32, the top k by logit, renormalised
    routed = sum_r w[t, r] * expert_{ids[t, r]}(h_t)           each expert a SwiGLU MLP of I
    out    = routed + sigmoid(h_t @ gate_s^T) * shared(h_t)     the shared expert a SwiGLU MLP of Is

Every row is routed on its own, so the block keeps the dense forward's contract: a row's result does not depend
on the other rows of a call where the block's kernels are batch-invariant (qse_kernels/moe.py's are; the torch
twin's per-expert GEMMs choose their algorithm by row count, like torch's CPU matmul elsewhere).

The block comes with the op set: an op set's own `moe_block` where it has one, else the torch twin beside the
torch twins (default_ops) and the Triton block beside Triton kernels (the engine's triton and invariant sets).

The MTP head (`mtp_head()`: the dense family's MTPHead, qse/models/qwen3_5/mtp.py) runs its decoder layer's MLP
through `_mlp(p, h)` like every layer: here the sparse block of the head's own router, experts and shared expert
(prefix `mtp.layers.0.`, layout.py's expected_mtp_shapes), on the same kernels as the main layers'.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import qse_kernels.moe_naive as moe_naive
import qse_kernels.naive as naive_ops

from ..linear import DenseLinear
from ..qwen3_5.layout import LoadedWeights
from ..qwen3_5.model import Qwen35Model
from .config import MoeTextConfig
from .layout import expected_mtp_shapes

SHARED_GATE_UP = "mlp.shared_expert.gate_up_proj"  # the shared expert's gate and up rows, fused (a view each)


def moe_block_of(ops: SimpleNamespace):
    """The sparse block that goes with op set `ops` (the module docstring)."""
    own = getattr(ops, "moe_block", None)
    if own is not None:
        return own
    if ops.rms_norm is naive_ops.rms_norm:
        return moe_naive.moe_block
    from qse_kernels import moe  # Triton: imported only where its kernels run

    return moe.moe_block


def moe_block_add_norm_of(ops: SimpleNamespace):
    """The block fused with the residual add and norm after it (qse_kernels.moe.moe_block_add_rms_norm), where
    op set `ops` has it: its own, else the Triton one where its add_rms_norm is the Triton kernel whose
    arithmetic the fused launch repeats; None (the block, then the op set's add_rms_norm) elsewhere."""
    own = getattr(ops, "moe_block_add_rms_norm", None)
    if own is not None or ops.rms_norm is naive_ops.rms_norm:
        return own
    from qse_kernels import fused, moe

    return moe.moe_block_add_rms_norm if ops.add_rms_norm is fused.add_rms_norm else None


def add_norm_router_of(ops: SimpleNamespace):
    """The post-attention add and norm with the router after it (qse_kernels.moe.add_rms_norm_router) where the
    block's add and norm is the Triton one (moe_block_add_norm_of), which takes the logits it makes; None
    elsewhere (the add and norm, then the block's own router)."""
    if getattr(ops, "moe_block_add_rms_norm", None) is not None or moe_block_add_norm_of(ops) is None:
        return None
    from qse_kernels import moe

    return moe.add_rms_norm_router


class Qwen35MoeModel(Qwen35Model):
    family = "qwen3_5_moe"
    # the MTP head's tensors, as MTPHead checks them: its layer's MLP is the sparse block
    expected_mtp_shapes = staticmethod(expected_mtp_shapes)

    def __init__(self, cfg: MoeTextConfig, weights: LoadedWeights, device: torch.device | str, dtype: torch.dtype,
                 ops: SimpleNamespace | None = None):
        super().__init__(cfg, weights, device, dtype, ops)
        # each layer's block arguments, looked up once (a decode step runs cfg.num_hidden_layers blocks)
        self.moe_args: dict[str, tuple] = {}
        for p in self._sparse_layers():
            m = p + "mlp."
            self.moe_args[p] = (
                self.w[m + "gate.weight"],  # [E, H]
                self.w[m + "experts.gate_up_proj"],  # [E, 2I, H]
                self.w[m + "experts.down_proj"],  # [E, H, I]
                self.fused[p + SHARED_GATE_UP][0].weight,  # [2Is, H]
                self.lin[m + "shared_expert.down_proj.weight"].weight,  # [H, Is]
                self.w[m + "shared_expert_gate.weight"],  # [1, H]
            )

    def _sparse_layers(self) -> list[str]:
        """The prefixes of the layers with a sparse MLP: the model's, then the MTP head's where the weights hold
        it (a config with a head over weights without one: MTPHead names what is missing)."""
        prefixes = [f"layers.{layer}." for layer in range(self.cfg.num_hidden_layers)]
        mtp = [f"mtp.layers.{layer}." for layer in range(self.cfg.mtp_num_hidden_layers)]
        return prefixes + [p for p in mtp if p + "mlp.gate.weight" in self.w]

    # the engine swaps the op set (Engine._pick_kernels): the block follows it
    @property
    def ops(self) -> SimpleNamespace:
        return self._ops

    @ops.setter
    def ops(self, ops: SimpleNamespace) -> None:
        self._ops = ops
        self.moe_block = moe_block_of(ops)
        self.moe_block_add_norm = moe_block_add_norm_of(ops)
        self.add_norm_router = add_norm_router_of(ops)

    def _fuse_projections(self) -> None:
        """The dense groups (attention, GDN), then each layer's shared expert's gate and up projections into one
        [2Is, H] matrix, gate rows first: the block's shared_gate_up (the MTP head's layer's too)."""
        super()._fuse_projections()
        for p in self._sparse_layers():
            s = p + "mlp.shared_expert."
            names = (s + "gate_proj.weight", s + "up_proj.weight")
            lins = [self.lin[n] for n in names]
            if not all(isinstance(lin, DenseLinear) for lin in lins):
                raise ValueError(f"{s[:-1]}: the shared expert's projections must be dense weights, got "
                                 f"{[type(lin).__name__ for lin in lins]}")
            fused = torch.cat([lin.weight for lin in lins], dim=0)
            widths = tuple(lin.shape[0] for lin in lins)
            for name, part in zip(names, fused.split(widths, dim=0)):
                self.lin[name] = DenseLinear(part)
            self.fused[p + SHARED_GATE_UP] = (DenseLinear(fused), widths)

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """The sparse block of layer prefix `p` (`layers.{i}.`, or the MTP head's `mtp.layers.0.`) on h [T, H] ->
        [T, H]."""
        return self.moe_block(h, *self.moe_args[p], self.cfg.num_experts_per_tok)

    def _post_mixer(self, p: str, x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense family's _post_mixer, with the router's logits made with the post-attention norm where the op
        set has that (add_norm_router_of: one launch for a decode round's few tokens) and handed to the block:
        the same bits."""
        if self.add_norm_router is None:
            return super()._post_mixer(p, x, h, norm_w, eps)
        args = self.moe_args[p]
        x, h, logits = self.add_norm_router(x, h, self.w[p + "post_attention_layernorm.weight"], eps, args[0], args[5])
        return self.moe_block_add_norm(h, *args, self.cfg.num_experts_per_tok, x, norm_w, eps, logits=logits)

    def _mlp_add_norm(self, p: str, x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense family's _mlp_add_norm, in one launch fewer where the op set fuses the block's combine with
        the add and norm (moe_block_add_norm_of): the same bits."""
        if self.moe_block_add_norm is None:
            return super()._mlp_add_norm(p, x, h, norm_w, eps)
        return self.moe_block_add_norm(h, *self.moe_args[p], self.cfg.num_experts_per_tok, x, norm_w, eps)


__all__ = ["Qwen35MoeModel", "add_norm_router_of", "moe_block_add_norm_of", "moe_block_of"]
