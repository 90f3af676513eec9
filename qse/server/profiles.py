"""Profiles: config/profiles/<name>.yaml decoded into typed Structs; an unknown key is an error naming it.

    shadow:                 # the reader beside the served model (absent: off; present: the defaults below)
      mode: on              # off | on
      narrator: off         # off | on: summarize a turn's thought on the reader while the answer streams
      router: off           # off | shadow: ask the router's class question of the reader, journal it
      router_min_tokens: 8192
      narrator_max_tokens: 48
    ui:                     # what the chat stream carries beyond OpenAI's fields
      narrator: off         # off | on: the narrator's summary as a chunk with a `qse_narrator` field
    generation:             # what a request that names nothing gets
      max_tokens: 4096
      temperature: 0.6      # these and top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty:
      top_p: 0.95           # left out, the checkpoint's generation_config.json value, else SAMPLING_DEFAULTS

A request's own value wins over the profile's, the profile's over the checkpoint's generation_config.json,
and that over SAMPLING_DEFAULTS (effective_generation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta, Struct

from ..settings import SHIPPED_CONFIG

PROFILE_DIR = SHIPPED_CONFIG / "profiles"


class ProfileError(ValueError):
    """A profile that cannot be found or read."""


class ShadowBlock(Struct, forbid_unknown_fields=True):
    mode: Literal["off", "on"] = "on"
    narrator: Literal["off", "on"] = "off"
    router: Literal["off", "shadow"] = "off"
    router_min_tokens: Annotated[int, Meta(ge=1)] = 8192
    narrator_max_tokens: Annotated[int, Meta(ge=1, le=1024)] = 48


class UiBlock(Struct, forbid_unknown_fields=True):
    narrator: Literal["off", "on"] = "off"  # the live narrator's summary on the chat stream (needs shadow.narrator)


class GenerationBlock(Struct, forbid_unknown_fields=True):
    """A profile's generation defaults; a sampling value left out (None) falls to the checkpoint's."""

    max_tokens: Annotated[int, Meta(ge=1)] = 4096  # capped by QSE_MAX_OUTPUT_TOKENS
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None  # 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None


class SamplingDefaults(Struct, forbid_unknown_fields=True):
    """What a request that names no sampling value gets: every value filled."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)]
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)]
    top_k: Annotated[int, Meta(ge=0)]
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)]
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)]
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)]
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)]


# below a profile's and a checkpoint's values: the embedded model's family's recommended sampling, no penalties
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0}


class Profile(Struct, forbid_unknown_fields=True):
    name: str = "default"
    description: str = ""
    shadow: ShadowBlock = msgspec.field(default_factory=lambda: ShadowBlock(mode="off"))  # no block: no reader
    generation: GenerationBlock = msgspec.field(default_factory=GenerationBlock)
    ui: UiBlock = msgspec.field(default_factory=UiBlock)


def _on_off(value):
    # YAML 1.1 reads bare on/off as booleans; the profile's words are the strings
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


def parse_profile(text: str, where: str) -> Profile:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{where}: not valid YAML: {exc}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a mapping at the top, got {type(raw).__name__}")
    shadow = raw.get("shadow")
    if isinstance(shadow, dict):
        raw["shadow"] = {k: (_on_off(v) if k in ("mode", "narrator", "router") else v) for k, v in shadow.items()}
    ui = raw.get("ui")
    if isinstance(ui, dict):
        raw["ui"] = {k: (_on_off(v) if k == "narrator" else v) for k, v in ui.items()}
    try:
        return msgspec.convert(raw, type=Profile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def effective_generation(block: GenerationBlock, checkpoint: dict[str, float],
                         where: str = "generation_config.json") -> tuple[SamplingDefaults, dict[str, str]]:
    """The sampling defaults: the profile's value where it sets one, else the checkpoint's (`checkpoint`, from
    `where`), else SAMPLING_DEFAULTS; and for each value which of the three it came from."""
    values, sources = {}, {}
    for key, fallback in SAMPLING_DEFAULTS.items():
        mine = getattr(block, key)
        if mine is not None:
            values[key], sources[key] = mine, "profile"
        elif checkpoint.get(key) is not None:
            values[key], sources[key] = checkpoint[key], where
        else:
            values[key], sources[key] = fallback, "default"
    if sources["top_k"] == where and values["top_k"] < 0:  # transformers and vLLM write "off" as -1 too
        values["top_k"] = 0
    try:
        return msgspec.convert(values, type=SamplingDefaults, strict=False), sources
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def load_profile(name_or_path: str, profile_dir: Path | None = None) -> Profile:
    """A profile by path, or by name: <profile_dir>/<name>.yaml, else ./config/profiles, else the
    profiles shipped in the package (the checkout's config/profiles). 'default' works with no file at all."""
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        dirs, path = [], candidate
    else:
        dirs = [Path(profile_dir)] if profile_dir is not None else [Path.cwd() / "config" / "profiles", PROFILE_DIR]
        path = next((d / f"{name_or_path}.yaml" for d in dirs if (d / f"{name_or_path}.yaml").is_file()),
                    dirs[0] / f"{name_or_path}.yaml")
    if not path.is_file():
        if name_or_path == "default":
            return Profile()
        known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
        raise ProfileError(f"profile {name_or_path!r} not found ({path}); known profiles: {known}")
    profile = parse_profile(path.read_text(), str(path))
    if profile.name == "default" and path.stem != "default":
        profile = msgspec.structs.replace(profile, name=path.stem)
    return profile
