"""A live agents run's turns through the rounds' replay: how well the replay reproduces the run, and what other
round policies would have given the same arrivals (issue 29's follow-up TTFT goals).

    python benchmarks/agents_replay.py benchmarks/results/agents_live-2026-12-02-h200.json \
        [--decode-ms 4.54,0.137] [--tail-ms 12] [--out benchmarks/results]

Each agents-phase turn of the run becomes a usage record (its session, the client's send time, its prompt, the
ids the cache kept, its output ids), and `qse.replay.rounds.simulate_rounds` replays them through the
conductor's own scheduler (qse/core/rounds.py) under each policy below. The costs are the device's, measured
elsewhere on the same build, not this machine's: the served 9B's chunk by context (`--chunk-points`, from
`served_sessions-tiers-9b-*`), a decode round at batch B (`--decode-ms` base,per sequence, from `round_step-*`),
and the tail's fixed cost (`--tail-ms`, served_sessions' tail_ms less its rows' share). The replay leaves out
the reader's slices between rounds, HTTP and the host's work between rounds (round_step's device time ends the
turns early; benchmarks/NOTES.md gives the --decode-ms that matches a run's ends), and a turn's
arrival is the live one (a faster policy would bring the next turn sooner): read its rows against each other
and against the "live" row's calibration, not as a forecast of the server's figures.

The reader rows add the reader's idle window (`ReaderCost`: its chunk by context, `--reader-points`, and the
host's time around each, `--reader-host-ms`) under each order and wake (READER_POLICIES), with the ids each
prompt keeps of its session's taken from the run's trace (`--trace`), and say which follow-ups found it stale
beside the run's own (live_measured.reader). CPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agents_live import agent_shapes  # noqa: E402
from benchmarks.stats import nearest_rank  # noqa: E402
from qse.core.plan import is_fresh  # noqa: E402
from qse.policy import Policy  # noqa: E402
from qse.replay.read_model import ReadModel  # noqa: E402
from qse.replay.rounds import DecodeCost, ReaderCost, simulate_rounds  # noqa: E402
from qse.replay.usage import UsageRecord  # noqa: E402
from qse.settings import REGISTRY, SETTINGS  # noqa: E402

# (name, what it changes, Policy overrides)
POLICIES: list[tuple[str, str, dict]] = [
    ("live", "the run's own policy (the defaults: budget 2048, no decode yield, launched ahead)", {}),
    ("budget_1024", "a round reads 2 pieces", {"round_token_budget": 1024}),
    ("budget_4096", "a round reads 8 pieces", {"round_token_budget": 4096}),
    ("budget_8192", "a round reads 16 pieces", {"round_token_budget": 8192}),
    ("yield_20ms", "running turns sit out prompt rounds while each decoded within 20 ms", {"decode_yield_ms": 20.0}),
    ("yield_50ms", "the same within 50 ms", {"decode_yield_ms": 50.0}),
    ("yield_100ms", "the same within 100 ms", {"decode_yield_ms": 100.0}),
    ("budget_4096_yield_50ms", "both", {"round_token_budget": 4096, "decode_yield_ms": 50.0}),
    *[(f"budget_{b}_yield_{y}ms", f"a round reads {b // 512} piece(s); running turns sit out prompt rounds while each "
                                  f"decoded within {y} ms", {"round_token_budget": b, "decode_yield_ms": float(y)})
      for b, y in ((512, 50), (512, 100), (512, 150), (1024, 100), (1024, 200), (1024, 400))],
    ("first_token_early", "a first token leaves when its tail is read, not at its round's end (QSE_FIRST_TOKEN_EARLY)",
     {"first_token_early": True}),
    *[(f"first_token_early_budget_{b}_yield_{y}ms", f"the same; a round reads {b // 512} piece(s), running turns sit "
                                                    f"out prompt rounds while each decoded within {y} ms",
       {"first_token_early": True, "round_token_budget": b, "decode_yield_ms": float(y)})
      for b, y in ((4096, 0), (512, 100), (1024, 200))],
    ("first_token_early_cut", "a first token leaves when its tail is read; a round stops where a newcomer goes "
                              "before its next piece (QSE_ROUND_CUT)", {"first_token_early": True, "cut_rounds": True}),
    *[(f"first_token_early_cut_budget_{b}_yield_{y}ms", f"the same; a round reads up to {b // 512} pieces, running "
                                                        f"turns sit out prompt rounds while each decoded within {y} ms",
       {"first_token_early": True, "cut_rounds": True, "round_token_budget": b, "decode_yield_ms": float(y)})
      for b, y in ((4096, 0), (8192, 0), (2048, 50), (2048, 100), (4096, 100))],
]


def kept_prefixes(run: dict, trace: Path | None = None) -> dict[tuple[int, int], int]:
    """(agent, turn) -> the ids its prompt keeps of its session's before it (the trace's shared head: the client
    builds each prompt from it, agents_live.prompts_of), from the run's trace and options; {} without the trace."""
    opt = run.get("options", {})
    path = trace or Path(opt.get("trace", ""))
    if not path.is_file():
        return {}
    wanted, shapes, count = set(run["agents_sessions"]), {}, len(run["agents_sessions"])
    while not wanted <= shapes.keys():  # the sessions the client picked, however many it passed over first
        try:
            shapes = dict(agent_shapes(path, count, opt["max_turns"], opt["max_prompt_tokens"], opt["think_cap_s"],
                                       opt["out_cap"], opt["scale"], 0))
        except SystemExit:  # fewer sessions in the trace than asked: those the run names are not all there
            return {}
        count *= 2
    return {(agent, no): shape.shared_tokens for agent, sid in enumerate(run["agents_sessions"])
            for no, shape in enumerate(shapes[sid])}


