"""The settings registry and the CLI's JSON commands."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_env_file_takes_quotes_export_and_comments(tmp_path):
    f = tmp_path / "serve.env"
    f.write_text("# a comment\n"
                 "export QSE_HOST=0.0.0.0\n"
                 'QSE_API_KEY="two words # not a comment"\n'
                 "QSE_ROOT_PATH='/qse/$HOME'\n"
                 "QSE_SHADOW_GRID=256   # after the value\n"
                 "QSE_MODEL=\n")
    assert load_env_file(f) == {"QSE_HOST": "0.0.0.0", "QSE_API_KEY": "two words # not a comment",
                                "QSE_ROOT_PATH": "/qse/$HOME", "QSE_SHADOW_GRID": "256", "QSE_MODEL": ""}


@pytest.mark.parametrize("line, message", [
    ("QSE_SHADOW_GRID", "serve.env:2: expected KEY=VALUE"),
    ("not a setting line", "serve.env:2: expected KEY=VALUE"),
    ("export QSE_SHADOW_GRID='big'", "serve.env:2: QSE_SHADOW_GRID='big' is not a valid int"),
    ('QSE_TYPO="1"', "serve.env:2: unknown setting 'QSE_TYPO'"),
], ids=["no-value", "no-equals", "bad-value", "unknown-key"])
def test_env_file_errors_name_the_line(tmp_path, line, message):
    f = tmp_path / "serve.env"
    f.write_text(f"QSE_PORT=8000\n{line}\n")
    with pytest.raises(SettingError, match=message):
        load_env_file(f)


def test_shipped_config_is_the_checkouts_and_holds_every_profile():
    """The package's config dir (what a wheel ships) holds serve.env and the profiles; the checkout's config/
    is the same files."""
    from qse.settings import SHIPPED_CONFIG

    checkout = Path(__file__).resolve().parents[1] / "config"
    assert (SHIPPED_CONFIG / "serve.env").is_file() and load_env_file(SHIPPED_CONFIG / "serve.env")
    assert {p.name for p in (SHIPPED_CONFIG / "profiles").glob("*.yaml")} >= {"default.yaml", "coding.yaml"}
    assert checkout.resolve() == SHIPPED_CONFIG


def test_the_wheel_ships_every_config_file():
    """pyproject's package data names every file of the package's config dir (a wheel install has no checkout)."""
    import fnmatch

    from qse.settings import SHIPPED_CONFIG

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["qse"]
    files = [p.relative_to(SHIPPED_CONFIG.parent).as_posix() for p in SHIPPED_CONFIG.rglob("*") if p.is_file()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)


def test_profiles_load_from_the_package_without_a_config_dir(tmp_path, monkeypatch):
    from qse.server.profiles import load_profile

    monkeypatch.chdir(tmp_path)  # no ./config/profiles here
    assert load_profile("coding").shadow.router == "shadow"


def test_settings_command_prints_every_switch(capsys):
    assert main(["settings"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["settings"]
    assert {r["name"] for r in rows} == set(REGISTRY)
    assert (Path(out["config_dir"]) / "serve.env").is_file()
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
