"""Weights asked into L2 ahead of their kernel (qse_kernels/l2.py): what ahead() refuses, that nothing launches
under the interpreter, and where a decode round asks for what (the model's plan, Qwen35Model._ahead_plan and
the MoE family's). That asking changes no bit of a round is tested on the GPU in test_pdl.py."""

from __future__ import annotations

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds
from qse.models import ResolvedModel
from qse.models.qwen3_5 import Qwen35Model, parse_config
from qse.models.qwen3_5.presets import random_weights, tiny_mtp_config_dict
from qse.models.qwen3_5_moe import Qwen35MoeModel
from qse.models.qwen3_5_moe import parse_config as parse_moe_config
from qse.models.qwen3_5_moe import presets as moe_presets

l2 = pytest.importorskip("qse_kernels.l2", reason="needs Triton")


def test_ahead_refuses_what_it_cannot_ask_for_and_names_it():
    w = torch.zeros(64, 64)
    assert l2.askable(w) and not l2.askable(w.t()) and not l2.askable(w.view(-1)[1:9])
    with pytest.raises(ValueError, match=r"strides \(1, 64\)"):
        l2.ahead(w.t())
    with pytest.raises(ValueError, match="at most 4 tensors a launch; got 5"):
        l2.ahead(*[w] * 5)
    with pytest.raises(ValueError, match="32 bytes"):  # 16-byte aligned, but 8 float32 at an odd offset
        l2.ahead(w.view(-1)[1:9])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case")
def test_nothing_is_asked_for_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(l2, "AHEAD", True)
    assert not l2.active() and l2.stream_policy() == ""
    l2.ahead(torch.zeros(64, 64))  # checked, then nothing


def _cpu_engine(family: str) -> Engine:
    """A tiny model of the family on the torch twins, in float32 on the CPU."""
    if family == "moe":
        cfg = parse_moe_config(moe_presets.tiny_config_dict(mtp_num_hidden_layers=0))
        model = Qwen35MoeModel(cfg, moe_presets.random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    else:
        cfg = parse_config(tiny_mtp_config_dict(linear_key_head_dim=32, linear_value_head_dim=32))
        model = Qwen35Model(cfg, random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    return Engine(ResolvedModel(model, None, f"tiny-{family}", "random", model.family, "tiny-cpu"), kernels="naive")


def _ptrs(tensors) -> list[tuple[int, tuple[int, ...]]]:
    return [(t.data_ptr(), tuple(t.shape)) for t in tensors]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_decode_round_asks_for_its_plan_where_the_plan_says(family, monkeypatch):
    """Each layer's mixer stage (its output projection; the MoE's router and shared expert too), then its mlp
    stage (the MoE: the first rows of the next layer's input projection, the head's after the last layer), once
    a round, in layer order; the dense MLP asks for nothing."""
    monkeypatch.setattr(l2, "NEXT_BYTES", 3 * 64 * 4)  # three rows of the tiny models' [N, 64] float32 weights
    engine = _cpu_engine(family)
    model, cfg = engine.model, engine.cfg
    asked = []
    model.ops.l2_ahead = lambda *tensors: asked.append(_ptrs(tensors))
    pool = KVPool(8, 64, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype, engine.device)
    rounds = DecodeRounds(engine, pool, max_running=2, graphs=False)
    slots = []
    for n in (5, 9):
        cache = engine.new_cache(kv=PagedKV(pool))
        engine.forward(cache, engine.ids_tensor([(7 * i + n) % cfg.vocab_size for i in range(n)]), "last")
        slots.append(rounds.admit(cache))
    asked.clear()  # the prefills' chunks ask for nothing: only decode steps have the plan
    rounds.run(slots, [3, 4])

    expected = []
    for layer, kind in enumerate(cfg.layer_types):
        p = f"layers.{layer}."
        out = p + ("self_attn.o_proj.weight" if kind == "full_attention" else "linear_attn.out_proj.weight")
        mixer = [model.lin[out].weight]
        if family == "moe":
            router_w, _, _, shared_gate_up, shared_down, _ = model.moe_args[p]
            mixer += [router_w, shared_gate_up, shared_down]
        expected.append(_ptrs(mixer))
        if family == "moe":
            if layer + 1 < len(cfg.layer_types):
                group = ("self_attn.qkv_proj" if cfg.layer_types[layer + 1] == "full_attention"
                         else "linear_attn.in_proj")
                nxt = model.fused[f"layers.{layer + 1}.{group}"][0].weight
            else:
                nxt = model.lm_head.weight
            expected.append([(nxt.data_ptr(), (3, nxt.shape[1]))])
    assert asked == expected


def test_the_dense_family_asks_for_no_mlp_stage_and_skips_what_is_not_one_matrix():
    engine = _cpu_engine("dense")
    plan = engine.model._ahead_plan()
    assert all(stage == "mixer" for _, stage in plan)
    assert len(plan) == len(engine.cfg.layer_types)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="bulk prefetch to L2 needs a sm90+ CUDA device")
def test_ahead_asks_for_ranges_of_any_length_eagerly_and_in_a_graph(monkeypatch):
    """Lengths that end inside a piece, a tensor of one piece's 16 bytes, four at once: no fault, no value moved,
    the same from a graph replayed (the kernels after it see what they would have seen)."""
    monkeypatch.setattr(l2, "AHEAD", True)
    assert l2.active()
    tensors = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in (8, l2.PIECE // 2 + 8, 3 * l2.PIECE + 24)]
    tensors.append(torch.randn(1 << 20, device="cuda"))
    copies = [t.clone() for t in tensors]
    l2.ahead(*tensors)
    l2.ahead(tensors[1])
    graph = torch.cuda.CUDAGraph()
    out = torch.empty(1, device="cuda")
    with torch.cuda.graph(graph):
        l2.ahead(*tensors)
        out.copy_(tensors[3].sum().view(1))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))
    assert torch.equal(out, copies[3].sum().view(1))
