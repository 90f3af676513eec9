"""qse's GEMM against torch, and the property it exists for: a row's bits never depend on the row count."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import gemm, naive


def _xw(m, n, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(device, dtype), (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype))


@pytest.mark.parametrize("m,n,k,dtype", [(37, 200, 96, torch.float32), (5, 130, 64, torch.bfloat16),
                                         (130, 64, 200, torch.float32)])
def test_gemm_matches_torch(device, rel, m, n, k, dtype):
    x, w = _xw(m, n, k, dtype, device)
    y = gemm.dense_matmul(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel(y, naive.dense_matmul(x, w)) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_row_is_the_same_whatever_rows_come_with_it(device):
    """Calls that start on a multiple of BLOCK_M rows (grid chunks and forks do) give each row the same bits,
    however many rows follow. (The interpreter's tile products go through numpy, whose result for a row also
    depends on its place inside a tile; hence the aligned starts.)"""
    assert gemm.BLOCK_M == 64
    x, w = _xw(150, 140, 96, torch.float32, device, seed=1)
    whole = gemm.dense_matmul(x, w)
    for lo, hi in ((0, 1), (0, 10), (64, 65), (64, 128), (64, 150), (128, 150)):
        assert torch.equal(gemm.dense_matmul(x[lo:hi], w), whole[lo:hi])


def test_leading_dims_and_bad_shapes(device):
    x, w = _xw(12, 40, 32, torch.float32, device, seed=2)
    assert torch.equal(gemm.dense_matmul(x.view(3, 4, 32), w), gemm.dense_matmul(x, w).view(3, 4, 40))
    with pytest.raises(ValueError, match="share K"):
        gemm.dense_matmul(x, w[:, :16])
    with pytest.raises(ValueError, match="dtype"):
        gemm.dense_matmul(x, w.double())


GEMV_CASES = {
    # N, K, dtype, out dtype; the wide programs' tile (16 rows, from N >= WIDE_FROM) at a small N with
    # WIDE_FROM lowered (the interpreter runs each program in Python)
    "narrow-bf16": (70, 300, torch.bfloat16, None),
    "wide-fp32-out": (300, 64, torch.bfloat16, torch.float32),
    "fp32": (33, 129, torch.float32, None),
}


@pytest.mark.parametrize("num_cols,depth,dtype,out_dtype", GEMV_CASES.values(), ids=GEMV_CASES.keys())
def test_gemv_matches_twin(device, rel, num_cols, depth, dtype, out_dtype, monkeypatch):
    from qse_kernels import gemv

    monkeypatch.setattr(gemv, "WIDE_FROM", 256)
    assert gemv.tiles(num_cols)[0] == (gemv.WIDE_ROWS if num_cols >= 256 else gemv.NARROW_ROWS)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, depth, generator=gen).to(device, dtype)
    w = torch.randn(num_cols, depth, generator=gen).to(device, dtype)
    out = gemv.gemv(x, w, out_dtype)
    assert out.shape == (1, num_cols) and out.dtype == (out_dtype or dtype)
    ref = naive.dense_matmul(x.float(), w.float())
    assert rel(out, ref) < (1e-5 if out.dtype == torch.float32 else 2e-2)


def test_gemv_rejects_more_than_one_row(device):
    from qse_kernels import gemv

    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device))
