"""The one registry of every QSE_* switch.

Every switch is declared here once (name, type, default, one-line doc) and read only through
`SETTINGS.get(name)` (or an `EngineSettings` over another mapping, for tests and for a second
engine in one process). `qse settings` prints the table. Reading an undeclared name is an error,
so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from platformdirs import user_cache_dir


class SettingError(ValueError):
    """A QSE_* value that cannot be parsed, or a name that is not in the registry."""


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, got {raw!r}")


_PARSERS: dict[type, Callable[[str], Any]] = {
    int: int,
    float: float,
    str: str,
    bool: _parse_bool,
    Path: lambda raw: Path(raw).expanduser(),
}


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type
    default: Any
    doc: str
    secret: bool = False  # `qse settings` shows whether it is set, never its value

    def parse(self, raw: str) -> Any:
        try:
            return _PARSERS[self.kind](raw)
        except (TypeError, ValueError) as exc:
            raise SettingError(
                f"{self.name}={raw!r} is not a valid {self.kind.__name__}: {exc}"
            ) from None


# The profiles and serve.env shipped inside the package (the checkout's config/ is a link to this dir)
SHIPPED_CONFIG = Path(__file__).resolve().parent / "config"


def default_cache_dir() -> Path:
    return Path(user_cache_dir("qse"))


_DECLARED: list[Setting] = [
    # where things live
    Setting("QSE_CACHE_DIR", Path, None, "cache root (embedded model, shadow disk tier); default: the user cache dir"),
    Setting("QSE_MODEL", str, "", "served model: a checkpoint dir or a preset name; empty: the embedded default"),
    Setting("QSE_DEVICE", str, "auto", "torch device for the engines: auto (cuda if present), cpu, cuda, cuda:N"),
    Setting("QSE_DTYPE", str, "auto", "compute dtype: auto (bf16 on cuda, fp32 on cpu), bfloat16, float32"),
    # the shadow reader
    Setting("QSE_SHADOW_MODEL", str, "embedded", "reader model: a checkpoint dir, a preset, or embedded (qse's own "
            "small model); empty: no reader (nothing of it is loaded)"),
    Setting("QSE_SHADOW_LOAD", str, "idle", "when the reader loads: idle (the first idle window after the start: the server answers at once) or start (before the server answers)"),
    Setting("QSE_DEVICE_MEMORY_GB", float, 0.0, "memory the roles' claims (weights and pools) are admitted against, GiB; 0: the GPU's free memory, or the machine's memory on a CPU"),
    Setting("QSE_GPU_MEMORY_UTILIZATION", float, 0.9, "share of the GPU's total memory qse may use, in (0, 1] (vLLM's gpu-memory-utilization): what the served model's KV pool and session cache are sized from when QSE_SERVED_KV_GB / QSE_SERVED_CACHE_GB are 0"),
    Setting("QSE_SHADOW_DIR", Path, None, "root of the shadow journal (shadow.jsonl); default: <cache>/shadow"),
    Setting("QSE_SHADOW_GB", float, 4.0, "cap on resident reader state, GiB (KV, recurrent, conv, checkpoints)"),
    Setting("QSE_SHADOW_GRID", int, 512, "rows per grid chunk: state advances only in whole chunks at k x grid"),
    Setting("QSE_SHADOW_CHECKPOINTS", int, 6, "recurrent-state checkpoints kept per session (turn prompt ends)"),
    Setting("QSE_SHADOW_DISK", str, "auto", "disk tier dir; auto: <cache>/shadow-disk; off: no disk tier"),
    Setting("QSE_SHADOW_DISK_GB", float, 64.0, "cap on the disk tier, GiB"),
    Setting("QSE_SHADOW_DISK_TTL_S", float, 48 * 3600.0, "time-to-live of a parked session file, seconds"),
    Setting("QSE_PDL", bool, True, "launch qse's Triton kernels with programmatic dependent launch on sm90+ GPUs, each overlapping the end of the one before (off: a CUDA older than 12.3, whose graphs cannot hold such launches)"),
    Setting("QSE_KERNELS", str, "auto", "op set of the engines: naive (torch twins), triton (qse_kernels), invariant (qse_kernels and GEMM: states equal across grids), auto (triton on cuda)"),
    Setting("QSE_SHADOW_RECENT_CHECKPOINTS", int, 4, "also keep the state at the newest N grid lines read (19.5 MB each on the 0.8B)"),
    Setting("QSE_SERVED_CHECKPOINT_LADDER", int, 8192, "the served sessions' checkpoints also at this many rows times a power of two (8k, 16k, 32k, ...: a 100k session holds 4, ~50 MB each on the 9B): a prompt rewritten below every prompt-end checkpoint (an agent's context compacted past its system prompt) goes back at worst to half of what it keeps, not to row 0; 0: none; a multiple of QSE_SERVED_GRID"),
    Setting("QSE_SHARE_HEADS", bool, True, "a session with nothing held (a first turn, the reader's first read of it) starts from another resident session's checkpoint where its ids begin as that session's do (agents of one harness share a system prompt and tools), within one tenant, the served model's and the reader's alike; the same bits as reading those ids"),
    Setting("QSE_SHADOW_DIVERGENCE_CHECKPOINTS", int, 0, "also keep the state at the lines of the newest N places a prompt re-rendered"),
    Setting("QSE_SHADOW_GRAPHS", bool, True, "capture grid chunks as CUDA graphs on cuda devices"),
    Setting("QSE_SHADOW_CHUNK_GROUP", int, 16, "grid chunks a bulk read (read_all: shadow-check, fresh prefills) launches together on the graph path, one chunk's later layers beside the next one's earlier layers (1: one chunk a launch)"),
    Setting("QSE_SHADOW_IDLE_GROUP", int, 1, "grid chunks one launch may read in the idle window (chunk groups, ~15 % less device time a chunk; an arriving request then waits for at most one group instead of one chunk); 1: one chunk a launch"),
    Setting("QSE_SHADOW_LOOKAHEAD", int, 1, "grid chunks the reader launches ahead of the one it reads back (0: one at a time; 1 hides the host's launch)"),
    Setting("QSE_SHADOW_LAUNCH_LEAD_MS", float, 1.0, "in the idle window, launch the next chunk only this long before the one in flight should end (an arriving request waits at most one chunk and this)"),
    Setting("QSE_SERVED_GRAPHS", bool, True, "decode the served model under a CUDA graph on cuda devices with triton kernels"),
    Setting("QSE_SERVED_KV_GB", float, 0.0, "the served model's paged KV pool (its sessions' KV pages and a turn's rows), GiB; 0: auto, sized at start on a GPU from QSE_GPU_MEMORY_UTILIZATION of its memory less what is in use, the weights, the reader's claim, the decode slots and the activations (60 % of what is left; 8 on a CPU)"),
    Setting("QSE_SERVED_CACHE_GB", float, 0.0, "cap on resident served-session state, GiB (KV, GDN state, checkpoints); past it the least recently fed go to the host tier; 0: auto, sized with QSE_SERVED_KV_GB (the other 40 %; 6 on a CPU)"),
    Setting("QSE_SERVED_CHUNK_GROUP", int, 1, "grid chunks of one prompt a launch may read together on the graph path (a power of two; the same bits as one at a time): one chunk's later layers run beside the next one's earlier layers, so a prompt is read faster where one chunk leaves the device part idle (1: one chunk a launch)"),
    Setting("QSE_SERVED_GRID", int, 512, "rows per grid chunk of the served sessions: a turn reuses state up to the last line below the common prefix"),
    Setting("QSE_HOST_CACHE_GB", float, 8.0, "pinned host memory for sessions moved off the device (served and reader, each its own), GiB; past it the oldest go to disk; 0: no host tier"),
    Setting("QSE_GC_FREEZE", bool, True, "move what exists at start out of Python's collector (no 80 ms full collections mid-turn)"),
    # the conductor
    Setting("QSE_SHADOW_RATION", float, 0.02, "reader share of the served model's time from QSE_SHADOW_RATION_AFTER_S past its first token"),
    Setting("QSE_SHADOW_BUSY_SHARE", float, 0.0, "the reader's share of all of the served model's device time (every turn's prefill and decode), spent between two rounds, a shortest slice at a time, on the session with no open turn that the reader's order puts first (under many agents each turn is too short for its own ration and the idle window seldom opens); the turns' rations count against it. 0 (off): on the H200 with 8 agents it cost every decoder about 2 % for no steady gain in freshness (benchmarks/NOTES.md)"),
    Setting("QSE_SHADOW_RATION_AFTER_S", float, 5.0, "the reader's share counts from this many seconds after the first token (a short turn's decode loses nothing; the narrator's is not delayed)"),
    Setting("QSE_SHADOW_SLICE_MS", float, 150.0, "longest reader slice between two decode rounds, ms"),
    Setting("QSE_SHADOW_MIN_SLICE_MS", float, 10.0, "a reader slice opens once this much is earned, ms (each slice costs the decode a fixed host overhead; at most QSE_SHADOW_SLICE_MS)"),
    Setting("QSE_SHADOW_IDLE_POLL_S", float, 0.2, "how often the idle window looks for work, seconds"),
    Setting("QSE_SHADOW_IDLE_BURST_S", float, 2.0, "longest idle-window read burst, seconds"),
    Setting("QSE_SHADOW_READ_ORDER", str, "shortest", "which session the reader reads next, in the idle window and the busy share: shortest (the fewest unread chunks first, a backlog waiting 10 s first of all: the most sessions fresh at every moment) or oldest (the oldest unread chunk first, the order before 2026-12-04)"),
    Setting("QSE_SHADOW_IDLE_WAKE", bool, True, "the idle window looks the moment the served model's last turn ends, not at its next poll (under many agents the gaps between their turns are short: a poll of 0.2 s lost half a poll of each); off: on its poll only"),
    Setting("QSE_SHADOW_CHUNK_PRIOR_MS", float, 50.0, "reader chunk cost assumed before the first measurement, ms"),
    Setting("QSE_NARRATOR_SHARE", float, 0.03, "narrator share of the served model's time since its first token"),
    # the server
    Setting("QSE_HOST", str, "127.0.0.1", "address the server binds"),
    Setting("QSE_PORT", int, 8000, "port the server binds"),
    Setting("QSE_ROOT_PATH", str, "", "ASGI root path when served under a prefix behind a proxy"),
    Setting("QSE_FORWARDED_ALLOW_IPS", str, "127.0.0.1", "proxies whose X-Forwarded-For/-Proto are trusted (comma list, * for any)"),
    Setting("QSE_API_KEY", str, "", "if set, every route but /health and /healthz needs 'Authorization: Bearer <key>' (one tenant)", secret=True),
    Setting("QSE_API_KEYS_FILE", Path, None, "tenants' keys, one 'TENANT KEY' a line: a session belongs to its tenant; tenant admin sees all (instead of QSE_API_KEY)"),
    Setting("QSE_METRICS_PUBLIC", bool, False, "serve /metrics without an API key"),
    Setting("QSE_ALLOWED_ORIGINS", str, "", "origins a browser may call the API from (CORS): a comma list of scheme://host[:port], * for any; empty: no CORS headers"),
    Setting("QSE_SSE_KEEPALIVE_S", float, 15.0, "a stream idle this long (a long prompt read, a wait for a slot) gets an SSE comment line, so that proxies do not cut it, seconds; 0: none"),
    Setting("QSE_MAX_RUNNING", int, 8, "turns the served model decodes together, one batched round a token (decode slots; the server admits this many)"),
    Setting("QSE_ROUND_TOKEN_BUDGET", int, 2048, "prompt ids a decode round may read beside its decode rows, in whole served grid chunks (at least one a round): a long prompt is read a few chunks a round while the running turns go on decoding"),
    Setting("QSE_DECODE_YIELD_MS", float, 0.0, "running turns may sit out rounds that read waiting prompts while each decoded less than this long ago, ms (0: every round decodes them, the lowest inter-token latency; more: under a burst of prompts the first tokens come sooner, and a running turn's next id waits up to this plus one round)"),
    Setting("QSE_FIRST_TOKEN_EARLY", bool, True, "a turn's first token goes to its client as soon as its prompt's tail is read, not when the round that read it ends (the other prompts' pieces after it in that round, and the ids of the round launched ahead, come back later)"),
    Setting("QSE_ROUND_CUT", bool, True, "a round stops reading prompt pieces where a turn that joined the queue meanwhile would open and goes first (shortest prompt first): a short follow-up waits for the piece in flight, not for the rest of the round"),
    Setting("QSE_LAUNCH_AHEAD", bool, True, "launch a decode round before reading the last one's ids back where every running turn samples on the device (greedy, temperature, penalties, a grammar: its mask is built while the next forward runs; not logprobs): one executor hop a round, a stop id seen one round late"),
    Setting("QSE_SPECULATE", str, "off", "speculative decoding of the served model: off; ngram (each running turn's drafts looked up in its own prompt and output, and in the request's OpenAI `prediction`); or mtp (drafts from the checkpoint's MTP head on the device after every round, its rows of each prompt read beside the prompt's; a model without one is refused at start; the request's `prediction` is not used; KV pages hold one more slot, the head's rows, so the same QSE_SERVED_KV_GB holds fewer rows; prompt chunks are read one a launch); greedy turns emit the ids plain decoding would, sampled ones the same law (rejection sampling); a round verifies only where the measured costs say it pays"),
    Setting("QSE_SPEC_DRAFT", int, 3, "the most drafted ids a turn verifies in a round (speculative decoding): a verify reads this + 1 rows a turn"),
    Setting("QSE_MAX_WAITING", int, 64, "requests that may wait for the served model; past that, 429 with Retry-After"),
    Setting("QSE_STOP_GRACE_S", float, 30.0, "on SIGTERM, how long requests in flight may run on before they end with a 503"),
    Setting("QSE_MAX_BODY_BYTES", int, 8 * 1024 * 1024, "largest request body accepted, bytes"),
    Setting("QSE_MAX_PROMPT_TOKENS", int, 262144, "largest prompt accepted, tokens"),
    Setting("QSE_TOKEN_CACHE_MB", int, 256, "memory for the encoded stretches of text between special tokens (a resent conversation's earlier messages are looked up, not encoded again: the same ids); 0: encode every prompt whole"),
    Setting("QSE_MAX_OUTPUT_TOKENS", int, 8192, "largest max_tokens accepted"),
    Setting("QSE_MAX_QUESTION_TOKENS", int, 4096, "largest shadow question accepted, tokens"),
    Setting("QSE_PROFILE", str, "default", "profile name (config/profiles/<name>.yaml) or a path to one"),
    Setting("QSE_LEDGER", Path, None, "usage ledger (JSONL) the server appends to; default: <cache>/usage.jsonl"),
    Setting("QSE_LOG_LEVEL", str, "info", "log level of the structlog JSON events"),
]

REGISTRY: dict[str, Setting] = {s.name: s for s in _DECLARED}


class EngineSettings:
    """Typed reads of the registry over one mapping (the process environment by default)."""

    def __init__(self, env: Mapping[str, str] | None = None, prefix: str = "QSE_",
                 decided: Mapping[str, Any] | None = None):
        """decided: values by name, already typed, that stand in for what `env` says (with_decided)."""
        self._env = env
        self._prefix = prefix
        self._decided = dict(decided or {})

    def with_decided(self, values: Mapping[str, Any]) -> "EngineSettings":
        """These settings with `values` (by name, typed) in place of the switches': what an entry point decided at
        start (qse serve's auto-sized served memory) reaching every reader of the settings it hands on."""
        unknown = sorted(set(values) - set(REGISTRY))
        if unknown:
            raise SettingError(f"unknown setting {unknown[0]!r}; `qse settings` lists the known ones")
        return EngineSettings(self._env, self._prefix, {**self._decided, **values})

    def _lookup(self, name: str) -> str | None:
        env = os.environ if self._env is None else self._env
        key = self._prefix + name[len("QSE_"):]
        return env.get(key)

    def get(self, name: str) -> Any:
        setting = REGISTRY.get(name)
        if setting is None:
            raise SettingError(f"unknown setting {name!r}; `qse settings` lists the known ones")
        if name in self._decided:
            return self._decided[name]
        raw = self._lookup(name)
        if raw is None or raw == "":
            return setting.default if raw is None or setting.kind is not str else ""
        return setting.parse(raw)

    def cache_dir(self) -> Path:
        path = self.get("QSE_CACHE_DIR")
        return path if path is not None else default_cache_dir()

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for s in _DECLARED:
            value = self.get(s.name)
            shown = None if value is None else str(value)
            if s.secret and shown is not None:
                shown = "(set)" if shown else ""
            rows.append({
                "name": s.name,
                "type": s.kind.__name__,
                "default": None if s.default is None else str(s.default),
                "value": shown,
                "doc": s.doc,
            })
        return rows


SETTINGS = EngineSettings()


def load_env_file(path: Path) -> dict[str, str]:
    """Read a serve.env file and check every key is declared and every value parses.

    The syntax is python-dotenv's (the one of docker's --env-file and systemd's EnvironmentFile, mostly):
    KEY=VALUE lines, `export KEY=VALUE`, single quotes (literal) or double quotes (with escapes), # comments
    on their own lines or after a value. Values are taken as written: no ${VAR} expansion."""
    from dotenv.parser import parse_stream

    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for binding in parse_stream(f):
            where, line = f"{path}:{binding.original.line}", binding.original.string.strip()
            if binding.error or (binding.key is not None and binding.value is None):
                raise SettingError(f"{where}: expected KEY=VALUE (or export KEY=VALUE), got {line!r}")
            if binding.key is None:  # a comment or a blank line
                continue
            if binding.key not in REGISTRY:
                raise SettingError(f"{where}: unknown setting {binding.key!r}; `qse settings` lists the known ones")
            try:  # fail now, naming the line and the value, rather than at first read
                REGISTRY[binding.key].parse(binding.value)
            except SettingError as exc:
                raise SettingError(f"{where}: {exc}") from None
            values[binding.key] = binding.value
    return values