def records_of(run: dict, phase: str, kept: dict[tuple[int, int], int] | None = None) -> list[UsageRecord]:
    """The phase's turns as usage records; shared_prefix_tokens: the ids each keeps of its session's (from
    `kept`; without it the ids the served cache reused)."""
    out = []
    for t in run[phase]["turns_detail"]:
        if t.get("error") or t.get("ttft_s") is None:
            continue
        shared = (kept or {}).get((t["agent"], t["turn"]), t["cached_tokens"])
        out.append(UsageRecord(session=f"agent-{t['agent']}", arrival_s=t["sent_s"],
                               first_token_s=t["sent_s"] + t["ttft_s"], end_s=t["end_s"],
                               prompt_tokens=t["prompt_tokens"], shared_prefix_tokens=shared,
                               output_tokens=t["output_tokens"], cached_tokens=t["cached_tokens"]))
    return out


# (name, what it changes, Policy overrides): the reader's idle window beside the rounds (the run's round policy)
READER_POLICIES: list[tuple[str, str, dict]] = [
    ("reader_oldest_polled", "the reader before 2026-12-04: the oldest unread chunk first, the idle window on its "
                             "0.2 s poll", {"read_order": "oldest", "idle_wake": False}),
    ("reader_oldest_woken", "the oldest first; the window looks the moment the engine is free",
     {"read_order": "oldest", "idle_wake": True}),
    ("reader_shortest_polled", "the shortest backlog first; on its poll",
     {"read_order": "shortest", "idle_wake": False}),
    ("reader_shortest_woken", "the shortest backlog first, woken (the defaults since 2026-12-04)",
     {"read_order": "shortest", "idle_wake": True}),
    ("reader_shortest_woken_group4", "the defaults, the idle window reading chunk groups of up to 4 "
                                     "(QSE_SHADOW_IDLE_GROUP=4; a chunk's share in a group: read_model.group_share)",
     {"read_order": "shortest", "idle_wake": True, "idle_group": 4}),
    ("reader_with_early_cut_rounds", "the defaults since 2026-12-05: the reader's, and the rounds' early first "
                                     "tokens and cut rounds", {"read_order": "shortest", "idle_wake": True,
                                                               "first_token_early": True, "cut_rounds": True}),
    ("reader_with_early_cut_rounds_group4", "the same with idle chunk groups of up to 4",
     {"read_order": "shortest", "idle_wake": True, "first_token_early": True, "cut_rounds": True, "idle_group": 4}),
]


def figures(ttfts: list[tuple[bool, float]]) -> dict:
    first = sorted(v for follow, v in ttfts if not follow)
    follow = sorted(v for follow, v in ttfts if follow)

    def q(values: list[float], p: float) -> float | None:
        return round(nearest_rank(values, p), 4) if values else None

    return {"first_p50_s": q(first, 0.5), "first_max_s": first[-1] if first else None,
            "followup_p50_s": q(follow, 0.5), "followup_p90_s": q(follow, 0.9), "followups": len(follow)}


