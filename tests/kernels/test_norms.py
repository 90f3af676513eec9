"""rms_norm, gated_rms_norm and gdn_gating against their naive twins."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import naive, norms

# bf16: the interpreter rounds fp32 -> bf16 by truncation, so allow a couple of bf16 ulps
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6

RMS_CASES = {
    "rows-fp32": ((5, 48), torch.float32),
    "rows-bf16": ((9, 64), torch.bfloat16),
    "heads-fp32-odd-dim": ((3, 4, 40), torch.float32),
    "one-row-bf16": ((1, 128), torch.bfloat16),
}


@pytest.mark.parametrize("shape,dtype", RMS_CASES.values(), ids=RMS_CASES.keys())
def test_rms_norm_matches_twin(device, rel, shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.2).to(device, dtype)
    out = norms.rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel(out, naive.rms_norm(x, w, EPS)) < TOL[dtype]


def test_rms_norm_strided_heads_view(device, rel):
    """q sliced out of a fused [T, H, 2D] projection, as the attention layer does."""
    qg = torch.randn(6, 4, 2 * 32, device=device)
    q = qg[..., :32]
    w = torch.randn(32, device=device) * 0.1
    assert rel(norms.rms_norm(q, w, EPS), naive.rms_norm(q, w, EPS)) < TOL[torch.float32]


def test_rms_norm_row_independent_of_batch(device):
    x = torch.randn(37, 96, device=device)
    w = torch.randn(96, device=device)
    whole = norms.rms_norm(x, w, EPS)
    assert torch.equal(norms.rms_norm(x[5:6], w, EPS), whole[5:6])
    assert torch.equal(norms.rms_norm(x, w, EPS), whole)


GATED_CASES = {
    "fp32": (torch.float32, torch.float32, 32),
    "bf16-x-fp32-w": (torch.bfloat16, torch.float32, 32),
    "bf16-x-bf16-w": (torch.bfloat16, torch.bfloat16, 16),
    "fp32-odd-dim": (torch.float32, torch.float32, 24),
}


@pytest.mark.parametrize("x_dtype,w_dtype,dim", GATED_CASES.values(), ids=GATED_CASES.keys())
def test_gated_rms_norm_matches_twin(device, rel, x_dtype, w_dtype, dim):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, dim, generator=gen).to(device, x_dtype)
    gate = (torch.randn(7, 3, dim, generator=gen) * 2).to(device, x_dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device, w_dtype)
    out = norms.gated_rms_norm(x, gate, w, EPS)
    assert out.dtype == x_dtype
    assert rel(out, naive.gated_rms_norm(x, gate, w, EPS)) < TOL[x_dtype]


GATING_CASES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", GATING_CASES.values(), ids=GATING_CASES.keys())
def test_gdn_gating_matches_twin(device, rel, dtype):
    gen = torch.Generator().manual_seed(2)
    num_heads = 6
    a = (torch.randn(70, num_heads, generator=gen) * 8).to(device, dtype)  # reaches softplus's x > 20 branch
    a[0, 0], a[1, 1] = 30.0, -40.0
    b = (torch.randn(70, num_heads, generator=gen) * 3).to(device, dtype)
    a_log = torch.randn(num_heads, generator=gen).to(device)
    dt_bias = torch.randn(num_heads, generator=gen).to(device)
    g, beta = norms.gdn_gating(a, b, a_log, dt_bias)
    ref_g, ref_beta = naive.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.float32
    assert rel(g, ref_g) < 1e-5
    # beta is rounded through b's dtype like the twin; bf16 may differ by one ulp at a rounding edge
    assert rel(beta, ref_beta) < TOL[dtype]
    assert (g[1, 1] < 0) and (g[1, 1] > -1e-12)  # log1p kept for tiny softplus


def test_norms_deterministic(device):
    x = torch.randn(33, 64, device=device, dtype=torch.bfloat16)
    gate = torch.randn(33, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, device=device)
    assert torch.equal(norms.rms_norm(x, w, EPS), norms.rms_norm(x, w, EPS))
    assert torch.equal(norms.gated_rms_norm(x, gate, w, EPS), norms.gated_rms_norm(x, gate, w, EPS))


@pytest.mark.gpu
def test_norms_model_shapes_gpu(rel):
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16) * 0.1
    assert rel(norms.rms_norm(x, w, EPS), naive.rms_norm(x, w, EPS)) < 1e-2
    o = torch.randn(512, 16, 128, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(512, 16, 128, device="cuda", dtype=torch.bfloat16)
    wn = torch.randn(128, device="cuda")
    assert rel(norms.gated_rms_norm(o, z, wn, EPS), naive.gated_rms_norm(o, z, wn, EPS)) < 1e-2
    a = torch.randn(512, 16, device="cuda", dtype=torch.bfloat16) * 4
    b = torch.randn(512, 16, device="cuda", dtype=torch.bfloat16)
    a_log, dt_bias = torch.randn(16, device="cuda"), torch.randn(16, device="cuda")
    g, beta = norms.gdn_gating(a, b, a_log, dt_bias)
    ref_g, ref_beta = naive.gdn_gating(a, b, a_log, dt_bias)
    assert rel(g, ref_g) < 1e-5 and rel(beta, ref_beta) < 1e-2
