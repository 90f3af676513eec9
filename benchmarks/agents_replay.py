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
the reader, HTTP and the host's work between rounds, and a turn's arrival is the live one (a faster policy would
bring the next turn sooner): read its rows against each other and against the "live" row's calibration, not as
a forecast of the server's figures. CPU only.
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

from benchmarks.stats import nearest_rank  # noqa: E402
from qse.policy import Policy  # noqa: E402
from qse.replay.read_model import ReadModel  # noqa: E402
from qse.replay.rounds import DecodeCost, simulate_rounds  # noqa: E402
from qse.replay.usage import UsageRecord  # noqa: E402
from qse.settings import SETTINGS  # noqa: E402

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
]


def records_of(run: dict, phase: str) -> list[UsageRecord]:
    out = []
    for t in run[phase]["turns_detail"]:
        if t.get("error") or t.get("ttft_s") is None:
            continue
        out.append(UsageRecord(session=f"agent-{t['agent']}", arrival_s=t["sent_s"],
                               first_token_s=t["sent_s"] + t["ttft_s"], end_s=t["end_s"],
                               prompt_tokens=t["prompt_tokens"], shared_prefix_tokens=t["cached_tokens"],
                               output_tokens=t["output_tokens"], cached_tokens=t["cached_tokens"]))
    return out


def figures(ttfts: list[tuple[bool, float]]) -> dict:
    first = sorted(v for follow, v in ttfts if not follow)
    follow = sorted(v for follow, v in ttfts if follow)

    def q(values: list[float], p: float) -> float | None:
        return round(nearest_rank(values, p), 4) if values else None

    return {"first_p50_s": q(first, 0.5), "first_max_s": first[-1] if first else None,
            "followup_p50_s": q(follow, 0.5), "followup_p90_s": q(follow, 0.9), "followups": len(follow)}


def replay(records: list[UsageRecord], policy: Policy, model: ReadModel, decode: DecodeCost,
           tail_ms: float) -> dict:
    sim = simulate_rounds(records, policy, model, decode, keep_plans=False, tail_ms=tail_ms)
    ttfts = [(t.record.cached_tokens > 0 or t.record.shared_prefix_tokens > 0, t.ttft_s)
             for t in sim.turns if t.ttft_s is not None]
    out = figures(ttfts)
    span = max(t.end_s for t in sim.turns) - min(t.record.arrival_s for t in sim.turns)
    out.update(num_rounds=sim.num_rounds, output_tokens_per_s=round(sum(t.ids for t in sim.turns) / span, 1))
    return out


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
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="a dir, or a file ending .json")
    args = p.parse_args(argv)
    run = json.loads(args.run.read_text())
    records = records_of(run, args.phase)
    points = tuple((int(c), float(ms)) for c, ms in (pair.split(":") for pair in args.chunk_points.split(",")))
    model = ReadModel(points, grid=512, source=f"--chunk-points {args.chunk_points}")
    base, per = (float(v) for v in args.decode_ms.split(","))
    decode = DecodeCost(base, per)
    default = Policy.from_settings(SETTINGS)
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
    result = {"command": shlex.join([sys.executable, *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "device": "cpu (a replay: no timing of this machine enters the figures)",
              "versions": {"python": platform.python_version()}, "run": str(args.run), "phase": args.phase,
              "turns": len(records), "costs": {"chunk_points": points, "decode_ms": [base, per], "tail_ms": args.tail_ms},
              "live_measured": {"client": measured, "server": server}, "policies": rows}
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"agents_replay-{dt.date.today().isoformat()}-cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"wrote": str(out), "live_measured": result["live_measured"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
