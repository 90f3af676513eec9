"""A Qwen3.5-MoE model in the engine's decode rounds (qse/engine/rounds.py, the graph path's static flow) on qse's
row-invariant kernels (QSE_KERNELS=invariant, the MoE block Triton's; interpreted on CPU): a sequence's logits and
the state its round leaves are the same bits in a round of two sequences of different lengths (a bucket of
three: one padding row) and alone; a verify window's first row is the decode round's row; and the Triton block
agrees with the torch twin's forward within rounding."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported (Triton reads it at decoration)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from qse.engine.engine import Engine  # noqa: E402
from qse.engine.kv import KVPool, PagedKV  # noqa: E402
from qse.engine.rounds import DecodeRounds  # noqa: E402
from qse.models import ResolvedModel  # noqa: E402
from qse.models.qwen3_5_moe import ChatFormat, Qwen35MoeModel, parse_config, presets  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE_ROWS = 64
SHAPE = presets.tiny_config_dict(num_hidden_layers=2)  # one layer of each kind
PROMPTS = [list(range(10, 20)), list(range(30, 30 + PAGE_ROWS))]  # the second's round crosses a page line


@pytest.fixture
def wide_tiles(monkeypatch):
    """Wide tiles for the interpreter, which runs every program as a Python loop (tests/kernels/conftest.py's
    few_programs: the same code, other constexprs; the kernels' own tests keep the pinned ones)."""
    from qse_kernels import conv1d, fused, gdn_chunk, gemm, gemv

    monkeypatch.setattr(gemv, "NARROW_ROWS", 64)
    monkeypatch.setattr(gemm, "BLOCK_N", 256)
    monkeypatch.setattr(conv1d, "CONV_BLOCK_T", 64)
    monkeypatch.setattr(fused, "SILU_BLOCK_T", 64)
    monkeypatch.setattr(gdn_chunk, "SCAN_BLOCK_V", 32)


def _engine(kernels: str) -> Engine:
    cfg = parse_config(SHAPE)
    model = Qwen35MoeModel(cfg, presets.random_weights(cfg, 5, "cpu", torch.float32), "cpu", torch.float32)
    engine = Engine(ResolvedModel(model, ChatFormat(None), "tiny-moe", "preset", "qwen3_5_moe", "tiny-moe"),
                    kernels=kernels)
    assert engine.kernels == kernels
    return engine


def _pool(engine) -> KVPool:
    cfg = engine.cfg
    return KVPool(8, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, engine.dtype,
                  engine.device)


def _same_state(a, b) -> bool:
    return (a.length == b.length and all(torch.equal(a.sections[k], b.sections[k]) for k in a.sections)
            and all(torch.equal(a.views[k], b.views[k]) for k in a.views))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels interpreted on CPU tensors; on a GPU "
                    "tests/kernels/test_moe.py checks the block's rows at the real shapes")
def test_moe_rounds_give_every_row_the_bits_it_gets_alone(wide_tiles):
    engine = _engine("invariant")
    assert engine.model.moe_block.__module__ == "qse_kernels.moe"
    # the block's combine fused with the add and norm after it: every row below runs through that launch
    assert engine.model.moe_block_add_norm.__name__ == "moe_block_add_rms_norm"
    twin = _engine("naive")  # the same weights (same seed) on the torch twins: the prompts, and the agreement
    starts = []
    for prompt in PROMPTS:
        cache = twin.new_cache(kv=PagedKV(_pool(twin)))
        logits, _ = twin.forward(cache, twin.ids_tensor(prompt), "last")
        starts.append((twin.cache_state(cache), int(logits[-1].argmax())))

    def round_of(group, max_running, buckets=None, verify_width=0):
        pool = _pool(engine)
        rounds = DecodeRounds(engine, pool, max_running=max_running, graphs="static", buckets=buckets,
                              verify_width=verify_width)
        slots = [rounds.admit(engine.restore_cache(state, PagedKV(pool))) for state, _ in group]
        return rounds, slots

    rounds, slots = round_of(starts, 3, buckets=(1, 3))
    together = rounds.run(slots, [token for _, token in starts]).clone()
    assert rounds.bucket(len(slots)) == 3  # one padding row
    together_states = [engine.cache_state(rounds.release(slot)) for slot in slots]
    for i, start in enumerate(starts):
        rounds, [slot] = round_of([start], 1)
        alone = rounds.run([slot], [start[1]])
        assert torch.equal(alone[0], together[i])
        assert _same_state(engine.cache_state(rounds.release(slot)), together_states[i])
        cache = twin.restore_cache(start[0], PagedKV(_pool(twin)))
        naive, _ = twin.forward(cache, twin.ids_tensor([start[1]]), "last")
        torch.testing.assert_close(alone[0], naive[-1], rtol=1e-4, atol=1e-4)
    # a verify window (decode_step's window argument): row 0 of each sequence is its decode round's row
    rounds, slots = round_of(starts, 2, verify_width=2)
    rows = [[token, (token + 1) % SHAPE["vocab_size"]] for _, token in starts]
    verified = rounds.verify(slots, rows)
    assert all(torch.equal(verified[i, 0], together[i]) for i in range(len(starts)))
