"""Converters from public traces to the usage ledger (`usage.py`).

Each converter returns a `Converted`: the records and a `meta` dict that states every assumption the
conversion made (written beside the ledger as `<file>.meta.json` and carried into the replay's
report). Where a trace has no decode timing, the served model's timing is modelled from two rates
(`Rates`): prefill of the prompt's new ids at `prefill_tok_s`, then decode at `decode_tok_s`. The
defaults are the seed's served model on its GB10 (Qwen3.8-27B: a 16,350-token prompt's first token
after 17.46 s, 936 tok/s; decode 36 tok/s), the same machine as the default read model.

Formats (their headers are described in ../shared/data/README.md):
  weka      weka_cc_sessions_dev.csv: coding-agent sessions; a session is (trace_id, agent)
  mooncake  mooncake_conversation_inferred_chains.csv: chat requests, a session follows parent_idx
  azure     AzureLLMInferenceTrace_*.csv: no sessions, each request its own
  tracelab  TraceLab sanitized round traces (JSONL with millisecond event times)
  ledger    already the usage ledger (the server's own)
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from qse.replay.usage import UsageRecord, read_meta, read_usage

FORMATS = ("weka", "mooncake", "azure", "tracelab", "ledger")


@dataclass(frozen=True)
class Rates:
    """The served model's modelled speed, where a trace does not say."""

    decode_tok_s: float = 36.0
    prefill_tok_s: float = 936.0

    def __post_init__(self) -> None:
        if not (self.decode_tok_s > 0 and self.prefill_tok_s > 0):
            raise ValueError(f"rates must be positive tok/s, got decode {self.decode_tok_s}, prefill {self.prefill_tok_s}")

    def prefill_s(self, new_tokens: int) -> float:
        return max(0, new_tokens) / self.prefill_tok_s

    def decode_s(self, output_tokens: int) -> float:
        return max(0, output_tokens) / self.decode_tok_s


@dataclass
class Converted:
    records: list[UsageRecord]
    meta: dict


class TraceError(ValueError):
    """A trace file this module cannot read as the format asked."""


def _modelled(session: str, arrival_s: float, prompt: int, shared: int, output: int, model: str,
              rates: Rates) -> UsageRecord:
    first_token_s = arrival_s + rates.prefill_s(prompt - shared)
    return UsageRecord(session=session, arrival_s=arrival_s, first_token_s=first_token_s,
                       end_s=first_token_s + rates.decode_s(output), prompt_tokens=prompt,
                       shared_prefix_tokens=shared, output_tokens=output, model=model)


def _rates_meta(rates: Rates) -> dict:
    return {"rates": asdict(rates),
            "rates_source": "seed 000: Qwen3.8-27B on GB10, 16,350-token prompt in 17.46 s, decode 36 tok/s"}


