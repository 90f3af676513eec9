"""The settings registry and the CLI's JSON commands."""

from __future__ import annotations

import json

import pytest

from qse.cli import main
from qse.settings import REGISTRY, EngineSettings, SettingError, load_env_file


def test_registry_reads_types_and_defaults():
    s = EngineSettings({"QSE_SHADOW_GRID": "256", "QSE_SHADOW_GRAPHS": "off", "QSE_SHADOW_GB": "1.5"})
    assert s.get("QSE_SHADOW_GRID") == 256
    assert s.get("QSE_SHADOW_GRAPHS") is False
    assert s.get("QSE_SHADOW_GB") == 1.5
    assert s.get("QSE_SHADOW_RATION") == REGISTRY["QSE_SHADOW_RATION"].default == 0.02


def test_bad_values_and_unknown_names_are_refused():
    with pytest.raises(SettingError, match="QSE_SHADOW_GRID='big' is not a valid int"):
        EngineSettings({"QSE_SHADOW_GRID": "big"}).get("QSE_SHADOW_GRID")
    with pytest.raises(SettingError, match="unknown setting 'QSE_NOPE'"):
        EngineSettings({}).get("QSE_NOPE")


def test_env_file_is_checked(tmp_path):
    f = tmp_path / "serve.env"
    f.write_text("# comment\nQSE_SHADOW_GRID=512\n")
    assert load_env_file(f) == {"QSE_SHADOW_GRID": "512"}
    f.write_text("QSE_TYPO=1\n")
    with pytest.raises(SettingError, match="unknown setting 'QSE_TYPO'"):
        load_env_file(f)


def test_settings_command_prints_every_switch(capsys):
    assert main(["settings"]) == 0
    rows = json.loads(capsys.readouterr().out)["settings"]
    assert {r["name"] for r in rows} == set(REGISTRY)
    assert all(r["doc"] for r in rows)


def test_generate_command_decodes_greedily(cache_dir, capsys):
    argv = ["generate", "--model", "", "--device", "cpu", "--dtype", "float32", "--prompt", "Hello", "--max-tokens", "5"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["output_tokens"] == 5 and first["token_ids"] == second["token_ids"]
    assert first["prompt_tokens"] > 5


def test_generate_command_refuses_empty_prompt(cache_dir, capsys):
    assert main(["generate", "--model", "", "--device", "cpu", "--prompt", "", "--max-tokens", "2"]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
