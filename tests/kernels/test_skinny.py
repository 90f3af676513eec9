"""qse's skinny GEMM (1 to 32 rows) against its naive twin, and the property it promises: a row's bits never
depend on how many rows came with it, nor on their values."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import naive, skinny

NARROW_SPLIT = skinny.Tiles(32, 64, 3, 4, 3)  # K in three slices, the last one short: the two-pass path
SWAPPED = skinny.Tiles(32, 64, 1, 4, 3, swap_ab=True)


def _xw(m, n, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    return x, (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype)


CASES = {
    # M, N, K, dtype, out dtype, tiling (None: the pinned one)
    "bf16-pinned": (5, 70, 300, torch.bfloat16, None, None),  # ragged K (300 is no multiple of 256), two programs
    "bf16-16rows-fp32-out": (16, 40, 96, torch.bfloat16, torch.float32, None),
    "fp32-2rows": (2, 33, 129, torch.float32, None, None),
    "bf16-split": (7, 50, 200, torch.bfloat16, None, NARROW_SPLIT),
    "fp32-split-fp32-out": (3, 50, 200, torch.float32, torch.float32, NARROW_SPLIT),
    "bf16-swapped": (9, 50, 130, torch.bfloat16, None, SWAPPED),
    "fp16-1row": (1, 20, 64, torch.float16, None, None),
    "bf16-32rows-tall-tile": (32, 40, 96, torch.bfloat16, None, None),
    "bf16-17rows-split": (17, 50, 200, torch.bfloat16, None, NARROW_SPLIT),
}


@pytest.mark.parametrize("m,n,k,dtype,out_dtype,launch", CASES.values(), ids=CASES.keys())
def test_skinny_matches_twin(device, rel, m, n, k, dtype, out_dtype, launch):
    x, w = _xw(m, n, k, dtype, device, seed=m + n)
    y = skinny.skinny_matmul(x, w, out_dtype, launch=launch)
    assert y.shape == (m, n) and y.dtype == (out_dtype or dtype)
    ref = naive.dense_matmul(x.float(), w.float())
    assert rel(y, ref) < (1e-5 if y.dtype == torch.float32 and dtype == torch.float32 else 2e-2)
    if dtype != torch.float32 and y.dtype == dtype:  # to the twin's own 16-bit rounding
        assert rel(y, naive.dense_matmul(x, w)) < 2e-2


@pytest.mark.parametrize("launch", [None, NARROW_SPLIT, SWAPPED], ids=["pinned", "split", "swapped"])
def test_a_row_is_the_same_bits_whatever_rows_come_with_it(device, launch):
    """The rows of a 5-row call against the same rows inside calls of 1 to 32 rows (the 16-row tile and the
    32-row one), the other rows drawn afresh for each call: torch.equal, not allclose."""
    x, w = _xw(16, 40, 96, torch.bfloat16, device, seed=3)
    five = skinny.skinny_matmul(x[:5], w, launch=launch)
    gen = torch.Generator().manual_seed(4)
    for m in (*range(1, 18), 24, 31, 32):
        others = torch.randn(32, 96, generator=gen).to(device, torch.bfloat16) * 100  # other rows' values differ wildly
        xm = torch.cat([x[: min(m, 5)], others[: max(m - 5, 0)]])
        got = skinny.skinny_matmul(xm, w, launch=launch)
        assert torch.equal(got[: min(m, 5)], five[: min(m, 5)]), m


def test_leading_dims_and_bad_input(device):
    x, w = _xw(6, 40, 32, torch.bfloat16, device, seed=2)
    assert torch.equal(skinny.skinny_matmul(x.view(2, 3, 32), w), skinny.skinny_matmul(x, w).view(2, 3, 40))
    with pytest.raises(ValueError, match=r"share K.*\(6, 16\)"):
        skinny.skinny_matmul(x[:, :16], w)
    with pytest.raises(ValueError, match="1 to 32 rows; got 33"):
        skinny.skinny_matmul(torch.zeros(33, 32, dtype=torch.bfloat16, device=device), w)
    with pytest.raises(ValueError, match="got 0"):
        skinny.skinny_matmul(x[:0], w)
    with pytest.raises(ValueError, match="torch.bfloat16 and torch.float32"):
        skinny.skinny_matmul(x, w.float())
    with pytest.raises(ValueError, match="torch.float64"):
        skinny.skinny_matmul(x.double(), w.double())
    with pytest.raises(ValueError, match="out_dtype.*torch.float16"):
        skinny.skinny_matmul(x, w, torch.float16)


def test_the_tiling_never_depends_on_rows():
    """tiles() takes (N, K) only; every pinned tiling fits the kernel's constraints."""
    for n, k in ((4096, 4096), (12352, 4096), (24576, 4096), (4096, 12288), (248320, 4096), (40, 96)):
        cfg = skinny.tiles(n, k)
        assert cfg.block_n >= 16 and cfg.block_k >= 16 and cfg.splits >= 1
        assert not cfg.swap_ab or cfg.block_n >= 64


