#!/usr/bin/env python
"""Many coding agents at once through `qse serve`, over HTTP, with the official openai client.

    python benchmarks/agents_live.py --serve --model qwen3.5-9b --shadow-model qwen3.5-0.8b --agents 8 --out DIR [--ab]
    python benchmarks/agents_live.py --url http://127.0.0.1:8000 --agents 8 --out DIR     (a server already up)
    python benchmarks/agents_live.py --tiny --out DIR          (the embedded model on CPU, shapes scaled down)

Each agent is one main-agent session of the weka coding-agent trace (its dev half), as the replay reads it
(qse/replay/traces.py: from_weka): each turn's prompt length, the ids it shares with the previous prompt, its
output length, and the think time before it (the trace's gap between the previous turn's end and this turn's
arrival, capped at --think-cap-s). The ids are random (the random-weight presets do not care what the text
says); a turn's prompt is the previous prompt's first `shared` ids and then new ones, sent as token ids to
/v1/completions with the agent's X-Session-Id, streamed, greedy. Agents arrive --arrival-gap-s apart.

Three phases, in one run against one server:
  solo    one agent alone, every turn: what a follow-up costs with nobody else on the device
  agents  N agents at once (other sessions than solo's: nothing is cached from it)
  cold    the agents' follow-up prompt lengths read cold one at a time (new sessions, new ids, 1 output id):
          the cold baseline the cached follow-ups are held against

Per phase: first-turn and follow-up TTFT (p50 / p90 / max, on the client, from the request's send to its first
streamed text), the first-turn TTFT of the agent whose first token came last, the cached share of follow-up prompts (the
usage's cached_tokens), output and prompt tokens/s, and, from the server's /metrics over the phase: the reader's
freshness at follow-up turn starts, the decode loss (the reader's ration wall over the served decode wall) and the
reader's device share. The server's sizing of its pools (no memory switch set) is recorded from its status.
With --ab the agents run again on a fresh server without the reader, and the decode loss is also the A/B of the
two: the time a decoded id took (every turn's decode wall over its ids after the first), on against off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.stats import nearest_rank  # noqa: E402
from qse.replay.traces import from_weka  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "weka_cc_sessions_dev.csv"
ID_RANGE = 150_000  # random prompt ids below every special token of the Qwen3.5 vocabulary


# ---- the agents' plans, from the trace ------------------------------------------------------------------------

@dataclass(frozen=True)
class TurnShape:
    prompt_tokens: int
    shared_tokens: int  # the first ids it shares with the previous prompt (0 for the first turn)
    output_tokens: int
    think_s: float  # the wait before it is sent, after the previous turn ended (0 for the first)


def agent_shapes(trace: Path, agents: int, max_turns: int, max_prompt_tokens: int, think_cap_s: float,
                 out_cap: int, scale: float = 1.0, skip: int = 0) -> list[tuple[str, list[TurnShape]]]:
    """The first `agents` main-agent sessions (after `skip`, in the trace's order) whose first prompt fits
    max_prompt_tokens and that have a follow-up; each cut at max_turns or at its first prompt over the limit.
    `scale` shrinks every length (a CPU run); the shared part never exceeds the previous prompt."""
    records = from_weka(trace).records
    sessions: dict[str, list] = {}
    for rec in records:
        if rec.session.endswith("/main"):
            sessions.setdefault(rec.session, []).append(rec)
    picked: list[tuple[str, list[TurnShape]]] = []
    for sid, recs in sessions.items():
        recs.sort(key=lambda r: r.arrival_s)
        turns: list[TurnShape] = []
        prev_end = prev_prompt = None
        for rec in recs[:max_turns]:
            prompt = max(2, int(rec.prompt_tokens * scale))
            if prompt > max_prompt_tokens:
                break
            shared = 0 if prev_prompt is None else min(int(rec.shared_prefix_tokens * scale), prev_prompt, prompt - 1)
            think = 0.0 if prev_end is None else min(think_cap_s, max(0.0, rec.arrival_s - prev_end))
            turns.append(TurnShape(prompt, shared, max(1, min(out_cap, int(rec.output_tokens * scale))), think))
            prev_end, prev_prompt = rec.end_s, prompt
        if len(turns) >= 2:
            picked.append((sid, turns))
    if len(picked) < skip + agents:
        raise SystemExit(f"the trace {trace} has {len(picked)} main-agent sessions whose first prompt fits "
                         f"{max_prompt_tokens} tokens; {skip + agents} asked (--skip {skip} --agents {agents})")
    return picked[skip:skip + agents]


def prompts_of(shapes: list[TurnShape], rng: random.Random, head: list[int] | tuple[int, ...] = ()) -> list[list[int]]:
    """Each turn's prompt ids: the previous prompt's shared head, then fresh random ids; with `head`, every
    prompt begins with it (agents of one harness: one system prompt and tool list), whatever the trace shares."""
    out, prev = [], []
    for s in shapes:
        ids = prev[:s.shared_tokens] + [rng.randrange(ID_RANGE) for _ in range(s.prompt_tokens - s.shared_tokens)]
        keep = min(len(head), len(ids))
        ids[:keep] = head[:keep]
        out.append(ids)
        prev = ids
    return out


# ---- one turn over HTTP -----------------------------------------------------------------------------------------

@dataclass
class TurnResult:
    agent: int
    turn: int
    session: str
    prompt_tokens: int
    new_tokens: int  # prompt ids past the shared head
    sent_s: float  # from the phase's start
    ttft_s: float | None
    end_s: float
    output_tokens: int
    cached_tokens: int
    chunk_stamps: list[float] = field(default_factory=list)  # each streamed chunk's arrival, from the phase start
    error: str | None = None
    request_id: str = ""
    client_send_s: float | None = None  # from the call to its bytes leaving the client (the client's own cost)


SENT: dict[str, float] = {}  # request id -> when the client sent it (perf_counter), from the httpx hook


async def _note_sent(request) -> None:
    rid = request.headers.get("x-request-id")
    if rid:
        SENT[rid] = time.perf_counter()


async def one_turn(client, model: str, ids: list[int], max_tokens: int, session: str, t0: float,
                   agent: int, turn: int, new_tokens: int) -> TurnResult:
    sent = time.perf_counter() - t0
    stamps: list[float] = []
    output = cached = 0
    error = None
    request_id = f"{session}-t{turn}"  # the server's log names the turn by it (server_timeline)
    try:
        # the ids go in extra_body: the client transforms a typed `prompt` list id by id on the event loop (about
        # half a second for 40k ids on the CI host, every agent's stream stalled meanwhile); extra_body is sent
        # as it is. An agent that sends text pays none of this.
        stream = await client.completions.create(
            model=model, prompt="", max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"prompt": ids},
            extra_headers={"X-Session-Id": session, "X-Request-Id": request_id})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter() - t0)
            if chunk.usage is not None:
                output = chunk.usage.completion_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    except Exception as exc:  # noqa: BLE001 - a failed turn is recorded with its error, the run goes on
        error = f"{type(exc).__name__}: {exc}"[:400]
    end = time.perf_counter() - t0
    on_wire = SENT.pop(request_id, None)
    return TurnResult(agent, turn, session, len(ids), new_tokens, round(sent, 4),
                      round(stamps[0] - sent, 4) if stamps else None, round(end, 4), output, cached,
                      [round(s, 4) for s in stamps], error, request_id,
                      None if on_wire is None else round(on_wire - t0 - sent, 4))


async def run_agent(client, model: str, agent: int, session: str, shapes: list[TurnShape],
                    prompts: list[list[int]], t0: float, start_delay_s: float) -> list[TurnResult]:
    await asyncio.sleep(start_delay_s)
    results = []
    for k, (shape, ids) in enumerate(zip(shapes, prompts)):
        if shape.think_s > 0:
            await asyncio.sleep(shape.think_s)
        results.append(await one_turn(client, model, ids, shape.output_tokens, session, t0, agent, k,
                                      shape.prompt_tokens - shape.shared_tokens))
    return results


# ---- the server's own figures -----------------------------------------------------------------------------------

def scrape(http, headers: dict) -> dict[str, float]:
    """The Prometheus text of /metrics as {series with labels: value} (counters and gauges alike)."""
    text = http.get("/metrics", headers=headers).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def _sum(metrics: dict[str, float], prefix: str, having: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.split("{")[0] == prefix and having in k)


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server counted over a phase: follow-up turn starts (fresh or not), decode loss, the reader's share
    of the served decode's device time, prefix-cache tokens."""
    def delta(prefix: str, having: str = "") -> float:
        return _sum(after, prefix, having) - _sum(before, prefix, having)

    starts = delta("qse_shadow_turn_starts_total")
    fresh = delta("qse_shadow_turn_starts_total", 'fresh="true"')
    decode_s = delta("qse_decode_seconds_total")
    ration_s = delta("qse_reader_ration_wall_seconds_total")
    roles = sorted({k.split('role="')[1].split('"')[0] for k in after if k.startswith("qse_device_ms_total{")})
    device_ms = {role: round(delta("qse_device_ms_total", f'role="{role}"'), 1) for role in roles}
    served_ms = device_ms.get("served_decode", 0.0) + device_ms.get("served_prefill", 0.0)
    queries = delta("qse_prefix_cache_queries_tokens_total")
    return {"turn_starts": int(starts), "fresh_turn_starts": int(fresh),
            "fresh_share": round(fresh / starts, 4) if starts else None,
            "decode_s": round(decode_s, 3), "reader_ration_wall_s": round(ration_s, 4),
            "decode_loss": round(ration_s / decode_s, 5) if decode_s else None,
            "device_ms": device_ms,  # by role, over the phase
            # the ration's share of all of the served model's device time (its 2 % is counted against that)
            "ration_share_of_served": round(device_ms.get("reader_ration", 0.0) / served_ms, 5) if served_ms else None,
            "prefix_cache_query_tokens": int(queries),
            "prefix_cache_hit_tokens": int(delta("qse_prefix_cache_hits_tokens_total"))}


def _log_events(log_path: Path):
    """The server log's JSON events (a .gz log too)."""
    import gzip

    opener = gzip.open if str(log_path).endswith(".gz") else open
    with opener(log_path, "rt") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def server_timeline(log_path: Path) -> dict[str, dict]:
    """Each turn's stations on the server, from its log (request id -> figures, s and ms): from the conductor's
    arrival (the prompt rendered, the session found) to the turn's open (a slot, the reader fed, the served
    state back), to its first token; and what the open found (cached rows, the tier, a rollback, the chunks read
    and the device ms of each step)."""
    out: dict[str, dict] = {}
    for ev in _log_events(log_path):
        rid = ev.get("request_id")
        if not rid:
            continue
        if ev.get("event") == "turn":
            start, first, arrival = ev.get("start_s"), ev.get("first_token_s"), ev["arrival_s"]
            out.setdefault(rid, {}).update({
                "wait_open_s": None if start is None else round(start - arrival, 4),
                "open_to_first_s": None if start is None or first is None else round(first - start, 4),
                "server_ttft_s": None if first is None else round(first - arrival, 4),
                "reader_behind_tokens": ev.get("reader_behind_tokens"), "prefill_ms": ev.get("prefill_ms"),
                "decode_tokens_per_s": round(ev.get("decode_tokens_per_s") or 0.0, 1),
                "reader_ration_wall_ms": ev.get("reader_ration_wall_ms")})
        elif ev.get("event") == "served_turn_start":
            out.setdefault(rid, {}).update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in ev.items()
                                            if k in ("tier", "rolled_back_to", "chunks_read", "tail_tokens",
                                                     "restore_ms", "evict_ms", "read_ms", "tail_ms")})
    return out