def _read_csv(path: Path, need: tuple[str, ...]) -> list[dict[str, str]]:
    """All rows of a CSV trace, after checking its header names the columns a converter needs."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing columns {missing}; header is {reader.fieldnames}")
        return list(reader)


# -- weka: coding-agent sessions -----------------------------------------------------------------

WEKA_LCP_BLOCK = 64  # lcp_prev_tokens is counted in whole 64-token blocks


def from_weka(path: Path | str, rates: Rates = Rates(), max_sessions: int | None = None) -> Converted:
    """Coding-agent sessions: arrival is t_s; with api_time_s the request ends at t_s + api_time_s and its
    decode is the last output/decode_tok_s of that (all of it if shorter); without, both are modelled."""
    path = Path(path)
    rows_in = _read_csv(path, ("trace_id", "agent", "idx", "t_s", "model", "in", "out", "api_time_s", "lcp_prev_tokens"))
    sessions: dict[str, list[dict]] = {}
    for row in rows_in:
        sid = f"{row['trace_id']}/{row['agent']}"
        if sid not in sessions and max_sessions is not None and len(sessions) >= max_sessions:
            continue
        sessions.setdefault(sid, []).append(row)
    records: list[UsageRecord] = []
    n_modelled = n_full_prefix = 0
    for sid, rows in sessions.items():
        rows.sort(key=lambda r: int(r["idx"]))
        prev_prompt: int | None = None
        for row in rows:
            prompt, output = int(row["in"]), int(row["out"])
            arrival_s = float(row["t_s"])
            shared = 0
            if prev_prompt is not None:
                lcp = int(row["lcp_prev_tokens"] or 0)
                if lcp >= (prev_prompt // WEKA_LCP_BLOCK) * WEKA_LCP_BLOCK and prompt >= prev_prompt:
                    shared = prev_prompt  # covers the previous prompt up to its last partial block
                    n_full_prefix += 1
                else:
                    shared = lcp
                shared = min(shared, prompt)
            if row["api_time_s"]:
                end_s = arrival_s + float(row["api_time_s"])
                first_token_s = max(arrival_s, end_s - rates.decode_s(output))
                records.append(UsageRecord(session=sid, arrival_s=arrival_s, first_token_s=first_token_s, end_s=end_s,
                                           prompt_tokens=prompt, shared_prefix_tokens=shared, output_tokens=output,
                                           model=row["model"]))
            else:
                records.append(_modelled(sid, arrival_s, prompt, shared, output, row["model"], rates))
                n_modelled += 1
            prev_prompt = prompt
    meta = {
        "format": "weka", "source": str(path), "num_sessions": len(sessions), "num_records": len(records),
        "session": "trace_id/agent (a sub-agent keeps its own context, so its own reader session)",
        "timing": ("arrival = t_s (whole seconds); end = t_s + api_time_s; first token = end - output/decode_tok_s "
                   "(at arrival if the decode would be longer than api_time_s); rows without api_time_s: "
                   "prefill of (in - shared) at prefill_tok_s, decode at decode_tok_s"),
        "shared_prefix": ("lcp_prev_tokens, in 64-token blocks; when it covers the previous prompt up to its last "
                          "partial block (and the prompt did not shrink), the whole previous prompt is taken as shared"),
        "num_modelled_timing": n_modelled, "num_full_prefix": n_full_prefix, **_rates_meta(rates),
    }
    return Converted(records, meta)


# -- mooncake: chat requests with inferred chains ------------------------------------------------

MOONCAKE_BLOCK = 512


def _mooncake_hashes(path: Path) -> list[list[int]] | None:
    if not path.is_file():
        return None
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def from_mooncake(path: Path | str, rates: Rates = Rates(), max_sessions: int | None = None,
                  hashes_path: Path | str | None = None) -> Converted:
    """Chat requests: a session is a root request and every request that follows it by parent_idx.

    The shared prefix with the session's previous prompt is counted in 512-token blocks (from the
    raw trace's hash_ids when that file sits beside the chains, else from shared_prefix_blocks when
    the previous request is the parent); when every full block of the previous prompt is shared, the
    whole previous prompt is taken as shared (the README: a child is its parent plus its output plus
    about 28 ids). Timing is modelled; a request that would arrive before the session's previous one
    ends is moved to that end (timestamps are rounded to about 3 s)."""
    path = Path(path)
    rows_in = _read_csv(path, ("idx", "timestamp_ms", "input_length", "output_length", "parent_idx", "shared_prefix_blocks"))
    if hashes_path is None:
        hashes_path = path.with_name("mooncake_conversation_trace.jsonl")
    hashes = _mooncake_hashes(Path(hashes_path))
    root: dict[int, int] = {}
    rows: dict[int, dict] = {}
    sessions: dict[int, list[int]] = {}
    for row in rows_in:
        idx, parent = int(row["idx"]), int(row["parent_idx"])
        r = root.get(parent, idx) if parent >= 0 else idx
        if r not in sessions:
            if max_sessions is not None and len(sessions) >= max_sessions:
                continue
            sessions[r] = []
        root[idx] = r
        rows[idx] = row
        sessions[r].append(idx)
    records: list[UsageRecord] = []
    n_moved = n_full_prefix = n_branch = 0
    for r, members in sessions.items():
        members.sort(key=lambda i: (int(rows[i]["timestamp_ms"]), i))
        prev: int | None = None
        prev_end = float("-inf")
        for idx in members:
            row = rows[idx]
            prompt, output = int(row["input_length"]), int(row["output_length"])
            shared = 0
            if prev is not None:
                prev_prompt = int(rows[prev]["input_length"])
                if hashes is not None and idx < len(hashes) and prev < len(hashes):
                    blocks = _common_blocks(hashes[prev], hashes[idx])
                elif int(row["parent_idx"]) == prev:
                    blocks = int(row["shared_prefix_blocks"])
                else:
                    blocks = 0
                if int(row["parent_idx"]) != prev:
                    n_branch += 1
                if blocks >= prev_prompt // MOONCAKE_BLOCK and prompt >= prev_prompt:
                    shared = prev_prompt
                    n_full_prefix += 1
                else:
                    shared = min(prompt, blocks * MOONCAKE_BLOCK)
            arrival_s = int(row["timestamp_ms"]) / 1000
            if arrival_s < prev_end:
                arrival_s = prev_end
                n_moved += 1
            record = _modelled(f"mooncake/{r}", arrival_s, prompt, shared, output, "", rates)
            records.append(record)
            prev, prev_end = idx, record.end_s
    records.sort(key=lambda rec: (rec.arrival_s, rec.session))
    meta = {
        "format": "mooncake", "source": str(path), "num_sessions": len(sessions), "num_records": len(records),
        "session": "a root request (parent_idx -1) and every request that follows it by parent_idx",
        "timing": "modelled: prefill of (prompt - shared) at prefill_tok_s, then decode at decode_tok_s",
        "shared_prefix": ("512-token blocks common with the session's previous prompt ("
                          + ("hash_ids of " + str(hashes_path) if hashes is not None else "shared_prefix_blocks")
                          + "); all full blocks shared: the whole previous prompt"),
        "num_arrivals_moved_to_previous_end": n_moved, "num_full_prefix": n_full_prefix,
        "num_branches": n_branch, **_rates_meta(rates),
    }
    return Converted(records, meta)


# -- azure: no sessions ---------------------------------------------------------------------------

def _azure_seconds(stamp: str) -> float:
    whole, _, frac = stamp.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def from_azure(path: Path | str, rates: Rates = Rates(), max_sessions: int | None = None) -> Converted:
    """Requests without sessions: each is its own session, its timing modelled."""
    path = Path(path)
    rows_in = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    records: list[UsageRecord] = []
    origin: float | None = None
    for i, row in enumerate(rows_in):
        if max_sessions is not None and i >= max_sessions:
            break
        t = _azure_seconds(row["TIMESTAMP"])
        origin = t if origin is None else origin
        records.append(_modelled(f"azure/{i}", round(t - origin, 7), int(row["ContextTokens"]), 0,
                                 int(row["GeneratedTokens"]), "", rates))
    meta = {"format": "azure", "source": str(path), "num_sessions": len(records), "num_records": len(records),
            "session": "each request its own (the trace has no sessions)",
            "timing": "modelled: prefill of the whole context at prefill_tok_s, then decode at decode_tok_s",
            **_rates_meta(rates)}
    return Converted(records, meta)


# -- tracelab: round traces with event times -----------------------------------------------------

_INPUT_EVENTS = ("user_message", "tool_result")


def _iso_s(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def from_tracelab(path: Path | str, rates: Rates = Rates(), max_sessions: int | None = None) -> Converted:
    """Round traces: arrival is the round's last input event (user message or tool result) before its
    first output event, the first token is that output event, the end is the round's last event."""
    path = Path(path)
    rounds = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    origin = min((_iso_s(e["timestamp"]) for r in rounds for e in r.get("timing_events", [])), default=0.0)
    records: list[UsageRecord] = []
    seen: dict[str, int] = {}
    for r in sorted(rounds, key=lambda r: (r["session_id"], r["round_index"])):
        sid = r["session_id"]
        if sid not in seen and max_sessions is not None and len(seen) >= max_sessions:
            continue
        events = sorted(((_iso_s(e["timestamp"]) - origin, e["event_type"]) for e in r.get("timing_events", [])))
        if not events:
            raise TraceError(f"{path}: round {r.get('round_id')} has no timing_events")
        outputs = [t for t, kind in events if kind not in _INPUT_EVENTS]
        first_token_s = outputs[0] if outputs else events[-1][0]
        inputs = [t for t, kind in events if kind in _INPUT_EVENTS and t <= first_token_s]
        arrival_s = inputs[-1] if inputs else events[0][0]
        end_s = max(first_token_s, events[-1][0])
        prompt = int(r["input_tokens_total"])
        shared = min(prompt, int(r.get("prefix_tokens") or 0)) if sid in seen else 0
        records.append(UsageRecord(session=sid, arrival_s=round(arrival_s, 3), first_token_s=round(first_token_s, 3),
                                   end_s=round(end_s, 3), prompt_tokens=prompt, shared_prefix_tokens=shared,
                                   output_tokens=int(r.get("output_tokens") or 0), model=r.get("model", "")))
        seen[sid] = seen.get(sid, 0) + 1
    meta = {"format": "tracelab", "source": str(path), "num_sessions": len(seen), "num_records": len(records),
            "timing": ("from the events: arrival = last user_message/tool_result before the first output event, "
                       "first token = first output event, end = last event"),
            "shared_prefix": "prefix_tokens (the provider's cache read) after a session's first round"}
    return Converted(records, meta)


