"""Shared fixtures: one cache dir and one tiny embedded engine per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A file under ../shared (laid beside the clone in CI too); its absence is a failure, not a skip."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} is not present (../shared is laid beside the checkout in CI)")
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qse-cache")
    os.environ["QSE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_engine(cache_dir):
    from qse.engine.engine import Engine
    from qse.models import resolve

    torch.manual_seed(0)
    return Engine(resolve("", torch.device("cpu"), torch.float32, cache_dir))


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3_5ForCausalLM written by transformers itself (8 layers: both kinds repeat)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(1234)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    # transformers initialises norms to identity and A_log/dt_bias to fixed values; perturb them so
    # every weight matters in the comparison
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf-tiny")
    model.save_pretrained(out)
    return out
