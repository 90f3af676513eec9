"""The shipped defaults: the embedded default names its own small reader (the README's first command shows the
reader working); an empty QSE_SHADOW_MODEL means no reader, nothing of it loaded; a profile without a shadow
block means off."""

import subprocess
import sys
from pathlib import Path

import torch

from qse.models import resolve, same_spec
from qse.server.cli import build_service
from qse.server.profiles import Profile, load_profile, parse_profile
from qse.settings import REGISTRY, EngineSettings

ROOT = Path(__file__).resolve().parents[2]


def _settings(cache_dir, tmp_path, **env):
    return EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
                           "QSE_LEDGER": str(tmp_path / "usage.jsonl"), **env})


def test_the_default_serves_the_embedded_model_with_its_embedded_reader(cache_dir, tmp_path):
    assert REGISTRY["QSE_SHADOW_MODEL"].default == "embedded"
    service = build_service(profile="default", grid=64, device="cpu", dtype="float32",
                            settings=_settings(cache_dir, tmp_path))
    conductor = service.conductor
    assert service.shadow_on and conductor.reader.engine is conductor.served  # one Engine for both
    assert load_profile("default").shadow.mode == "on"  # the shipped default profile has its shadow block


def test_an_empty_shadow_model_means_no_reader_and_nothing_of_it_loaded(cache_dir):
    """In a process of its own: no reader, no reader store, the reader's model never loaded, one Engine (the
    served sessions' own store, with its host and disk tiers, is there whatever the reader)."""
    code = f"""
import sys
from qse.server.cli import build_service
from qse.settings import EngineSettings
service = build_service(profile="coding", device="cpu", dtype="float32",
                        settings=EngineSettings({{"QSE_CACHE_DIR": {str(cache_dir)!r}, "QSE_SHADOW_MODEL": ""}}))
assert service.conductor.reader is None and service.store is None and not service.shadow_on
assert service.conductor.status()["shadow"] == "off"
assert service.served_store is not None and service.conductor.serving.book.residency is service.served_store
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_a_profile_without_a_shadow_block_means_off(cache_dir, tmp_path):
    assert Profile().shadow.mode == "off" and parse_profile("name: plain\n", "plain.yaml").shadow.mode == "off"
    assert parse_profile("shadow:\n  router: shadow\n", "routed.yaml").shadow.mode == "on"  # a block: on
    path = tmp_path / "plain.yaml"
    path.write_text("generation:\n  max_tokens: 64\n")
    service = build_service(profile=str(path), device="cpu", dtype="float32", settings=_settings(cache_dir, tmp_path))
    assert service.conductor.reader is None and not service.shadow_on


def test_embedded_is_a_spec_of_the_embedded_default(cache_dir):
    a = resolve("embedded", torch.device("cpu"), torch.float32, cache_dir)
    b = resolve("", torch.device("cpu"), torch.float32, cache_dir)
    assert a.source == b.source == "embedded" and a.weights_id == b.weights_id
    assert same_spec("embedded", "") and same_spec(None, "embedded") and not same_spec("embedded", "qwen3.5-0.8b")