def from_ledger(path: Path | str, rates: Rates = Rates(), max_sessions: int | None = None) -> Converted:
    records = read_usage(path)
    if max_sessions is not None:
        keep: set[str] = set()
        for rec in records:
            if len(keep) < max_sessions:
                keep.add(rec.session)
        records = [rec for rec in records if rec.session in keep]
    meta = read_meta(path) or {"format": "ledger", "source": str(path), "timing": "measured (the server's own ledger)"}
    return Converted(records, meta)


CONVERTERS: dict[str, Callable[..., Converted]] = {
    "weka": from_weka, "mooncake": from_mooncake, "azure": from_azure, "tracelab": from_tracelab, "ledger": from_ledger,
}


def detect_format(path: Path | str) -> str:
    """The format of a trace from its first line; TraceError when none fits."""
    path = Path(path)
    with path.open() as f:
        first = f.readline().strip()
    if first.startswith("trace_id,agent,"):
        return "weka"
    if first.startswith("idx,timestamp_ms,") and "parent_idx" in first:
        return "mooncake"
    if first.startswith("TIMESTAMP,ContextTokens,GeneratedTokens"):
        return "azure"
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            obj = {}
        if "session" in obj and "arrival_s" in obj:
            return "ledger"
        if "round_index" in obj and "timing_events" in obj:
            return "tracelab"
        if "hash_ids" in obj:
            raise TraceError(f"{path}: a raw Mooncake trace has no sessions; use the inferred chains "
                             "(mooncake_conversation_inferred_chains.csv) with --format mooncake")
    raise TraceError(f"{path}: unknown trace format (first line {first[:80]!r}); pass --format one of {FORMATS}")


def convert(path: Path | str, fmt: str = "auto", rates: Rates = Rates(), max_sessions: int | None = None) -> Converted:
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in CONVERTERS:
        raise TraceError(f"unknown format {fmt!r}; one of {FORMATS}")
    return CONVERTERS[fmt](path, rates=rates, max_sessions=max_sessions)
