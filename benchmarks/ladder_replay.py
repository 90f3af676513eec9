#!/usr/bin/env python
"""What the served sessions' checkpoint ladder (QSE_SERVED_CHECKPOINT_LADDER) buys on real agent sessions.

    python benchmarks/ladder_replay.py [--trace ../shared/data/traces/weka_cc_sessions_dev.csv] [--ladders 0,4096,8192]

Each session of the weka coding-agent trace (its dev half) is replayed by qse/replay/simulator.py with the
served model's own checkpoint book (qse/core/checkpoints.py) under each ladder: a follow-up's served turn
starts from the newest state the book holds at or below what its prompt keeps (the line it stands on, a
prompt-end, recent or ladder checkpoint, or row 0). Per ladder: the follow-ups that start from row 0, the ids
read again below what the prompts keep, the served time to the first token (ms of the served read model:
the 9B's chunk cost on the H200, agents_replay's points), over all follow-ups and over those the ladder
changes, and the most ladder states a session holds. A replay: no timing of this machine enters the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.stats import nearest_rank  # noqa: E402
from qse.core.checkpoints import CheckpointRules  # noqa: E402
from qse.replay.read_model import ReadModel  # noqa: E402
from qse.replay.simulator import SimOptions, simulate  # noqa: E402
from qse.replay.traces import from_weka  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "weka_cc_sessions_dev.csv"
SERVED_POINTS = ((0, 14.3), (17000, 16.9), (30000, 18.8))  # the 9B's chunk on the H200 (served_sessions-tiers-9b)
GDN_STATE_BYTES_9B = 24 * 32 * 128 * 128 * 4  # one served checkpoint's recurrent state (fp32; conv state aside)


def dist(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"n": 0}
    return {"n": len(values), **{f"p{q}": round(nearest_rank(values, q / 100), 1) for q in (50, 90, 99)},
            "max": round(values[-1], 1), "sum": round(sum(values), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--ladders", default="0,4096,8192", help="QSE_SERVED_CHECKPOINT_LADDER values (rows)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file (the weka dev half lies in ../shared/data/traces/)")
    records = from_weka(args.trace).records
    served = ReadModel(SERVED_POINTS, grid=512, source="the 9B's chunk on the H200")
    runs = {}
    for ladder in (int(v) for v in args.ladders.split(",")):
        options = SimOptions.of(served_checkpoint_ladder=ladder)
        res = simulate(records, served, options)
        follow = [s for s in res.turn_starts if s.turn > 0]
        rules = CheckpointRules(options.grid, ladder_from=ladder)
        longest = max((r.prompt_tokens for r in records), default=0)
        runs[ladder] = (follow, {
            "ladder_from": ladder, "followups": len(follow),
            "from_row_0": sum(1 for s in follow if s.served_from == 0),
            "reread_below_kept_ids": sum(max(0, (s.kept_tokens // options.grid) * options.grid - s.served_from)
                                         for s in follow),
            "served_ttft_ms": dist([s.served_ttft_cached_ms for s in follow]),
            "ladder_states_longest_session": len(rules.ladder_lines(longest)),
            "ladder_bytes_longest_session_9b": len(rules.ladder_lines(longest)) * GDN_STATE_BYTES_9B,
        })
    base_follow, _ = runs[min(runs)]
    rows = []
    for ladder, (follow, row) in runs.items():
        changed = [(a.served_ttft_cached_ms, b.served_ttft_cached_ms) for a, b in zip(base_follow, follow)
                   if a.served_from != b.served_from]
        row["changed_turns"] = {"n": len(changed), "before_ms": dist([a for a, _ in changed]),
                                "after_ms": dist([b for _, b in changed])}
        rows.append(row)
        print(row)
    result = {**result_header(device="cpu (a replay: no timing of this machine enters the figures)"),
              "trace": str(args.trace), "served_read_model": SERVED_POINTS,
              "options": dataclasses.asdict(SimOptions.of().policy) | {"grid": SimOptions.of().grid},
              "runs": rows}
    write_result(result, args.out, "ladder_replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