def replay(records: list[UsageRecord], policy: Policy, model: ReadModel, decode: DecodeCost,
           tail_ms: float, reader: ReaderCost | None = None) -> dict:
    sim = simulate_rounds(records, policy, model, decode, keep_plans=False, tail_ms=tail_ms, reader=reader,
                          keep_gaps=True)
    ttfts = [(t.record.cached_tokens > 0 or t.record.shared_prefix_tokens > 0, t.ttft_s)
             for t in sim.turns if t.ttft_s is not None]
    out = figures(ttfts)
    span = max(t.end_s for t in sim.turns) - min(t.record.arrival_s for t in sim.turns)
    gaps = sorted(sim.itl_s)
    out.update(num_rounds=sim.num_rounds, output_tokens_per_s=round(sum(t.ids for t in sim.turns) / span, 1),
               itl_ms={f"p{round(q * 100)}": round(nearest_rank(gaps, q) * 1e3, 1) for q in (0.5, 0.9, 0.99)}
               | {"max": round(gaps[-1] * 1e3, 1)} if gaps else None)
    if reader is not None:
        out.update(freshness([(t.record.session, t.reader_behind_tokens) for t in sim.turns], policy.grid),
                   reader_chunks=sim.reader_chunks, reader_device_s=round(sim.reader_device_ms / 1000, 3))
    return out


def context_points(text: str) -> tuple[tuple[int, float], ...]:
    """'context:ms,context:ms' -> ((context, ms), ...): a read model's points from the command line."""
    return tuple((int(c), float(ms)) for c, ms in (pair.split(":") for pair in text.split(",")))


def policy_changes(pairs: list[str]) -> dict:
    """['field=value', ...] -> Policy overrides, each value parsed by its field's setting (qse/settings.py)."""
    settings = {f.name: f.metadata["setting"] for f in dataclasses.fields(Policy) if f.metadata}
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in settings:
            raise ValueError(f"{pair!r}: expected FIELD=VALUE with FIELD one of Policy's fields")
        out[name] = REGISTRY[settings[name]].parse(text)
    return out