def reader_reads(log_path: Path) -> dict | None:
    """The reader's idle-window reads on the server (its reader_read events): how many, their chunks and device
    time, and the host's time around them (hop to its thread and back, before the first launch, after the last
    readback), the fixed cost a session switch pays while the device idles; None when the log has none."""
    reads = [ev for ev in _log_events(log_path) if ev.get("event") == "reader_read" and ev.get("window") == "idle"]
    if not reads:
        return None
    fixed = [r["hop_ms"] + r["setup_ms"] + r["drain_ms"] + r["back_ms"] for r in reads]
    chunks = sum(r["chunks"] for r in reads)
    device = sum(r["gpu_ms"] for r in reads)
    between = sum(r["chunks_ms"] for r in reads) - device  # the host's gaps between a read's own chunks
    return {"reads": len(reads), "chunks": chunks, "device_ms": round(device, 1),
            "fixed_ms_a_read": dist(fixed), "setup_ms": dist([r["setup_ms"] for r in reads]),
            "drain_ms": dist([r["drain_ms"] for r in reads]), "hop_ms": dist([r["hop_ms"] for r in reads]),
            "gaps_ms_a_chunk": round(between / chunks, 3) if chunks else None}


def event_counts(log_path: Path, names: tuple[str, ...] = ("round_cut", "idle_burst", "ration_slice")) -> dict:
    """How many of each named event the server logged (a round cut for a newcomer, the idle bursts, the reader's
    slices between rounds)."""
    counts = dict.fromkeys(names, 0)
    for ev in _log_events(log_path):
        if ev.get("event") in counts:
            counts[ev["event"]] += 1
    return counts


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def followup_waits(log_path: Path, session_mark: str = "-agent-") -> list[dict]:
    """Each follow-up turn's time from the conductor's arrival to its first token split by what the device did
    meanwhile, from the server's log (s): `own` its own prompt's reads (served_turn_start's read and tail ms);
    `others` the other turns' prompt reads, each turn's share of them that fell in this window taken as the
    share of its open-to-first-token span that did (its reads spread evenly over that span: an estimate);
    `reader` the reader's idle bursts inside the window; `rest` what is left (decode rounds, rations, the host,
    a slot's wait). The bursts are placed on the conductor's clock by the median offset between each turn's
    log line and its `end_s` (good to a few ms). Slowest first."""
    import datetime as _dt

    def wall(ev):
        return _dt.datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()

    turns, read_s, bursts = [], {}, []
    for ev in _log_events(log_path):
        name = ev.get("event")
        if name == "turn" and session_mark in ev.get("session_id", "") and ev.get("first_token_s") is not None:
            turns.append(ev)
        elif name == "served_turn_start":
            read_s[ev["request_id"]] = (ev.get("read_ms", 0.0) + ev.get("tail_ms", 0.0)) / 1e3
        elif name == "idle_burst":
            bursts.append(ev)
    if not turns:
        return []
    offsets = sorted(wall(t) - t["end_s"] for t in turns)
    offset = offsets[len(offsets) // 2]
    idle = [(wall(ev) - offset - ev["wall_ms"] / 1e3, wall(ev) - offset) for ev in bursts]
    spans = {t["request_id"]: (t.get("start_s") or t["arrival_s"], t["first_token_s"]) for t in turns}
    out = []
    for t in turns:
        rid = t["request_id"]
        if rid.endswith("-t0"):
            continue
        lo, hi = t["arrival_s"], t["first_token_s"]
        others = 0.0
        for r, (a, b) in spans.items():
            if r != rid and b > a and r in read_s:
                others += read_s[r] * _overlap(a, b, lo, hi) / (b - a)
        parts = {"own": read_s.get(rid, 0.0), "others": others,
                 "reader": sum(_overlap(a, b, lo, hi) for a, b in idle)}
        parts["rest"] = (hi - lo) - sum(parts.values())
        out.append({"request_id": rid, "ttft_s": round(hi - lo, 4), **{k: round(v, 4) for k, v in parts.items()}})
    return sorted(out, key=lambda r: -r["ttft_s"])


def waits_summary(waits: list[dict], q: float = 0.9) -> dict:
    """The follow-ups at or above the q-quantile of TTFT (the p90's), their waits summed by cause (s)."""
    if not waits:
        return {}
    top = waits[:max(1, len(waits) - int(round(q * (len(waits) - 1))))]
    return {"turns": len(top), "ttft_s": round(sum(w["ttft_s"] for w in top), 3),
            **{k: round(sum(w[k] for w in top), 3) for k in ("own", "others", "reader", "rest")},
            "slowest": top}


def timeline_summary(turns: list[dict]) -> dict:
    """Where the follow-ups' TTFT went, p50 / p90 of each station (s): the client's send to the conductor's
    arrival (HTTP, render, session), waiting to open, open to the first token."""
    follow = [t for t in turns if t["turn"] > 0 and t.get("server_ttft_s") is not None and t["ttft_s"] is not None]
    stations = {"before_conductor_s": [t["ttft_s"] - t["server_ttft_s"] for t in follow],
                "wait_open_s": [t["wait_open_s"] for t in follow if t.get("wait_open_s") is not None],
                "open_to_first_s": [t["open_to_first_s"] for t in follow if t.get("open_to_first_s") is not None]}
    return {k: {q: (round(v, 4) if v is not None else None) for q, v in dist(vals).items()}
            for k, vals in stations.items()}


# ---- summaries --------------------------------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float | None:
    return nearest_rank(sorted(values), q) if values else None


def dist(values: list[float]) -> dict:
    return {"n": len(values), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9),
            "max": max(values) if values else None}


