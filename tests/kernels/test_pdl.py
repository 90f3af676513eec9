"""Programmatic dependent launch (qse_kernels/pdl.py): off under the interpreter, which has no grid
dependency control; on the GPU a whole model's prefill and decode rounds, captured in CUDA graphs, give the
bits they give without it (dense and MoE: every kernel of a round launched with PDL)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds
from rounds_rig import tiny_mtp_engine

pdl = pytest.importorskip("qse_kernels.pdl", reason="needs Triton")

PAGE_ROWS = 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case")
def test_pdl_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pdl, "ON", True)
    assert not pdl.active() and pdl.options() == {"PDL": 0}


def test_the_engine_hands_the_policys_switch_to_the_launches(small_model_dir, cache_dir, monkeypatch):
    """Engine(pdl=...) (the policy's QSE_PDL) sets the process's launches; None leaves them as they are."""
    from qse.models import resolve

    monkeypatch.setattr(pdl, "ON", True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    Engine(resolve(str(small_model_dir), device, dtype, cache_dir), kernels="triton")
    assert pdl.ON is True
    Engine(resolve(str(small_model_dir), device, dtype, cache_dir), kernels="triton", pdl=False)
    assert pdl.ON is False and not pdl.active() and pdl.options() == {"PDL": 0}


def _script(engine: Engine) -> list[torch.Tensor]:
    """Three sequences (7, 60 and 130 rows: page lines crossed) prefilled, then eight captured rounds, one
    sequence leaving after the fourth: every prefill's and round's logits."""
    cfg = engine.cfg
    pool = KVPool(16, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)
    rounds = DecodeRounds(engine, pool, max_running=4, graphs=True)
    rounds.warm()
    out, live = [], []
    for n in (7, 60, 130):
        cache = engine.new_cache(kv=PagedKV(pool))
        logits, _ = engine.forward(cache, engine.ids_tensor([(300 + i) % cfg.vocab_size for i in range(n)]), "last")
        out.append(logits.clone())
        live.append((rounds.admit(cache), logits[-1].argmax().view(1)))
    for step in range(8):
        if step == 4:
            rounds.release(live.pop(1)[0]).kv.release_all()
        logits = rounds.run([seq for seq, _ in live], torch.cat([ids for _, ids in live]))
        out.append(logits.clone())
        live = [(seq, logits[row].argmax().view(1)) for row, (seq, _) in enumerate(live)]
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                         and pdl.gdc_wait is not None),
                    reason="PDL needs a sm90+ CUDA device and a Triton with grid dependency control")
@pytest.mark.parametrize("order", ["release", "wait"])
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_rounds_with_pdl_give_the_bits_of_rounds_without(family, order, monkeypatch):
    """Either order of a kernel's wait and its release of the next launch."""
    torch.manual_seed(0)
    engine = tiny_mtp_engine("triton", family)
    monkeypatch.setattr(pdl, "ON", False)
    plain = _script(engine)
    monkeypatch.setattr(pdl, "ON", True)
    monkeypatch.setattr(pdl, "ORDER", pdl.RELEASE_FIRST if order == "release" else pdl.WAIT_FIRST)
    assert pdl.active()
    launched = _script(engine)
    assert len(plain) == len(launched) == 11
    assert all(torch.equal(a, b) for a, b in zip(plain, launched))
