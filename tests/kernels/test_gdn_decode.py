"""gdn_decode: a GDN layer's conv, rule and gated norm of a decode round in one launch, against the three
launches it replaces (torch.equal: output, conv states, recurrent states) and the naive twin; interpreted at
small shapes (two value heads a key head, a value head in two column slices, slots out of order, the gate and
the raw gates read where they lie in one projection row), on a GPU at the real ones, eagerly and in a graph."""

from __future__ import annotations

import pytest
import torch

from qse_kernels import counts as kernel_counts
from qse_kernels import gdn_decode, naive

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _inputs(num_rows, num_k, num_v, dk, dv, num_slots, dtype, device, seed, width=4):
    """A decode step's inputs as the model has them: qkv, z, b and a slices of one in_proj row."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * num_k * dk + num_v * dv
    proj = torch.randn(num_rows, channels + num_v * dv + 2 * num_v, generator=gen).to(device, dtype)
    qkv = proj[:, :channels]
    z = proj[:, channels:channels + num_v * dv].view(num_rows, num_v, dv)
    b = proj[:, channels + num_v * dv:channels + num_v * dv + num_v]
    a = proj[:, channels + num_v * dv + num_v:]
    weights = dict(conv_weight=torch.randn(channels, width, generator=gen).to(device, dtype),
                   a_log=torch.rand(num_v, generator=gen).to(device), dt_bias=torch.randn(num_v, generator=gen).to(device),
                   norm_weight=torch.randn(dv, generator=gen).to(device, dtype), eps=1e-6)
    conv_states = torch.randn(num_slots, width - 1, channels, generator=gen).to(device, dtype)
    states = torch.randn(num_slots, num_v, dk, dv, generator=gen).to(device)
    return (qkv, z, a, b), weights, conv_states, states


def _step(fused, rows, weights, conv_states, states, slots, monkeypatch):
    monkeypatch.setattr(gdn_decode, "FUSED", fused)
    conv_states, states = conv_states.clone(), states.clone()
    out = gdn_decode.gdn_decode_slots(*rows, **weights, conv_states=conv_states, states=states, slots=slots)
    return out, conv_states, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_launch_is_the_three_launches(device, rel, dtype, monkeypatch):
    rows, weights, conv_states, states = _inputs(3, 1, 2, 16, 64, 5, dtype, device, seed=11)
    slots = torch.tensor([4, 0, 2], device=device)
    three = _step(False, rows, weights, conv_states, states, slots, monkeypatch)
    one = _step(True, rows, weights, conv_states, states, slots, monkeypatch)
    assert all(torch.equal(x, y) for x, y in zip(one, three))
    assert kernel_counts.all_zero()
    out, conv_after, states_after = one
    for untouched in (1, 3):
        assert torch.equal(conv_after[untouched], conv_states[untouched])
        assert torch.equal(states_after[untouched], states[untouched])
    assert not torch.equal(conv_after[4], conv_states[4]) and not torch.equal(states_after[4], states[4])
    twin_conv, twin_states = conv_states.clone(), states.clone()
    ref = naive.gdn_decode_slots(*rows, **weights, conv_states=twin_conv, states=twin_states, slots=slots)
    # (bf16 gates: the interpreter truncates the gate's casts where the twin rounds them)
    assert out.dtype == dtype and rel(out, ref) < TOL[dtype]
    assert rel(states_after, twin_states) < TOL[dtype] and torch.equal(conv_after, twin_conv)


def test_a_row_alone_is_the_row_in_company(device, monkeypatch):
    """Each sequence stepped alone (a round of one) gets its bits in a round of three."""
    rows, weights, conv_states, states = _inputs(3, 1, 2, 16, 32, 4, torch.bfloat16, device, seed=12)
    slots = torch.tensor([2, 3, 0], device=device)
    out, conv_after, states_after = _step(True, rows, weights, conv_states, states, slots, monkeypatch)
    for r in range(3):
        alone = _step(True, [x[r:r + 1] for x in rows], weights, conv_states, states, slots[r:r + 1], monkeypatch)
        slot = int(slots[r])
        assert torch.equal(alone[0], out[r:r + 1])
        assert torch.equal(alone[1][slot], conv_after[slot]) and torch.equal(alone[2][slot], states_after[slot])


def test_shapes_that_do_not_agree_are_named(device):
    rows, weights, conv_states, states = _inputs(2, 1, 2, 16, 32, 3, torch.bfloat16, device, seed=13)
    qkv, z, a, b = rows
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match=r"2 \* Hk \* 16 \+ 2 \* 32"):
        gdn_decode.gdn_decode_slots(qkv[:, 1:], z, a, b, **weights, conv_states=conv_states, states=states, slots=slots)
    with pytest.raises(ValueError, match=r"z must be \[B, Hv, Dv\] = \[2, 2, 32\]"):
        gdn_decode.gdn_decode_slots(qkv, z[:, :1], a, b, **weights, conv_states=conv_states, states=states, slots=slots)
    with pytest.raises(ValueError, match=r"slots must be an integer tensor \[2\]"):
        gdn_decode.gdn_decode_slots(qkv, z, a, b, **weights, conv_states=conv_states, states=states, slots=slots[:1])


@pytest.mark.gpu
def test_one_launch_at_the_real_shapes_on_the_gpu(monkeypatch):
    """The 9B's and the 35B-A3B's GDN shapes (16 key, 32 value heads of 128) at batch 1, 8 and 32: the one
    launch is the three bit for bit, eagerly and replayed in a CUDA graph (its counters zero between replays)."""
    for num_rows in (1, 8, 32):
        rows, weights, conv_states, states = _inputs(num_rows, 16, 32, 128, 128, num_rows + 3, torch.bfloat16, "cuda",
                                                     seed=num_rows)
        slots = torch.randperm(num_rows + 3, generator=torch.Generator().manual_seed(1))[:num_rows].cuda()
        three = _step(False, rows, weights, conv_states, states, slots, monkeypatch)
        one = _step(True, rows, weights, conv_states, states, slots, monkeypatch)
        assert all(torch.equal(x, y) for x, y in zip(one, three)), num_rows
        assert kernel_counts.all_zero()
        # in a graph: three replays step the states three times, as three eager steps do
        monkeypatch.setattr(gdn_decode, "FUSED", True)
        graph_conv, graph_states = conv_states.clone(), states.clone()
        eager_conv, eager_states = conv_states.clone(), states.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a first launch outside the capture (Triton compiles there)
            gdn_decode.gdn_decode_slots(*rows, **weights, conv_states=graph_conv.clone(), states=graph_states.clone(),
                                        slots=slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gdn_decode.gdn_decode_slots(*rows, **weights, conv_states=graph_conv, states=graph_states,
                                                   slots=slots)
        for _ in range(3):
            graph.replay()
            eager = gdn_decode.gdn_decode_slots(*rows, **weights, conv_states=eager_conv, states=eager_states,
                                                slots=slots)
            torch.cuda.synchronize()
            assert torch.equal(captured, eager) and torch.equal(graph_conv, eager_conv)
            assert torch.equal(graph_states, eager_states) and kernel_counts.all_zero()


@pytest.mark.gpu
def test_rounds_with_the_one_launch_are_the_rounds_without(cache_dir, monkeypatch):
    """The embedded model's decode rounds in CUDA graphs (three sequences, a bucket with a padding row), with
    and without the one launch: the same logits every round and the same states after, bit for bit."""
    from qse.engine.engine import Engine
    from qse.engine.kv import PagedKV
    from qse.engine.rounds import DecodeRounds
    from qse.models import resolve
    from rounds_rig import make_pool

    engine = Engine(resolve("", torch.device("cuda"), torch.bfloat16, cache_dir), kernels="triton")
    prompts = [list(range(300, 300 + n)) for n in (60, 130, 7)]
    out = {}
    for fused in (False, True):
        monkeypatch.setattr(gdn_decode, "FUSED", fused)
        pool = make_pool(engine)
        rounds = DecodeRounds(engine, pool, max_running=4, graphs=True)
        slots, tokens = [], []
        for prompt in prompts:
            cache = engine.new_cache(kv=PagedKV(pool))
            logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
            slots.append(rounds.admit(cache))
            tokens.append(logits[-1].argmax().view(1))
        rows = []
        for _ in range(6):
            logits = rounds.run(slots, torch.cat(tokens))
            rows.append(logits.clone())
            tokens = [logits[i].argmax().view(1) for i in range(len(slots))]
        rows.append(torch.cat([rounds.states.recurrent[:, slots].flatten(), rounds.states.conv[:, slots].float().flatten()]))
        out[fused] = rows
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
