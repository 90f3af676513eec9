"""FP8 block weights through the engine's op set: a kernel for the format where the set has one, the
dequantising reference where it has none."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

import qse_kernels.naive as naive
from qse.models.linear import DenseLinear, FP8BlockLinear, quantize_fp8_block
from qse.models.qwen3_5 import load


def test_a_linear_runs_through_the_op_set_s_kernel_for_its_format():
    gen = torch.Generator().manual_seed(0)
    w, scale = quantize_fp8_block(torch.randn(200, 300, generator=gen))
    lin = FP8BlockLinear(w, scale)
    x = torch.randn(3, 300, generator=gen)
    calls = []
    ops = SimpleNamespace(fp8_matmul=lambda *a: calls.append(a) or naive.fp8_block_gemm(*a))
    assert torch.equal(lin.matmul(x, ops), naive.fp8_block_gemm(x, w, lin.scale_inv))
    assert len(calls) == 1 and calls[0][1] is lin.weight and calls[0][2] is lin.scale_inv
    # no kernel in the set: the reference, x @ dequant(w)^T
    assert torch.equal(lin.matmul(x), x @ naive.fp8_dequantize(w, scale).T)
    assert torch.equal(lin.matmul(x, SimpleNamespace()), lin.matmul(x))
    dense = DenseLinear(torch.randn(4, 300, generator=gen))
    assert torch.equal(dense.matmul(x, SimpleNamespace(dense_matmul=lambda a, b: a @ b.T * 2)), 2 * (x @ dense.weight.T))


def test_the_model_hands_its_op_set_to_the_fp8_projections(hf_tiny_dir, tmp_path):
    """Every FP8 projection of a forward goes through ops.fp8_matmul, and the logits stay those of the
    dequantising reference to rounding."""
    d = tmp_path / "fp8"
    shutil.copytree(hf_tiny_dir, d)
    tensors = load_file(d / "model.safetensors")
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.o_proj.weight",
             "model.layers.1.linear_attn.out_proj.weight"]
    for name in names:
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block(tensors[name])
    save_file(tensors, str(d / "model.safetensors"))
    model = load(d, "cpu", torch.float32)
    ids = torch.arange(40)
    reference = model.forward(ids, model.new_cache(), "all")
    seen = []

    def fp8_matmul(x, w, scale_inv):
        seen.append(tuple(w.shape))
        return naive.fp8_block_gemm(x, w, scale_inv)

    model.ops.fp8_matmul = fp8_matmul
    got = model.forward(ids, model.new_cache(), "all")
    assert sorted(seen) == sorted(tuple(tensors[n].shape) for n in names)
    assert torch.allclose(got, reference, rtol=1e-4, atol=1e-4)