def decode_tpot_ms(turns: list[TurnResult]) -> float | None:
    """Every turn's decode wall (its first streamed text to its end) over the ids it decoded after the first:
    the time a decoded id took, as the decode-loss A/B compares it with the reader on and off."""
    ids = sum(max(0, r.output_tokens - 1) for r in turns)
    wall = sum(r.end_s - r.chunk_stamps[0] for r in turns if r.chunk_stamps and r.output_tokens > 1)
    return round(wall * 1e3 / ids, 4) if ids else None


def summarize(results: list[TurnResult], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    first = [r for r in ok if r.turn == 0]
    follow = [r for r in ok if r.turn > 0]
    last_agent = max(first, key=lambda r: r.sent_s) if first else None
    last_token = max(first, key=lambda r: r.sent_s + r.ttft_s) if first else None
    gaps = [b - a for r in ok for a, b in zip(r.chunk_stamps, r.chunk_stamps[1:])]
    prompt_sum = sum(r.prompt_tokens for r in follow)
    return {
        "turns": len(results), "failed": [asdict(r) for r in results if r not in ok],
        "first_ttft_s": dist([r.ttft_s for r in first]),
        "first_ttft_last_arrival_s": last_agent.ttft_s if last_agent else None,
        # the agent whose first token came last: with prefill shared equally, every first turn ends near it
        "first_ttft_last_first_token_s": last_token.ttft_s if last_token else None,
        "client_send_s": dist([r.client_send_s for r in ok if r.client_send_s is not None]),
        "followup_ttft_s": dist([r.ttft_s for r in follow]),
        "followup_cached_share": round(sum(r.cached_tokens for r in follow) / prompt_sum, 4) if prompt_sum else None,
        "followup_new_tokens": dist([r.new_tokens for r in follow]),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall_s, 2) if wall_s else None,
        "uncached_prompt_tokens_per_s": (round(sum(r.prompt_tokens - r.cached_tokens for r in ok) / wall_s, 1)
                                         if wall_s else None),
        "chunk_gap_ms": {k: (round(v * 1e3, 3) if v is not None else None) for k, v in dist(gaps).items() if k != "n"},
        "decode_tpot_ms": decode_tpot_ms(ok),
        "wall_s": round(wall_s, 3),
    }


