"""The usage ledger: one JSON line per served request, the input of the replay.

    {"session": "s1", "arrival_s": 0.0, "first_token_s": 1.2, "end_s": 9.6, "prompt_tokens": 16350,
     "shared_prefix_tokens": 0, "output_tokens": 346, "model": "qwen3.5-27b"}

Times are seconds on one clock per file (any origin); `shared_prefix_tokens` counts the prompt's ids
that equal the start of the same session's previous prompt (0 for a session's first request).
`first_token_s` may be null for a request that produced no token: it reads as `end_s`. Fields this
module does not know (a server may write more: request id, measured ms) are ignored on reading. The
server appends one record per request (`append_usage`); the converters in `traces.py` write the same
format from public traces. A converted file may have a sidecar `<file>.meta.json` that states how
timings were modelled; `read_meta` returns it (or None).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import msgspec


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    session: str
    arrival_s: float
    first_token_s: float | None
    end_s: float
    prompt_tokens: int
    shared_prefix_tokens: int
    output_tokens: int
    model: str = ""
    cached_tokens: int = 0  # prompt ids whose served state the cache reused (0: read cold, or a trace)

    def problem(self) -> str | None:
        """What is inconsistent in this record, or None."""
        if self.first_token_s is None:
            return "first_token_s is null (read_usage fills it with end_s)"
        if not (self.arrival_s <= self.first_token_s <= self.end_s):
            return (f"times out of order: arrival_s {self.arrival_s} <= first_token_s {self.first_token_s}"
                    f" <= end_s {self.end_s} does not hold")
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            return f"negative token count (prompt {self.prompt_tokens}, output {self.output_tokens})"
        if not (0 <= self.shared_prefix_tokens <= self.prompt_tokens):
            return f"shared_prefix_tokens {self.shared_prefix_tokens} not in [0, prompt_tokens {self.prompt_tokens}]"
        if not (0 <= self.cached_tokens <= self.prompt_tokens):
            return f"cached_tokens {self.cached_tokens} not in [0, prompt_tokens {self.prompt_tokens}]"
        return None


class UsageError(ValueError):
    """A usage ledger line that cannot be read."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(UsageRecord)


def encode_record(record: UsageRecord) -> bytes:
    return _encoder.encode(record) + b"\n"


def write_usage(path: Path | str, records: Iterable[UsageRecord], meta: dict | None = None) -> int:
    """Write `records` as JSONL (and `meta` as the sidecar, if given); returns the number written."""
    path = Path(path)
    n = 0
    with path.open("wb") as f:
        for record in records:
            f.write(encode_record(record))
            n += 1
    if meta is not None:
        meta_path(path).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return n


def append_usage(path: Path | str, record: UsageRecord) -> None:
    """Append one record (the server, once per request)."""
    with Path(path).open("ab") as f:
        f.write(encode_record(record))


def iter_usage(path: Path | str):
    """Records of a usage ledger, checked one by one; a bad line raises UsageError naming it."""
    path = Path(path)
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = _decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise UsageError(f"{path}:{lineno}: not a usage record ({exc}); see qse/replay/usage.py") from None
            if record.first_token_s is None:
                record = msgspec.structs.replace(record, first_token_s=record.end_s)
            problem = record.problem()
            if problem is not None:
                raise UsageError(f"{path}:{lineno}: {problem}")
            yield record


def read_usage(path: Path | str) -> list[UsageRecord]:
    return list(iter_usage(path))


def meta_path(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".meta.json")


def read_meta(path: Path | str) -> dict | None:
    p = meta_path(path)
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def sessions_of(records: Iterable[UsageRecord]) -> dict[str, list[UsageRecord]]:
    """Records grouped by session, each session in arrival order (stable for equal arrivals)."""
    out: dict[str, list[UsageRecord]] = {}
    for record in records:
        out.setdefault(record.session, []).append(record)
    for session in out.values():
        session.sort(key=lambda r: r.arrival_s)
    return out
