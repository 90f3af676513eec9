"""Profiles (config/profiles/*.yaml) and config/serve.env."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qse.server.profiles import PROFILE_DIR, Profile, ProfileError, load_profile, parse_profile
from qse.settings import REGISTRY, load_env_file

CONFIG = Path(__file__).resolve().parents[2] / "config"


def test_shipped_profiles_load():
    default = load_profile("default")
    assert default.name == "default"
    assert (default.shadow.mode, default.shadow.router, default.shadow.narrator) == ("on", "off", "off")
    coding = load_profile("coding")
    assert (coding.shadow.mode, coding.shadow.router, coding.shadow.router_min_tokens) == ("on", "shadow", 8192)
    assert {p.stem for p in PROFILE_DIR.glob("*.yaml")} >= {"default", "coding"}


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ProfileError, match="routr"):
        parse_profile("shadow:\n  mode: on\n  routr: shadow\n", "p.yaml")
    with pytest.raises(ProfileError, match="colour"):
        parse_profile("colour: blue\n", "p.yaml")


@pytest.mark.parametrize("text, match", [
    ("shadow:\n  mode: maybe\n", "maybe"),
    ("shadow:\n  router_min_tokens: -1\n", "router_min_tokens"),
    ("generation:\n  top_p: 0\n", "top_p"),
    ("- a\n- b\n", "mapping"),
    ("shadow: [\n", "YAML"),
])
def test_bad_values_are_errors(text, match):
    with pytest.raises(ProfileError, match=match):
        parse_profile(text, "p.yaml")


def test_yaml_on_off_read_as_words_and_a_path_loads(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("shadow:\n  mode: off\n  narrator: on\n")
    profile = load_profile(str(path))
    assert (profile.name, profile.shadow.mode, profile.shadow.narrator) == ("mine", "off", "on")
    assert parse_profile("", "empty.yaml") == Profile()


def test_missing_profile_names_the_known_ones(tmp_path):
    with pytest.raises(ProfileError, match="coding"):
        load_profile("nope")
    assert load_profile("default", profile_dir=tmp_path) == Profile()  # works with no file at all


def test_serve_env_is_valid_and_lists_the_server_switches():
    path = CONFIG / "serve.env"
    load_env_file(path)  # every active line declared and parsable
    named = set(re.findall(r"\b(QSE_[A-Z0-9_]+)=", path.read_text()))
    assert named <= set(REGISTRY), f"serve.env names undeclared switches: {sorted(named - set(REGISTRY))}"
    server_switches = {"QSE_HOST", "QSE_PORT", "QSE_ROOT_PATH", "QSE_FORWARDED_ALLOW_IPS", "QSE_API_KEY",
                       "QSE_MAX_BODY_BYTES", "QSE_MAX_PROMPT_TOKENS", "QSE_MAX_OUTPUT_TOKENS",
                       "QSE_MAX_QUESTION_TOKENS", "QSE_PROFILE", "QSE_LEDGER", "QSE_LOG_LEVEL", "QSE_MODEL",
                       "QSE_SHADOW_MODEL", "QSE_SHADOW_GRID", "QSE_SHADOW_GB", "QSE_SHADOW_DISK"}
    assert server_switches <= named


def test_the_ui_block_switches_the_narrator_s_stream_event():
    assert parse_profile("shadow:\n  narrator: on\nui:\n  narrator: on\n", "p.yaml").ui.narrator == "on"
    assert Profile().ui.narrator == "off"
    with pytest.raises(ProfileError, match="narator"):
        parse_profile("ui:\n  narator: on\n", "p.yaml")