def test_the_triton_ops_take_it_for_2_to_16_rows_of_16_bits(device):
    import qse_kernels

    dense_matmul = qse_kernels.triton_ops().dense_matmul
    x, w = _xw(17, 40, 96, torch.bfloat16, device, seed=5)
    for m in (2, 16):
        assert torch.equal(dense_matmul(x[:m], w), skinny.skinny_matmul(x[:m], w)), m
    assert torch.equal(dense_matmul(x, w), naive.dense_matmul(x, w))  # 17 rows: cuBLAS
    assert torch.equal(dense_matmul(x[:3].float(), w.float()), naive.dense_matmul(x[:3].float(), w.float()))


def test_rows_alike_rounds_a_row_alone_as_in_any_call_of_up_to_32(device):
    """qse_kernels.rows_alike (what DecodeRounds asks for where it verifies): a one-row projection and a
    round's fp32 head of one row give the bits of that row inside 2..32 rows (8 sequences verifying 4 rows);
    past 32 the calls are cuBLAS's."""
    import qse_kernels

    ops = qse_kernels.triton_ops()
    one_before = ops.dense_matmul
    qse_kernels.rows_alike(ops)
    x, w = _xw(33, 40, 96, torch.bfloat16, device, seed=6)
    for m in (2, 5, 16, 17, 32):
        assert torch.equal(ops.dense_matmul(x[:1], w), ops.dense_matmul(x[:m], w)[:1]), m
        assert torch.equal(ops.head_rows(x[:1], w), ops.head_rows(x[:m], w)[:1]), m
    assert ops.head_rows(x[:3], w).dtype == torch.float32
    assert torch.equal(ops.dense_matmul(x, w), one_before(x, w))  # 33 rows: as before
    assert torch.equal(ops.dense_matmul(x[:1].float(), w.float()), one_before(x[:1].float(), w.float()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny flow check runs the interpreter on the CPU")
def test_the_benchmark_flow_on_the_cpu(tmp_path):
    import json

    from benchmarks import skinny_bench

    assert skinny_bench.main(["--tiny", "--out", str(tmp_path), "--shapes", "tiny_head"]) == 0
    (path,) = tmp_path.glob("skinny_bench-*-cpu.json")
    result = json.loads(path.read_text())
    assert list(result)[:4] == ["command", "date", "device", "versions"]
    timed = [r for r in result["rows"] if "M" in r]
    assert [r["M"] for r in timed] == list(skinny_bench.ROWS_TINY) and "gemv_us" in timed[0]
    assert all(r["skinny_rel_diff"] < 1e-5 for r in timed)  # the head's fp32 output
    assert [r["rows_invariant"] for r in result["rows"] if "rows_invariant" in r] == [True]


# the 9B's shapes (benchmarks/skinny_bench.py SHAPES_9B) with their pinned tilings, on the GPU
GPU_SHAPES = {"gdn_out_proj": (4096, 4096, None), "gdn_in_proj": (12352, 4096, None), "mlp_down": (4096, 12288, None),
              "head": (248320, 4096, torch.float32)}


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,out_dtype", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
def test_skinny_on_the_9b_shapes(rel, n, k, out_dtype):
    x, w = _xw(32, n, k, torch.bfloat16, "cuda", seed=n)
    ref = x.double() @ w.double().t()
    five = skinny.skinny_matmul(x[:5], w, out_dtype)
    for m in (1, 2, 5, 8, 16, 17, 24, 32):  # the 16-row tile and the 32-row one
        got = skinny.skinny_matmul(x[:m], w, out_dtype)
        assert rel(got, ref[:m]) < (1e-4 if out_dtype == torch.float32 else 1e-2), m
        assert torch.equal(got[: min(m, 5)], five[: min(m, 5)]), m
