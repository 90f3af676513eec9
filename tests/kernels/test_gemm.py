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
