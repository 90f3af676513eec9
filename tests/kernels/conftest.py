"""Kernel tests: every Triton kernel against its naive twin.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; TRITON_INTERPRET must be set before
any kernel module is imported (Triton reads it when a kernel is decorated), hence the top of this file.
Tests marked `gpu` run larger shapes and are skipped without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

IS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if IS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The model the interpreted whole-model tests run: the embedded default's hidden size and head dims with half
# its heads (GQA two to one on both layer kinds, as there: the per-head kernels' launches cost their program
# count), every layer kind twice in four layers, an MLP of 128 (the fused gate and up projection one column
# tile, the down projection two K steps) and a vocabulary that is not a multiple of any block size (the heads'
# masked tails: two GEMM column tiles, six GEMV programs). The interpreter's cost is the programs it runs (and
# their loop steps), hardly their sizes: under it the real 248,320-row head cost ~100 s a question.
SMALL_VOCAB = 328
SMALL_SHAPE = dict(num_hidden_layers=4, full_attention_interval=2, vocab_size=SMALL_VOCAB, eos_token_id=SMALL_VOCAB - 2,
                   intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1,
                   linear_num_value_heads=2)


def _write_small_model(tmp_path_factory, name: str, **shape):
    from qse.models.qwen3_5 import parse_config, presets

    config = {**presets.embedded_config_dict(), **SMALL_SHAPE, **shape}
    model_dir = tmp_path_factory.mktemp(name) / "small-qwen3.5"
    presets.write_checkpoint(model_dir, config, presets.random_tensors(parse_config(config), presets.EMBEDDED_SEED))
    return model_dir


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    return _write_small_model(tmp_path_factory, "small-model")


@pytest.fixture(scope="session")
def two_layer_model_dir(tmp_path_factory):
    """The same with one layer of each kind (GDN, then attention): for a test whose two sides run the same
    per-layer path, where a second layer of a kind repeats the same kernels (half the interpreted launches)."""
    return _write_small_model(tmp_path_factory, "two-layer-model", num_hidden_layers=2)


@pytest.fixture
def few_programs(monkeypatch):
    """Wide tiles for the whole-model tests: the interpreter runs every program as a Python loop, so a launch
    costs its program count (the GEMV's pinned 4-row tiles made the 1,000-row head 250 programs, most of a
    decode step). The tile sizes are constexprs of the same code; the kernels' own tests keep the pinned ones."""
    from qse_kernels import conv1d, fused, gdn_chunk, gemm, gemv

    monkeypatch.setattr(gemv, "NARROW_ROWS", 64)  # BK = TILE_ELEMENTS / 64 = 64: the model's hidden size
    monkeypatch.setattr(gemm, "BLOCK_N", 256)  # the 328-row head in two column tiles, the last one partial
    monkeypatch.setattr(conv1d, "CONV_BLOCK_T", 64)  # a grid chunk's rows in one program row
    monkeypatch.setattr(fused, "SILU_BLOCK_T", 64)
    monkeypatch.setattr(gdn_chunk, "SCAN_BLOCK_V", 32)  # a head's whole value dim


@pytest.fixture
def device() -> str:
    return "cuda" if IS_CUDA else "cpu"


@pytest.fixture
def interpreted() -> bool:
    """True under Triton's interpreter, whose fp32 -> bf16 casts truncate instead of rounding to nearest."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(autouse=True)
def poison_fresh_buffers(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled floats, so memory a kernel forgets to write shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32; NaN anywhere in out gives inf."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def rel():
    return rel_err
