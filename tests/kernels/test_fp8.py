"""The FP8 block GEMM and GEMV against their naive twins (bit for bit under the interpreter), row-invariant, and
close to x @ dequant(w)^T; model shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import fp8, naive

IS_CUDA = torch.cuda.is_available()


def _weights(n, k, device, seed=0, spread=True):
    """An e4m3 matrix and its block scales, quantised from a random one (each block's scale its own)."""
    from qse.models.linear import quantize_fp8_block

    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen)
    if spread:  # blocks of different magnitudes: a scale applied to the wrong block shows
        dense *= torch.rand(-(-n // 128), -(-k // 128), generator=gen).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k] * 4 + 0.1
    w, scale = quantize_fp8_block(dense)
    return w.to(device), scale.to(device)


def _x(m, k, dtype, device, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# N, K, wide: one block, ragged blocks both ways, narrow; the wide programs' tile (16 rows, from N >= 8192) at
# a small N (the interpreter runs each program in Python)
SMALL = {"one-block": (128, 128, False), "ragged": (136, 300, False), "narrow": (36, 130, False),
         "wide-rows": (300, 64, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_cols,depth,wide", SMALL.values(), ids=SMALL.keys())
def test_gemv_equals_its_twin_bit_for_bit(device, num_cols, depth, wide, dtype, monkeypatch):
    if wide:
        monkeypatch.setattr(fp8, "GEMV_WIDE_FROM", 256)
    assert fp8.gemv_rows(num_cols) == (16 if wide else 4)
    w, scale = _weights(num_cols, depth, device)
    x = _x(1, depth, dtype, device)
    out = fp8.fp8_gemv(x, w, scale)
    assert out.shape == (1, num_cols) and out.dtype == dtype
    assert torch.equal(out, naive.fp8_block_gemv(x, w, scale))
    head = fp8.fp8_gemv(x, w, scale, torch.float32)  # fp32 out: the logits head's use
    assert torch.equal(head, naive.fp8_block_gemv(x, w, scale, torch.float32))


GEMM_CASES = {"one-tile": (5, 128, 128), "ragged": (70, 200, 300), "rows-over-tiles": (130, 260, 256)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows,num_cols,depth", GEMM_CASES.values(), ids=GEMM_CASES.keys())
def test_gemm_equals_its_twin_bit_for_bit_under_the_interpreter(device, interpreted, num_rows, num_cols, depth, dtype, rel):
    w, scale = _weights(num_cols, depth, device, seed=2)
    x = _x(num_rows, depth, dtype, device, seed=3)
    out = fp8.fp8_gemm(x, w, scale)
    assert out.shape == (num_rows, num_cols) and out.dtype == dtype
    twin = naive.fp8_block_gemm(x, w, scale)
    if interpreted:
        assert torch.equal(out, twin)
    else:  # the tensor cores' fp32 accumulation: the twin's exact block dots to rounding
        assert rel(out, twin) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_are_x_times_the_dequantised_weight(device, rel, dtype):
    w, scale = _weights(260, 300, device, seed=4)
    x = _x(9, 300, dtype, device, seed=5)
    ref = x.float() @ naive.fp8_dequantize(w, scale).T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(fp8.fp8_gemm(x, w, scale), ref) < tol
    assert rel(fp8.fp8_gemv(x[:1], w, scale), ref[:1]) < tol
    assert rel(naive.fp8_block_gemv(x[:1], w, scale), ref[:1]) < tol


def test_a_row_is_the_same_whatever_rows_come_with_it(device):
    """The GEMM's tiles never depend on M: a row's bits are those of the row alone, in any call."""
    w, scale = _weights(130, 200, device, seed=6)
    x = _x(100, 200, torch.bfloat16, device, seed=7)
    whole = fp8.fp8_gemm(x, w, scale)
    for lo, hi in ((0, 1), (3, 4), (0, 10), (64, 65), (60, 100)):
        assert torch.equal(fp8.fp8_gemm(x[lo:hi], w, scale), whole[lo:hi])
    assert torch.equal(fp8.fp8_matmul(x[7:8], w, scale), fp8.fp8_gemv(x[7:8], w, scale))
    assert torch.equal(fp8.fp8_matmul(x[:9].view(3, 3, 200), w, scale), whole[:9].view(3, 3, 130))


def test_bad_shapes_and_formats_are_named(device):
    w, scale = _weights(128, 256, device)
    with pytest.raises(ValueError, match="must share K"):
        fp8.fp8_gemm(_x(2, 128, torch.float32, device), w, scale)
    with pytest.raises(ValueError, match=r"scale_inv must be float32 \(1, 2\)"):
        fp8.fp8_gemm(_x(2, 256, torch.float32, device), w, scale[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.fp8_gemv(_x(1, 256, torch.float32, device), w.float(), scale)
    with pytest.raises(ValueError, match="one row"):
        fp8.fp8_gemv(_x(2, 256, torch.float32, device), w, scale)


def test_the_kernels_are_in_the_triton_op_sets():
    import qse_kernels

    if not qse_kernels.available():
        pytest.skip("Triton cannot run here")
    assert qse_kernels.triton_ops().fp8_matmul is fp8.fp8_matmul
    assert qse_kernels.invariant_ops().fp8_matmul is fp8.fp8_gemm
    assert "fp8" in qse_kernels.KERNEL_MODULES


# 9B projections (N, K): the attention output, the MLP's up and down, the GDN qkv input
MODEL_SHAPES = {"9b-o": (4096, 4096), "9b-up": (12288, 4096), "9b-down": (4096, 12288), "9b-gdn-qkv": (8192, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("num_cols,depth", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_model_shapes_on_the_gpu(num_cols, depth, rel):
    w, scale = _weights(num_cols, depth, "cuda", seed=8, spread=False)
    x = _x(512, depth, torch.bfloat16, "cuda", seed=9)
    gemv = fp8.fp8_gemv(x[:1], w, scale)
    assert torch.equal(gemv, naive.fp8_block_gemv(x[:1], w, scale))  # unfused: the twin's bits on the GPU too
    whole = fp8.fp8_gemm(x, w, scale)
    assert rel(whole, naive.fp8_block_gemm(x, w, scale)) < 1e-2
    assert torch.equal(fp8.fp8_gemm(x[64:100], w, scale), whole[64:100])


def test_the_h200_benchmark_runs_tiny_on_the_cpu(tmp_path, interpreted, monkeypatch):
    """benchmarks/fp8_bench.py --tiny: the same measurements at small shapes, interpreted; its JSON has every
    figure and the GEMV equals its twin. The GEMVs take wide tiles here (the interpreter runs a program as a
    Python loop: the pinned 4-row tiles made each one-row call of the tiny shapes 64 or 32 programs, nearly
    all of the run); the tile rows are constexprs of the same code, and the kernel tests above keep the pinned ones."""
    if not interpreted:
        pytest.skip("the tiny run is the CPU's (the device runs the full one)")
    import json as json_

    from benchmarks.fp8_bench import main as bench
    from qse_kernels import gemv

    monkeypatch.setattr(fp8, "GEMV_NARROW_ROWS", fp8.SCALE_BLOCK)  # a scale block's rows a program
    monkeypatch.setattr(gemv, "NARROW_ROWS", 64)  # BK = TILE_ELEMENTS / 64 = 64

    assert bench(["--tiny", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("fp8_bench-*-cpu.json")
    result = json_.loads(path.read_text())
    assert list(result)[:4] == ["command", "date", "device", "versions"] and len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["fp8_gemv_equals_twin"] is True
        assert row["fp8_gemm_rel_diff_twin"] == 0.0  # interpreted: the exact block dots
        assert row["fp8_vs_bf16_rel_diff"] < 0.1  # the weights' FP8 rounding
        assert all(row[k] > 0 for k in row if k.endswith("_us"))
