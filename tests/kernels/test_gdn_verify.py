"""A speculative verify's GDN ops (all T rows of each of B sequences in one launch: causal_conv1d_window,
recurrent_gated_delta_rule_window) against the path they replace, T one-row slot steps with the state copied
from row j - 1's slot into row j's before each (Qwen35Model._gdn_rows' fallback): every row's output and
every scratch state bit for bit, the sequences' own slots untouched; and against their naive twins. Small
shapes run interpreted on CPU; the gpu case takes the 9B's GDN shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qse_kernels
from qse_kernels import conv1d, gdn_recurrent, naive

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (B, T): every B of 1..3 and every T of 2..5 (the interpreter's cost is the rows its programs step)
WINDOWS = [(1, 2), (1, 5), (2, 3), (2, 4), (3, 2), (3, 5)]
WINDOW_IDS = [f"B{b}-T{t}" for b, t in WINDOWS]


def _window(num_seqs: int, num_rows: int, num_slots: int, gen: torch.Generator, device):
    """Own slots and scratch slots [B, T], all distinct and scattered over the stack (a shuffled slot order)."""
    order = torch.randperm(num_slots, generator=gen)
    slots = order[:num_seqs]
    scratch = order[num_seqs:num_seqs + num_seqs * num_rows].view(num_seqs, num_rows)
    return slots.to(device), scratch.to(device)


def _loop(step, states: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
    """The fallback: row j of every sequence copies row j - 1's state (row 0: its own) into its scratch slot,
    then steps it by `step` (a one-row slot op taking rows, then states and slots)."""
    num_rows = scratch.shape[1]
    outs = []
    for j in range(num_rows):
        source = slots if j == 0 else scratch[:, j - 1]
        states.index_copy_(0, scratch[:, j], states.index_select(0, source))
        outs.append(step(*(r[j::num_rows] for r in rows), states, scratch[:, j]))
    return torch.stack(outs, 1).flatten(0, 1)


def _untouched(after: torch.Tensor, before: torch.Tensor, scratch: torch.Tensor) -> None:
    """Every slot but the scratch ones (the sequences' own among them) holds what it held."""
    others = torch.ones(len(before), dtype=torch.bool)
    others[scratch.flatten().cpu()] = False
    assert torch.equal(after[others.to(after.device)], before[others.to(before.device)])


def _conv_inputs(num_seqs, num_rows, channels, width, dtype, state_dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_seqs * (num_rows + 1) + 3
    x = torch.randn(num_seqs * num_rows, channels, generator=gen).to(device, dtype)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(device, dtype)
    states = torch.randn(num_slots, width - 1, channels, generator=gen).to(device, state_dtype)
    return x, weight, states, *_window(num_seqs, num_rows, num_slots, gen, device)


def _rule_inputs(num_seqs, num_rows, num_k, num_v, dk, dv, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots, total = num_seqs * (num_rows + 1) + 3, num_seqs * num_rows
    q = torch.randn(total, num_k, dk, generator=gen).to(device, dtype)
    k = torch.randn(total, num_k, dk, generator=gen).to(device, dtype)
    v = torch.randn(total, num_v, dv, generator=gen).to(device, dtype)
    a = torch.randn(total, num_v, generator=gen).to(device, dtype)
    b = torch.randn(total, num_v, generator=gen).to(device, dtype)
    a_log = torch.rand(num_v, generator=gen).to(device)
    dt_bias = torch.randn(num_v, generator=gen).to(device)
    states = torch.randn(num_slots, num_v, dk, dv, generator=gen).to(device)
    return (q, k, v, a, b, a_log, dt_bias), states, *_window(num_seqs, num_rows, num_slots, gen, device)


# the window shapes in the model's dtype, then fp32 and a second channel block (a masked tail) on one
CONV_CASES = {**{f"{name}-bf16": (*w, 96, torch.bfloat16) for name, w in zip(WINDOW_IDS, WINDOWS)},
              "B2-T3-fp32-C160": (2, 3, 160, torch.float32)}
RULE_CASES = {**{f"{name}-bf16": (*w, 32, torch.bfloat16) for name, w in zip(WINDOW_IDS, WINDOWS)},
              "B2-T3-fp32-Dv64": (2, 3, 64, torch.float32)}


@pytest.mark.parametrize("num_seqs,num_rows,channels,dtype", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_conv_window_is_the_one_row_steps(device, rel, num_seqs, num_rows, channels, dtype):
    x, weight, states, slots, scratch = _conv_inputs(num_seqs, num_rows, channels, 4, dtype, dtype, device,
                                                     seed=10 * num_seqs + num_rows)
    mine, loop, twin = states.clone(), states.clone(), states.clone()
    y = conv1d.causal_conv1d_window(x, weight, mine, slots, scratch)
    step = lambda x_rows, s, target: conv1d.causal_conv1d_slots(x_rows, weight, s, target)  # noqa: E731
    assert torch.equal(y, _loop(step, loop, slots, scratch, x))
    assert torch.equal(mine, loop)  # every scratch state, and nothing else written
    _untouched(mine, states, scratch)
    ref = naive.causal_conv1d_window(x, weight, twin, slots, scratch)
    assert rel(y, ref) < TOL[dtype] and rel(mine, twin) < TOL[dtype]


# (B, T, channels, width, x's dtype, the state's dtype, seed): the rows the window must round as the steps do
CONV_EXACT_CASES = {"fp32-x-bf16-state": (2, 4, 96, 4, torch.float32, torch.bfloat16, 3),
                    "bf16-x-fp32-state": (2, 4, 96, 4, torch.bfloat16, torch.float32, 3),
                    "width2-odd-channels": (2, 3, 70, 2, torch.float32, torch.float32, 4)}


@pytest.mark.parametrize("num_seqs,num_rows,channels,width,dtype,state_dtype,seed", CONV_EXACT_CASES.values(),
                         ids=CONV_EXACT_CASES.keys())
def test_conv_window_rounds_as_the_one_row_steps(device, num_seqs, num_rows, channels, width, dtype, state_dtype,
                                                 seed):
    """A row's taps on the window's earlier rows see them as the one-row steps do: stored in the state's dtype
    (a narrower state rounds them), then read back; and so at width 2 and a channel count off the block."""
    x, weight, states, slots, scratch = _conv_inputs(num_seqs, num_rows, channels, width, dtype, state_dtype,
                                                     device, seed=seed)
    mine, loop = states.clone(), states.clone()
    y = conv1d.causal_conv1d_window(x, weight, mine, slots, scratch)
    step = lambda x_rows, s, target: conv1d.causal_conv1d_slots(x_rows, weight, s, target)  # noqa: E731
    assert torch.equal(y, _loop(step, loop, slots, scratch, x))
    assert torch.equal(mine, loop)


def _rule_step(gates):
    a_log, dt_bias = gates
    return lambda q, k, v, a, b, s, target: gdn_recurrent.recurrent_gated_delta_rule_slots(
        q, k, v, a, b, a_log, dt_bias, s, target)


@pytest.mark.parametrize("num_seqs,num_rows,dv,dtype", RULE_CASES.values(), ids=RULE_CASES.keys())
def test_rule_window_is_the_one_row_steps(device, rel, num_seqs, num_rows, dv, dtype):
    args, states, slots, scratch = _rule_inputs(num_seqs, num_rows, 1, 2, 16, dv, dtype, device,
                                                seed=10 * num_seqs + num_rows)
    mine, loop, twin = states.clone(), states.clone(), states.clone()
    o = gdn_recurrent.recurrent_gated_delta_rule_window(*args, mine, slots, scratch)
    assert o.dtype == dtype
    assert torch.equal(o, _loop(_rule_step(args[5:]), loop, slots, scratch, *args[:5]))
    assert torch.equal(mine, loop)
    _untouched(mine, states, scratch)
    ref = naive.recurrent_gated_delta_rule_window(*args, twin, slots, scratch)
    # (bf16 gates: the interpreter truncates the gate's casts where the twin rounds them)
    assert rel(o, ref) < TOL[dtype] and rel(mine, twin) < TOL[dtype]


def test_rule_window_model_strides(device):
    """The model's operands: q, k, v column slices of the conv's output, a and b of a fused projection's."""
    gen = torch.Generator().manual_seed(8)
    num_seqs, num_rows, hk, hv, dk, dv = 2, 3, 1, 2, 16, 32
    total, kd = num_seqs * num_rows, hk * dk
    qkv = torch.randn(total, 2 * kd + hv * dv, generator=gen).to(device, torch.bfloat16)
    ab = torch.randn(total, 2 * hv + 5, generator=gen).to(device, torch.bfloat16)
    q, k = qkv[:, :kd].reshape(total, hk, dk), qkv[:, kd:2 * kd].reshape(total, hk, dk)
    v = qkv[:, 2 * kd:].reshape(total, hv, dv)
    b, a = ab[:, 1:1 + hv], ab[:, 3:3 + hv]
    gates = (torch.rand(hv, generator=gen).to(device), torch.randn(hv, generator=gen).to(device))
    states = torch.randn(num_seqs * (num_rows + 1), hv, dk, dv, generator=gen).to(device)
    slots, scratch = _window(num_seqs, num_rows, len(states), gen, device)
    mine, loop = states.clone(), states.clone()
    o = gdn_recurrent.recurrent_gated_delta_rule_window(q, k, v, a, b, *gates, mine, slots, scratch)
    assert torch.equal(o, _loop(_rule_step(gates), loop, slots, scratch, q, k, v, a, b))
    assert torch.equal(mine, loop)


def test_window_ops_refuse_mismatched_windows(device):
    x = torch.zeros(6, 32, device=device)
    states = torch.zeros(9, 3, 32, device=device)
    slots, scratch = torch.arange(2, device=device), torch.arange(2, 8, device=device).view(2, 3)
    with pytest.raises(ValueError, match="B \\* T = 6"):
        conv1d.causal_conv1d_window(x, torch.zeros(32, 4, device=device), states, slots[:1], scratch)
    with pytest.raises(ValueError, match="B \\* T = 6"):
        conv1d.causal_conv1d_window(x, torch.zeros(32, 4, device=device), states, slots, scratch[:, :2])
    with pytest.raises(ValueError, match="integer"):
        conv1d.causal_conv1d_window(x, torch.zeros(32, 4, device=device), states, slots, scratch.float())


def test_op_sets_carry_the_window_ops():
    from qse.models.qwen3_5.model import default_ops

    assert default_ops().causal_conv1d_window is naive.causal_conv1d_window
    assert default_ops().recurrent_gated_delta_rule_window is naive.recurrent_gated_delta_rule_window
    for ops in (qse_kernels.triton_ops(), qse_kernels.invariant_ops()):
        assert ops.causal_conv1d_window is conv1d.causal_conv1d_window
        assert ops.recurrent_gated_delta_rule_window is gdn_recurrent.recurrent_gated_delta_rule_window


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,num_rows", [(8, 4), (1, 4), (3, 5)], ids=["B8-T4", "B1-T4", "B3-T5"])
def test_window_ops_at_the_9b_shapes_gpu(num_seqs, num_rows):
    """The 9B's GDN shapes (Hk 16, Hv 32, Dk = Dv = 128, conv dim 8192, K 4, bf16): the window ops give the
    loop path's bits on CUDA, every row and every scratch state."""
    device, dtype = "cuda", torch.bfloat16
    x, weight, conv_states, slots, scratch = _conv_inputs(num_seqs, num_rows, 8192, 4, dtype, dtype, device, seed=11)
    mine, loop = conv_states.clone(), conv_states.clone()
    y = conv1d.causal_conv1d_window(x, weight, mine, slots, scratch)
    step = lambda x_rows, s, target: conv1d.causal_conv1d_slots(x_rows, weight, s, target)  # noqa: E731
    assert torch.equal(y, _loop(step, loop, slots, scratch, x))
    assert torch.equal(mine, loop)
    args, states, slots, scratch = _rule_inputs(num_seqs, num_rows, 16, 32, 128, 128, dtype, device, seed=12)
    q, k = (F.normalize(t.float(), dim=-1).to(dtype) for t in args[:2])  # the model's q, k are of unit scale
    args = (q, k, *args[2:])
    mine, loop = states.clone(), states.clone()
    o = gdn_recurrent.recurrent_gated_delta_rule_window(*args, mine, slots, scratch)
    assert torch.equal(o, _loop(_rule_step(args[5:]), loop, slots, scratch, *args[:5]))
    assert torch.equal(mine, loop)
    _untouched(mine, states, scratch)


def test_model_window_branch_is_the_loop_fallback(tiny_engine, monkeypatch):
    """Qwen35Model._gdn_rows on the torch twins: a verify through the window ops gives the fallback loop's bits
    (the op set without them), every row's logits and the state each slot keeps."""
    from types import SimpleNamespace

    from qse.engine.kv import KVPool, PagedKV
    from qse.engine.rounds import DecodeRounds

    engine, width = tiny_engine, 3
    cfg = engine.cfg
    prompts = [list(range(300, 311)), list(range(900, 917))]

    def verify():
        pool = KVPool(16, 16, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                      engine.device)
        rounds = DecodeRounds(engine, pool, max_running=2, graphs="static", verify_width=width)
        slots, rows = [], []
        for prompt in prompts:
            cache = engine.new_cache(kv=PagedKV(pool))
            logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
            slots.append(rounds.admit(cache))
            rows.append([int(logits[-1].argmax()), *prompt[:width - 1]])
        logits = rounds.verify(slots, rows).clone()
        rounds.keep(slots, [width - 1, 0])
        kept = [(rounds.states.recurrent[:, s].clone(), rounds.states.conv[:, s].clone()) for s in slots]
        return logits, kept

    assert hasattr(engine.model.ops, "recurrent_gated_delta_rule_window")
    fused = verify()
    ops = vars(engine.model.ops)
    loop_ops = SimpleNamespace(**{name: fn for name, fn in ops.items() if not name.endswith("_window")})
    monkeypatch.setattr(engine.model, "ops", loop_ops)
    loop = verify()
    assert torch.equal(fused[0], loop[0])
    for (rf, cf), (rl, cl) in zip(fused[1], loop[1]):
        assert torch.equal(rf, rl) and torch.equal(cf, cl)