def freshness(behinds: list[tuple[str, int | None]], grid: int) -> dict:
    """Follow-up starts with the reader less than a grid chunk behind (the server's qse_shadow_turn_starts rule),
    and the stale ones by session and turn."""
    counted, stale, seen = 0, [], {}
    for session, behind in behinds:
        no = seen.get(session, 0)
        seen[session] = no + 1
        if behind is None:
            continue
        counted += 1
        if not is_fresh(behind, grid):
            stale.append(f"{session}/t{no}")
    return {"fresh_share": round(1 - len(stale) / counted, 4) if counted else None, "turn_starts": counted,
            "stale": sorted(stale)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="an agents_live result (JSON)")
    p.add_argument("--phase", default="agents", help="the run's phase to replay (agents, solo)")
    p.add_argument("--chunk-points", default="0:14.3,17000:16.9,30000:18.8",
                   help="the served model's chunk: context:ms pairs (H200, 9B, served_sessions-tiers-9b)")
    p.add_argument("--decode-ms", default="4.54,0.137", help="a decode round: base ms, ms a sequence (round_step)")
    p.add_argument("--tail-ms", type=float, default=12.0, help="a tail's fixed cost past its rows' share (ms)")
    p.add_argument("--chunk-scales", default="0.9,0.8,0.7,0.6",
                   help="the live policy again with every chunk's cost times each of these: the prefill rate the "
                        "goals need")
    p.add_argument("--reader-points", default="0:3.65,65536:6.85",
                   help="the reader's chunk: context:ms pairs (H200, 0.8B, fitted to the idle chunks of "
                        "agents_live-pdl-2026-12-04-h200's server log)")
    p.add_argument("--reader-host-ms", type=float, default=1.13,
                   help="the host's ms around each reader launch, a chunk or a group (the same log: idle bursts' "
                        "wall less device time, a chunk a launch)")
    p.add_argument("--trace", type=Path, default=None,
                   help="the run's trace (default: its options' path): the ids each prompt keeps of its session's")
    p.add_argument("--base", action="append", default=[], metavar="FIELD=VALUE",
                   help="the run's policy where it differs from today's defaults (a Policy field, e.g. "
                        "first_token_early=false and cut_rounds=false for a run before 2026-12-05): every row "
                        "starts from it")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="a dir, or a file ending .json")
    args = p.parse_args(argv)
    run = json.loads(args.run.read_text())
    kept = kept_prefixes(run, args.trace)
    if not kept:  # the reader's rows then take the served cache's reuse for what a prompt keeps (a grid line lower)
        print(json.dumps({"warning": f"the run's trace ({args.trace or run.get('options', {}).get('trace')}) is not "
                                     "here or lacks its sessions: the ids a prompt keeps are taken as those the served "
                                     "cache reused (give --trace: the weka dev half lies in ../shared/data/traces/)"}))
    records = records_of(run, args.phase, kept)
    points = context_points(args.chunk_points)
    model = ReadModel(points, grid=512, source=f"--chunk-points {args.chunk_points}")
    base, per = (float(v) for v in args.decode_ms.split(","))
    decode = DecodeCost(base, per)
    try:
        base_changes = policy_changes(args.base)
        default = dataclasses.replace(Policy.from_settings(SETTINGS), **base_changes)
    except (TypeError, ValueError) as exc:  # (a SettingError is a ValueError)
        p.error(f"--base: {exc}")
    measured = figures([(t["turn"] > 0, t["ttft_s"]) for t in run[args.phase]["turns_detail"]
                        if t.get("ttft_s") is not None and not t.get("error")])
    server = figures([(t["turn"] > 0, t["server_ttft_s"]) for t in run[args.phase]["turns_detail"]
                      if t.get("server_ttft_s") is not None])
    rows = []
    for name, what, changes in POLICIES:
        policy = dataclasses.replace(default, **changes)
        rows.append({"policy": name, "what": what, "changes": changes,
                     **replay(records, policy, model, decode, args.tail_ms)})
        print(json.dumps(rows[-1]))
    for scale in (float(v) for v in args.chunk_scales.split(",") if v):
        scaled = ReadModel(tuple((c, ms * scale) for c, ms in points), grid=512, source=f"x{scale}")
        rows.append({"policy": f"live_chunks_x{scale:g}", "what": f"the live policy, every chunk's cost x{scale:g}",
                     "changes": {"chunk_cost_scale": scale}, **replay(records, default, scaled, decode, args.tail_ms)})
        print(json.dumps(rows[-1]))
    alone = []  # each turn with its session's turns alone on the device: what no sharing costs
    for session in sorted({r.session for r in records}):
        mine = [r for r in records if r.session == session]
        sim = simulate_rounds(mine, default, model, decode, keep_plans=False, tail_ms=args.tail_ms)
        alone += [(t.record.cached_tokens > 0, t.ttft_s) for t in sim.turns if t.ttft_s is not None]
    rows.append({"policy": "each_session_alone", "what": "each agent's turns on the device alone (no other agent)",
                 "changes": {}, **figures(alone)})
    print(json.dumps(rows[-1]))
    reader_points = context_points(args.reader_points)
    reader = ReaderCost(ReadModel(reader_points, grid=default.grid, source=f"--reader-points {args.reader_points}"),
                        args.reader_host_ms)
    for name, what, changes in READER_POLICIES:
        rows.append({"policy": name, "what": what, "changes": changes,
                     **replay(records, dataclasses.replace(default, **changes), model, decode, args.tail_ms, reader)})
        print(json.dumps(rows[-1]))
    turns = run[args.phase]["turns_detail"]
    live_fresh = freshness([(f"agent-{t['agent']}", t.get("reader_behind_tokens")) for t in
                            sorted(turns, key=lambda t: (t["agent"], t["turn"]))], default.grid)
    result = {"command": shlex.join([sys.executable, *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "device": "cpu (a replay: no timing of this machine enters the figures)",
              "versions": {"python": platform.python_version()}, "run": str(args.run), "phase": args.phase,
              "turns": len(records), "kept_from": "trace" if kept else "cached_tokens", "base": base_changes,
              "costs": {"chunk_points": points, "decode_ms": [base, per], "tail_ms": args.tail_ms,
                        "reader_points": reader_points, "reader_host_ms": args.reader_host_ms},
              "live_measured": {"client": measured, "server": server, "reader": live_fresh}, "policies": rows}
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"agents_replay-{dt.date.today().isoformat()}-cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"wrote": str(out), "live_measured": result["live_measured"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
