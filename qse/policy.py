"""The policy: every QSE_* value the layers below the entry point act on, read once and handed down.

An entry point (`qse serve`, a `qse` subcommand, the replay's command, a benchmark's main) builds one `Policy`
with `Policy.from_settings(settings)` and passes it to what it builds (the conductor, the served sessions, the
reader, the replay simulator). Nothing below the entry points reads `qse.settings.SETTINGS` (tests/test_layering.py
holds that). Each default is declared once, in the settings registry: a field's default here *is* the
registry's default, so `Policy()` is the shipped policy and `Policy(ration_after_s=0.0)` a variant of it.

Frozen: a layer that wants another value is given another policy (`dataclasses.replace`), it never edits one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.idle import READ_ORDERS
from .core.sizing import FIXED_KV_POOL_GB
from .settings import REGISTRY, EngineSettings


SPECULATE_MODES = ("off", "ngram", "mtp")
MAX_SPEC_DRAFT = 15  # a verify reads at most 16 rows a turn


def _from(name: str) -> Any:
    """A field read from the setting `name`, its default the registry's (the one declaration of it)."""
    return dataclasses.field(default=REGISTRY[name].default, metadata={"setting": name})


@dataclass(frozen=True)
class Policy:
    # the reader's time (qse/core: TurnRation, IdleWindow, ChunkCostEstimator; the conductor and the replay)
    ration: float = _from("QSE_SHADOW_RATION")  # the reader's share of the served model's time
    ration_after_s: float = _from("QSE_SHADOW_RATION_AFTER_S")  # ... counted from first token + this
    busy_share: float = _from("QSE_SHADOW_BUSY_SHARE")  # ... and of all the served time, whatever turns run
    slice_ms: float = _from("QSE_SHADOW_SLICE_MS")  # longest slice between two decode rounds
    min_slice_ms: float = _from("QSE_SHADOW_MIN_SLICE_MS")  # a slice opens once this much is earned
    narrator_share: float = _from("QSE_NARRATOR_SHARE")  # the narrator's share, from the first token
    idle_poll_s: float = _from("QSE_SHADOW_IDLE_POLL_S")
    idle_burst_s: float = _from("QSE_SHADOW_IDLE_BURST_S")
    idle_wake: bool = _from("QSE_SHADOW_IDLE_WAKE")  # the idle window looks when the engine comes free
    read_order: str = _from("QSE_SHADOW_READ_ORDER")  # shortest | oldest (qse/core/idle.py: READ_ORDERS)
    chunk_prior_ms: float = _from("QSE_SHADOW_CHUNK_PRIOR_MS")  # a chunk's cost before one was measured
    idle_group: int = _from("QSE_SHADOW_IDLE_GROUP")  # chunks one idle launch may read
    reader_lookahead: int = _from("QSE_SHADOW_LOOKAHEAD")  # chunks launched ahead of the one read back
    launch_lead_ms: float = _from("QSE_SHADOW_LAUNCH_LEAD_MS")
    # the reader's sessions (qse/shadow, and the replay's model of them)
    grid: int = _from("QSE_SHADOW_GRID")
    checkpoints: int = _from("QSE_SHADOW_CHECKPOINTS")  # prompt-end checkpoints (the served sessions' too)
    recent_checkpoints: int = _from("QSE_SHADOW_RECENT_CHECKPOINTS")  # and the newest grid lines read
    divergence_checkpoints: int = _from("QSE_SHADOW_DIVERGENCE_CHECKPOINTS")
    share_heads: bool = _from("QSE_SHARE_HEADS")  # a new session may start from another's state (served, reader)
    reader_gb: float = _from("QSE_SHADOW_GB")
    reader_graphs: bool = _from("QSE_SHADOW_GRAPHS")
    chunk_group: int = _from("QSE_SHADOW_CHUNK_GROUP")  # bulk reads (shadow-check, fresh prefills)
    # the served model
    kernels: str = _from("QSE_KERNELS")
    pdl: bool = _from("QSE_PDL")  # programmatic dependent launch of the Triton kernels (qse_kernels/pdl.py)
    served_graphs: bool = _from("QSE_SERVED_GRAPHS")
    served_kv_gb: float = _from("QSE_SERVED_KV_GB")  # 0 (auto): FIXED_KV_POOL_GB unless sized (__post_init__)
    served_grid: int = _from("QSE_SERVED_GRID")
    served_chunk_group: int = _from("QSE_SERVED_CHUNK_GROUP")  # a prompt's grid chunks one launch may read
    served_checkpoint_ladder: int = _from("QSE_SERVED_CHECKPOINT_LADDER")  # served states at 8k, 16k, 32k, ... rows
    max_running: int = _from("QSE_MAX_RUNNING")
    round_token_budget: int = _from("QSE_ROUND_TOKEN_BUDGET")  # prompt ids a round reads beside its decode rows
    launch_ahead: bool = _from("QSE_LAUNCH_AHEAD")  # rounds of device-sampled turns launched before reading back
    decode_yield_ms: float = _from("QSE_DECODE_YIELD_MS")  # running turns may sit out prompt rounds this long
    first_token_early: bool = _from("QSE_FIRST_TOKEN_EARLY")  # a first token leaves when its tail is read
    cut_rounds: bool = _from("QSE_ROUND_CUT")  # a round stops where a newcomer goes before its next piece
    speculate: str = _from("QSE_SPECULATE")  # off | ngram | mtp
    spec_draft: int = _from("QSE_SPEC_DRAFT")  # drafted ids a turn a round, at most
    max_waiting: int = _from("QSE_MAX_WAITING")
    max_question_tokens: int = _from("QSE_MAX_QUESTION_TOKENS")
    gc_freeze: bool = _from("QSE_GC_FREEZE")
    # where the router's journal goes (shadow.jsonl); None: no journal. from_settings: QSE_SHADOW_DIR, else
    # <cache>/shadow
    journal_dir: Path | None = None

    def __post_init__(self) -> None:
        # QSE_SERVED_KV_GB 0 is auto: the entry point that measures the device sizes the pool and hands down a
        # policy with the size (qse serve's build_service, on a GPU: qse/core/sizing.py); a policy handed down
        # unsized (a CPU, a benchmark, a test) holds the fixed size
        if self.served_kv_gb == 0:
            object.__setattr__(self, "served_kv_gb", FIXED_KV_POOL_GB)
        if self.read_order not in READ_ORDERS:
            raise ValueError(f"QSE_SHADOW_READ_ORDER={self.read_order!r} is not one of {READ_ORDERS}")
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(f"QSE_SPECULATE={self.speculate!r} is not one of {SPECULATE_MODES}")
        if not (isinstance(self.spec_draft, int) and 1 <= self.spec_draft <= MAX_SPEC_DRAFT):
            raise ValueError(f"QSE_SPEC_DRAFT={self.spec_draft!r} must be an integer in [1, {MAX_SPEC_DRAFT}]")

    @property
    def verify_width(self) -> int:
        """The most rows a running turn reads in one round: its token and its drafts (0: no speculation)."""
        return self.spec_draft + 1 if self.speculate != "off" else 0

    @property
    def mtp(self) -> bool:
        """Whether the served turns draft with the checkpoint's MTP head (QSE_SPECULATE=mtp)."""
        return self.speculate == "mtp"

    @classmethod
    def from_settings(cls, settings: EngineSettings, **overrides: Any) -> "Policy":
        """The policy the switches in `settings` ask for; `overrides` (a command's flags) win where not None."""
        values = {f.name: settings.get(f.metadata["setting"]) for f in dataclasses.fields(cls) if f.metadata}
        values["journal_dir"] = settings.get("QSE_SHADOW_DIR") or settings.cache_dir() / "shadow"
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def reader_checkpoints(self) -> dict[str, int]:
        """The checkpoint counts as GridSessions/ShadowReader take them."""
        return dict(max_checkpoints=self.checkpoints, recent_checkpoints=self.recent_checkpoints,
                    divergence_checkpoints=self.divergence_checkpoints)

    def served_checkpoints(self) -> dict[str, int]:
        """The served sessions' checkpoint counts, as GridSessions takes them: the reader's prompt-end and recent
        counts and the ladder, no divergence checkpoints (the served book and the replay's model of it read this)."""
        return dict(max_checkpoints=self.checkpoints, recent_checkpoints=self.recent_checkpoints,
                    ladder_from=self.served_checkpoint_ladder)

