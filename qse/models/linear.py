"""Weight formats behind one interface: a shape, the bytes read per use, and `matmul`.

The model calls `w.matmul(x, ops)` and never asks which format it holds; `ops` is the engine's op set, and a
format whose kernel the set offers (`dense_matmul`, `fp8_matmul`) runs through it. A new format is a new class
with these three members.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

FP8_BLOCK = 128


@runtime_checkable
class Linear(Protocol):
    shape: tuple[int, int]  # (out_features, in_features)

    @property
    def nbytes_per_use(self) -> int: ...

    def matmul(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """x[..., in] -> [..., out] in x's dtype; through `ops`' kernel for this format where it has one."""
        ...


class DenseLinear:
    """A plain BF16/FP16/FP32 matrix, stored [out, in] as checkpoints store it."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a dense weight must be 2-D, got shape {tuple(weight.shape)}")
        self.weight = weight
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))

    @property
    def nbytes_per_use(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        kernel = getattr(ops, "dense_matmul", None)
        return kernel(x, self.weight) if kernel is not None else torch.nn.functional.linear(x, self.weight)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "DenseLinear":
        return DenseLinear(self.weight.to(device=device, dtype=dtype or self.weight.dtype))


class FP8BlockLinear:
    """FP8 e4m3 weights with one fp32 scale per 128x128 block (the layout of Qwen's FP8 checkpoints:
    `weight` [out, in] float8_e4m3fn and `weight_scale_inv` [ceil(out/128), ceil(in/128)]).

    Without a kernel (the naive op set) the reference path dequantises to the compute dtype at each use;
    with the engine's Triton kernels (`ops.fp8_matmul`, qse_kernels/fp8.py) the e4m3 bytes and the scales are
    read as they are stored, and every row's result is independent of how many rows the call holds.
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, compute_dtype: torch.dtype = torch.float32):
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 block weight must be float8_e4m3fn, got {weight.dtype}")
        out_f, in_f = weight.shape
        want = (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))
        if tuple(scale_inv.shape) != want:
            raise ValueError(
                f"FP8 block scale has shape {tuple(scale_inv.shape)}, expected {want} for weight {tuple(weight.shape)}"
            )
        self.weight = weight
        self.scale_inv = scale_inv.to(torch.float32)
        self.compute_dtype = compute_dtype
        self.shape = (int(out_f), int(in_f))

    @property
    def nbytes_per_use(self) -> int:
        return self.weight.numel() + self.scale_inv.numel() * 4

    def dequantize(self) -> torch.Tensor:
        out_f, in_f = self.shape
        scale = self.scale_inv.repeat_interleave(FP8_BLOCK, 0)[:out_f].repeat_interleave(FP8_BLOCK, 1)[:, :in_f]
        return (self.weight.to(torch.float32) * scale).to(self.compute_dtype)

    def matmul(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        kernel = getattr(ops, "fp8_matmul", None)
        if kernel is not None:
            return kernel(x, self.weight, self.scale_inv)
        return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "FP8BlockLinear":
        return FP8BlockLinear(self.weight.to(device), self.scale_inv.to(device), dtype or self.compute_dtype)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a dense [out, in] matrix to (e4m3 weight, per-block scale_inv): for tests and presets."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    w = weight.to(torch.float32)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:out_f, :in_f] = w
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).view(rows * FP8_BLOCK, cols * FP8_BLOCK)[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn), scale_inv
