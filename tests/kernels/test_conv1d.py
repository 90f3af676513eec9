"""causal_conv1d against its twin: prefill of any T, the T = 1 update, carried state."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import conv1d, naive

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

CASES = {
    "prefill-fp32": (70, 96, 4, torch.float32),
    "prefill-bf16-fp32-state": (37, 200, 4, torch.bfloat16),
    "short-prefill-T2": (2, 64, 4, torch.float32),
    "update-T1": (1, 160, 4, torch.float32),
    "update-T1-bf16": (1, 96, 4, torch.bfloat16),
    "width2": (17, 48, 2, torch.float32),
}


def _inputs(num_tokens, channels, width, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, channels, generator=gen).to(device, dtype)
    w = (torch.randn(channels, width, generator=gen) * 0.5).to(device, dtype)
    state = torch.randn(width - 1, channels, generator=gen).to(device)  # the model keeps conv state fp32
    return x, w, state


@pytest.mark.parametrize("num_tokens,channels,width,dtype", CASES.values(), ids=CASES.keys())
def test_conv1d_matches_twin(device, rel, interpreted, num_tokens, channels, width, dtype):
    x, w, state = _inputs(num_tokens, channels, width, dtype, device)
    y, new_state = conv1d.causal_conv1d(x, w, state)
    ref_y, ref_state = naive.causal_conv1d(x, w, state)
    assert y.dtype == dtype and new_state.dtype == state.dtype
    assert rel(y, ref_y) < TOL[dtype]
    if dtype == state.dtype or not interpreted:
        assert torch.equal(new_state, ref_state)  # a copy of inputs (through x's dtype): exact
    else:
        assert rel(new_state, ref_state) < TOL[dtype]


def test_conv1d_weight_view(device, rel):
    """The model passes conv1d.weight[:, 0, :] of a [C, 1, K] tensor."""
    x, _, state = _inputs(20, 64, 4, torch.float32, device)
    w = torch.randn(64, 1, 4, device=device)[:, 0, :]
    y, _ = conv1d.causal_conv1d(x, w, state)
    assert rel(y, naive.causal_conv1d(x, w, state)[0]) < TOL[torch.float32]


@pytest.mark.parametrize("splits", [(30, 40), (1, 1, 1, 67), (64, 6)], ids=["30+40", "1+1+1+67", "64+6"])
def test_conv1d_carried_state_is_exact(device, splits):
    x, w, state = _inputs(sum(splits), 96, 4, torch.float32, device, seed=3)
    y_whole, s_whole = conv1d.causal_conv1d(x, w, state)
    parts, s = [], state
    for start, n in zip([0, *torch.tensor(splits).cumsum(0).tolist()], splits):
        y, s = conv1d.causal_conv1d(x[start:start + n], w, s)
        parts.append(y)
    assert torch.equal(torch.cat(parts), y_whole)
    assert torch.equal(s, s_whole)


def test_conv1d_deterministic(device):
    x, w, state = _inputs(50, 128, 4, torch.bfloat16, device)
    a, b = conv1d.causal_conv1d(x, w, state), conv1d.causal_conv1d(x, w, state)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_conv1d_model_shapes_gpu(rel):
    for num_tokens in (512, 1):
        x, w, state = _inputs(num_tokens, 6144, 4, torch.bfloat16, "cuda")
        y, s = conv1d.causal_conv1d(x, w, state)
        ref_y, ref_s = naive.causal_conv1d(x, w, state)
        assert rel(y, ref_y) < 1e-2 and torch.equal(s, ref_s)
