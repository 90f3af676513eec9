"""`qse serve`'s wiring: one Engine when the reader reads the served weights, no reader when the profile says
off, and a serve.env that fills only what the environment leaves unset."""

from __future__ import annotations

import os

import pytest

from qse.server.cli import apply_env_file, build_service
from qse.settings import EngineSettings


def test_the_reader_reuses_the_served_engine(cache_dir, tmp_path):
    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
                               "QSE_LEDGER": str(tmp_path / "usage.jsonl")})
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32", settings=settings)
    conductor = service.conductor
    assert conductor.reader.engine is conductor.served  # one copy of the weights
    assert conductor.reader.grid == 64 and conductor.options.router == "shadow"
    assert service.store is not None and service.store.disk_dir is None
    assert service.max_context_tokens == conductor.served.cfg.max_position_embeddings


def test_the_idle_group_reaches_the_reader_and_the_conductor_and_a_bad_one_is_named(cache_dir, tmp_path):
    """QSE_SHADOW_IDLE_GROUP: the conductor's idle launches and the reader's captured group sizes (warm)."""
    base = {"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
            "QSE_LEDGER": str(tmp_path / "usage.jsonl")}
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                            settings=EngineSettings({**base, "QSE_SHADOW_IDLE_GROUP": "4"}))
    assert service.conductor.runner.idle_group == 4 and service.conductor.reader.chunk_group == 4
    with pytest.raises(ValueError, match=r"QSE_SHADOW_IDLE_GROUP\) must be a whole number of chunks >= 1, got 0"):
        build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                      settings=EngineSettings({**base, "QSE_SHADOW_IDLE_GROUP": "0"}))


def test_a_profile_with_the_shadow_off_builds_no_reader(cache_dir, tmp_path):
    path = tmp_path / "quiet.yaml"
    path.write_text("shadow:\n  mode: off\n")
    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir)})
    service = build_service(profile=str(path), device="cpu", dtype="float32", settings=settings)
    assert service.conductor.reader is None and service.store is None and not service.shadow_on


def test_env_file_fills_only_unset_switches(tmp_path, monkeypatch):
    path = tmp_path / "serve.env"
    path.write_text("# comment\nQSE_PORT=9001\nQSE_HOST=0.0.0.0\n")
    monkeypatch.setenv("QSE_HOST", "127.0.0.2")
    monkeypatch.setenv("QSE_PORT", "1")  # so that monkeypatch restores QSE_PORT whatever apply_env_file sets
    monkeypatch.delenv("QSE_PORT")
    applied = apply_env_file(path)
    assert applied == {"QSE_PORT": "9001"}
    assert os.environ["QSE_PORT"] == "9001" and os.environ["QSE_HOST"] == "127.0.0.2"