# ---- the server process -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, out_dir: Path,
                 log_name: str = "agents_live-server.log") -> tuple[subprocess.Popen, str, Path]:
    """`qse serve` as a user starts it (no memory switch unless the environment sets one), its log under out_dir."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "qse.server", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    if args.shadow_model is not None:
        cmd += ["--shadow-model", args.shadow_model]
    if args.grid:
        cmd += ["--grid", str(args.grid)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("QSE_LOG_LEVEL", "info")
    env["QSE_SHADOW_LOAD"] = "start"  # the reader loads before the first agent: every phase sees it
    # sessions of an earlier run (their journal, disk tiers, ledger) stay out of this one
    state = Path(tempfile.mkdtemp(prefix="agents_live-"))
    env.update({"QSE_SHADOW_DIR": str(state / "shadow"), "QSE_SHADOW_DISK": str(state / "disk"),
                "QSE_LEDGER": str(state / "usage.jsonl")})
    env.update(dict(kv.split("=", 1) for kv in args.server_env))
    log_path = out_dir / log_name
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"qse serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"qse serve did not answer /healthz in {args.start_timeout_s} s:\n"
                             f"{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# ---- the run ----------------------------------------------------------------------------------------------------

async def phase(client, http, headers, model: str, plans: list[tuple[int, str, list[TurnShape], list[list[int]]]],
                gap_s: float) -> dict:
    before = scrape(http, headers)
    t0 = time.perf_counter()
    runs = [run_agent(client, model, agent, session, shapes, prompts, t0, i * gap_s)
            for i, (agent, session, shapes, prompts) in enumerate(plans)]
    results = [r for rs in await asyncio.gather(*runs) for r in rs]
    wall = time.perf_counter() - t0
    summary = summarize(results, wall)
    summary["server"] = server_figures(before, scrape(http, headers))
    summary["turns_detail"] = [{k: v for k, v in asdict(r).items() if k != "chunk_stamps"} for r in results]
    return summary


async def cold_phase(client, http, headers, model: str, lengths: list[int], rng: random.Random, tag: str) -> dict:
    """Prompts of the given lengths read cold, one at a time, each in a new session, one output id."""
    before = scrape(http, headers)
    t0 = time.perf_counter()
    results = []
    for k, n in enumerate(lengths):
        ids = [rng.randrange(ID_RANGE) for _ in range(n)]
        r = await one_turn(client, model, ids, 1, f"{tag}-cold-{k}", t0, -1, k + 1, n)
        results.append(r)
    wall = time.perf_counter() - t0
    ok = [r.ttft_s for r in results if r.ttft_s is not None and r.error is None]
    return {"turns": len(results), "ttft_s": dist(ok), "cached_tokens": sum(r.cached_tokens for r in results),
            "failed": [asdict(r) for r in results if r.error is not None or r.ttft_s is None],
            "prompt_tokens": lengths, "wall_s": round(wall, 3), "server": server_figures(before, scrape(http, headers))}


def wait_reader_idle(http, headers, timeout_s: float) -> bool:
    """Until the reader has no whole chunk left in any session (so each phase starts with it caught up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = http.get("/v1/conductor/shadow/status", headers=headers).json()
        sessions = status.get("sessions") or []
        if all(s.get("backlog", 0) == 0 for s in sessions):
            return True
        time.sleep(0.2)
    return False


def goals(agents: dict, cold: dict) -> dict:
    """The issue's Must-show, checked against this run's own figures (None: not measured)."""
    first, follow, srv = agents["first_ttft_s"], agents["followup_ttft_s"], agents["server"]
    last, cold_p50 = agents["first_ttft_last_first_token_s"], cold["ttft_s"]["p50"]

    def le(a, b):
        return None if a is None or b is None else a <= b

    def ge(a, b):
        return None if a is None or b is None else a >= b

    return {"first_median_le_half_last": le(first["p50"], None if last is None else last / 2),
            "followup_p50_le_0.2s": le(follow["p50"], 0.2), "followup_p90_le_0.4s": le(follow["p90"], 0.4),
            "followup_p50_le_tenth_cold_p50": le(follow["p50"], None if cold_p50 is None else cold_p50 / 10),
            "reader_fresh_ge_0.95": ge(srv["fresh_share"], 0.95), "decode_loss_le_0.01": le(srv["decode_loss"], 0.01)}


async def run(args: argparse.Namespace, url: str) -> dict:
    import httpx
    import openai

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    shapes = agent_shapes(args.trace, args.agents + 1, args.max_turns, args.max_prompt_tokens, args.think_cap_s,
                          args.out_cap, args.scale, args.skip)
    rng = random.Random(args.seed)
    solo_shape, agent_shapes_ = shapes[0], shapes[1:]  # solo's agent is not among the N: nothing is cached across
    http_client = httpx.AsyncClient(timeout=args.request_timeout_s, event_hooks={"request": [_note_sent]},
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=args.request_timeout_s, http_client=http_client)
    with httpx.Client(base_url=url, timeout=30.0) as http:
        model = http.get("/v1/models", headers=headers).json()["data"][0]["id"]
        wait_reader_idle(http, headers, 60)
        result: dict = {"url": url, "model": model, "trace": str(args.trace),
                        "agents_sessions": [sid for sid, _ in agent_shapes_], "solo_session": solo_shape[0],
                        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
        tag = f"al{args.seed}-{int(time.time())}"  # a run's own session names, on a server that outlives runs
        solo = [(0, f"{tag}-solo", solo_shape[1], prompts_of(solo_shape[1], rng))]
        result["solo"] = await phase(client, http, headers, model, solo, 0.0) if args.solo else None
        wait_reader_idle(http, headers, args.settle_s)
        # the agents' common head (solo's and the cold phase's prompts have none), scaled as the trace's lengths
        head = [rng.randrange(ID_RANGE) for _ in range(round(args.shared_head * args.scale))]
        plans = [(i, f"{tag}-agent-{i}", s, prompts_of(s, rng, head)) for i, (_, s) in enumerate(agent_shapes_)]
        result["agents"] = await phase(client, http, headers, model, plans, args.arrival_gap_s)
        wait_reader_idle(http, headers, args.settle_s)
        follow_lengths = sorted(t.prompt_tokens for _, s in agent_shapes_ for t in s[1:])
        picks = [follow_lengths[int(i * (len(follow_lengths) - 1) / max(1, args.cold_turns - 1))]
                 for i in range(args.cold_turns)] if follow_lengths and args.cold_turns else []
        result["cold"] = await cold_phase(client, http, headers, model, picks, rng, tag)
        status = http.get("/v1/conductor/shadow/status", headers=headers).json()
        result["residency"] = status.get("residency")
    await client.close()
    result["goals"] = goals(result["agents"], result["cold"])
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a server already up (its base URL, without /v1)")
    p.add_argument("--serve", action="store_true", help="start `qse serve` (python -m qse.server) for the run")
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU, lengths scaled down: a smoke run")
    p.add_argument("--model", default="", help="--serve: the served model (preset or dir; empty: embedded)")
    p.add_argument("--shadow-model", default=None, help="--serve: the reader's model (empty: none)")
    p.add_argument("--grid", type=int, default=0, help="--serve: the reader's grid (0: the server's default)")
    p.add_argument("--server-env", action="append", default=[], help="--serve: KEY=VALUE for the server's env")
    p.add_argument("--api-key", default=os.environ.get("QSE_API_KEY", ""))
    p.add_argument("--server-log", type=Path, help="--url: the server's log (JSON lines), for each turn's stations")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--skip", type=int, default=0, help="sessions of the trace to pass over first")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-prompt-tokens", type=int, default=60000)
    p.add_argument("--think-cap-s", type=float, default=2.0)
    p.add_argument("--arrival-gap-s", type=float, default=0.5)
    p.add_argument("--out-cap", type=int, default=256, help="largest max_tokens a turn asks")
    p.add_argument("--scale", type=float, default=1.0, help="every length times this (a CPU run)")
    p.add_argument("--cold-turns", type=int, default=9, help="follow-up lengths read cold, spread evenly over their sorted list (odd: the median among them)")
    p.add_argument("--no-solo", dest="solo", action="store_false")
    p.add_argument("--ab", action="store_true", help="--serve: then the agents again on a server without the "
                   "reader, and the decode loss as the A/B of the two (the time a decoded id took)")
    p.add_argument("--settle-s", type=float, default=120.0, help="longest wait for the reader between phases")
    p.add_argument("--shared-head", type=int, default=0,
                   help="ids every agent's prompts begin with (one harness's system prompt and tools: the weka "
                        "sessions re-render at ~14.6k), so that first turns may start from another agent's state "
                        "(QSE_SHARE_HEADS); 0: each agent's ids its own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default="", help="a suffix of the result's name")
    args = p.parse_args(argv)
    if args.tiny:
        args.serve = True
        args.shadow_model = "embedded" if args.shadow_model is None else args.shadow_model
        args.grid = args.grid or 64
        args.agents = min(args.agents, 2)
        args.max_turns = min(args.max_turns, 3)
        args.scale = min(args.scale, 0.02)
        args.out_cap = min(args.out_cap, 4)
        args.cold_turns = min(args.cold_turns, 2)
        args.think_cap_s = min(args.think_cap_s, 0.2)
        args.arrival_gap_s = min(args.arrival_gap_s, 0.1)
        args.settle_s = min(args.settle_s, 30.0)
        args.server_env = ["QSE_DEVICE=cpu", "QSE_DTYPE=float32", "QSE_SHADOW_GB=0.25", "QSE_SERVED_GRID=64", *args.server_env]
    if bool(args.url) == bool(args.serve):
        p.error("give exactly one of --url (a server already up) and --serve (start one)")
    if args.ab and not args.serve:
        p.error("--ab starts a second server without the reader: it needs --serve")
    if args.agents < 1:
        p.error(f"--agents must be >= 1, got {args.agents}")
    if not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file (the weka dev half lies in ../shared/data/traces/)")
    return args


def run_once(args: argparse.Namespace, out_dir: Path, log_name: str = "agents_live-server.log") -> tuple[dict, int | None, Path | None]:
    """The phases against the server (started here with --serve, then stopped), each turn's stations joined
    from its log; (result, the server's exit code, its log)."""
    proc = log_path = None
    url = args.url
    if args.serve:
        proc, url, log_path = start_server(args, out_dir, log_name)
    try:
        result = asyncio.run(run(args, url))
    finally:
        rc = stop_server(proc) if proc is not None else None
    log_file = args.server_log if args.url else log_path
    if log_file is not None and Path(log_file).is_file():  # each turn's stations on the server
        stations = server_timeline(Path(log_file))
        for name in ("solo", "agents"):
            if result.get(name):
                for t in result[name]["turns_detail"]:
                    t.update(stations.get(t["request_id"], {}))
                result[name]["followup_stations"] = timeline_summary(result[name]["turns_detail"])
        result["followup_waits"] = waits_summary(followup_waits(Path(log_file)))
        result["reader_reads"] = reader_reads(Path(log_file))
        result["server_events"] = event_counts(Path(log_file))
    return result, rc, log_path


def decode_ab(on: dict, off: dict) -> dict:
    """The decode loss as an A/B: the agents' time a decoded id took with the reader on against off."""
    a, b = on["decode_tpot_ms"], off["decode_tpot_ms"]
    return {"tpot_ms_reader_on": a, "tpot_ms_reader_off": b,
            "decode_loss": round(a / b - 1, 5) if a is not None and b else None,
            "output_tokens_per_s_on": on["output_tokens_per_s"], "output_tokens_per_s_off": off["output_tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out_dir = Path(args.out)
    result, rc, log_path = run_once(args, out_dir)
    if args.ab:  # the same agents on a server without the reader (a fresh one: nothing is cached from the first)
        off_args = argparse.Namespace(**{**vars(args), "shadow_model": "", "solo": False, "cold_turns": 0})
        off, _, _ = run_once(off_args, out_dir, "agents_live-server-reader-off.log")
        result["reader_off"] = {k: v for k, v in off["agents"].items() if k != "turns_detail"}
        result["decode_ab"] = decode_ab(result["agents"], off["agents"])
        loss = result["decode_ab"]["decode_loss"]
        result["goals"]["decode_loss_ab_le_0.01"] = None if loss is None else loss <= 0.01
    header = result_header("openai", device="cpu" if args.tiny or not _has_cuda() else None)
    result = {**header, **result, "server_exit": rc, "server_log": str(log_path) if log_path else None}
    for name in ("solo", "agents"):
        if result.get(name):
            compact = {k: v for k, v in result[name].items() if k not in ("turns_detail",)}
            print(json.dumps({"phase": name, **compact}))
    print(json.dumps({"phase": "cold", **{k: v for k, v in result["cold"].items() if k != "failed"}}))
    if "decode_ab" in result:
        print(json.dumps({"decode_ab": result["decode_ab"]}))
    print(json.dumps({"goals": result["goals"]}))
    write_result(result, out_dir, "agents_live" + (f"-{args.tag}" if args.tag else ""))
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
