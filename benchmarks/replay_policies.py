"""Reader policies on the replayed traces: freshness at turn starts and the decode-loss estimate, one row each.

    python benchmarks/replay_policies.py [--traces ../shared/data/traces] [--read-model RESULTS.json]
                                         [--target-ms-per-1000 8] [--out benchmarks/results/replay-policies-DATE.json]

Every policy runs on the weka coding-agent sessions and the mooncake chat chains, with two read
models: the measured one (a shadow_measure result, its 0.8B row) and a flat target rate. The first
row is the runtime's policy as it is (the simulator's defaults, which mirror the runtime's); the
second is the runtime's policy of 2026-11-29 before the ration delay (2 % from the first token, 6
prompt-end checkpoints, nothing else), and every other row spells its options out from that one, so
a row means the same whatever the defaults are. A policy "wins" when, on every trace and read model,
it is at least as fresh at turn starts (all of them, and follow-ups only) and loses no more decode
time than the row it is compared with, and is fresher on one; both comparisons are in the table.
CPU only; no timing of this machine enters the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qse.replay.read_model import ReadModel  # noqa: E402
from qse.replay.simulator import MISS_CAUSES, SimOptions, simulate  # noqa: E402
from qse.replay.traces import convert  # noqa: E402

TRACES = {"weka": "weka_cc_sessions_dev.csv", "mooncake": "mooncake_conversation_inferred_chains.csv"}

# the runtime's policy of 2026-11-29, before the ration delay: every row below but "runtime" starts from it
RUNTIME_2026_11_29 = dict(ration=0.02, ration_after_s=0.0, ration_from="first_token", checkpoints=6,
                          checkpoint_at_line=True, recent_checkpoints=0, divergence_checkpoints=0, idle_wake=False)
CKPT_PLUS = dict(RUNTIME_2026_11_29, recent_checkpoints=4, divergence_checkpoints=4)
RECENT_2_DIV_2 = dict(RUNTIME_2026_11_29, recent_checkpoints=2, divergence_checkpoints=2)
RECENT_4 = dict(RUNTIME_2026_11_29, recent_checkpoints=4)


def _old(**changes) -> dict:
    return dict(RUNTIME_2026_11_29, **changes)


# (name, what it changes, SimOptions overrides, can the runtime do it (by default or with a QSE_* setting)?)
POLICIES: list[tuple[str, str, dict, bool]] = [
    ("runtime", "the runtime's policy as it is now (the simulator's defaults, which mirror qse/settings.py)", {},
     True),
    ("runtime_2026_11_29", "the runtime until the ration delay: 2 % ration from the first token, idle window, "
                           "6 prompt-end checkpoints (taken when a chunk ends on the line, or at once when the "
                           "reader stands on it)", RUNTIME_2026_11_29, True),
    ("runtime_before_checkpoint_at_line", "the runtime until 2026-11-29: a prompt-end checkpoint only when a "
                                          "chunk ends on the line", _old(checkpoint_at_line=False), False),
    ("idle_only", "no ration (reference: what the idle window alone does)", _old(ration=0.0), True),
    ("ration_1pct", "ration 1 %", _old(ration=0.01), True),
    ("ration_3pct", "ration 3 %", _old(ration=0.03), True),
    ("ration_from_turn_start", "the seed's first build: the ration counts from the turn start",
     _old(ration_from="turn_start"), True),
    ("ration_after_5s", "the ration counts from 5 s after the first token (checkpoints as the 2026-11-29 runtime)",
     _old(ration_after_s=5.0), True),
    ("checkpoints_12", "12 prompt-end checkpoints instead of 6", _old(checkpoints=12), True),
    ("recent_2", "checkpoint_at_line + the newest 2 grid lines read kept as checkpoints",
     _old(recent_checkpoints=2), True),
    ("recent_4", "checkpoint_at_line + the newest 4 grid lines read", RECENT_4, True),
    ("recent_8", "checkpoint_at_line + the newest 8 grid lines read", _old(recent_checkpoints=8), True),
    ("divergence_4", "checkpoint_at_line + the lines of the newest 4 re-render points",
     _old(divergence_checkpoints=4), True),
    ("pin_first", "checkpoint_at_line + the lowest prompt-end checkpoint kept", _old(pin_first_checkpoint=True),
     False),
    ("recent_2_div_2", "checkpoint_at_line + recent 2 + divergence 2 (10 checkpoints a session at most)",
     RECENT_2_DIV_2, True),
    ("ckpt_plus", "checkpoint_at_line + recent 4 + divergence 4 (14 checkpoints a session at most)", CKPT_PLUS, True),
    ("wake_on_end", "the idle window looks the moment a turn ends (QSE_SHADOW_IDLE_WAKE, on since 2026-12-04)",
     _old(idle_wake=True), True),
    ("prefill_2pct", "read during the served prefill, 2 % of it (delays the first token)", _old(prefill_share=0.02),
     False),
    ("prefill_5pct", "read during the served prefill, 5 % of it (delays the first token)", _old(prefill_share=0.05),
     False),
    ("ckpt_plus_ration_1pct", "ckpt_plus with a 1 % ration", dict(CKPT_PLUS, ration=0.01), True),
    ("ckpt_plus_wake_prefill_2pct", "ckpt_plus + wake_on_end + prefill 2 %",
     dict(CKPT_PLUS, idle_wake=True, prefill_share=0.02), False),
    ("idle_only_ckpt_plus", "ckpt_plus with no ration: the idle window alone", dict(CKPT_PLUS, ration=0.0), True),
    *[(f"ckpt_plus_after_{d:g}s", f"ckpt_plus; the ration counts from {d:g} s after the first token",
       dict(CKPT_PLUS, ration_after_s=float(d)), True) for d in (1, 2, 5, 10)],
    *[(f"recent_2_div_2_after_{d:g}s", f"recent_2_div_2; the ration counts from {d:g} s after the first token",
       dict(RECENT_2_DIV_2, ration_after_s=float(d)), True) for d in (2, 5)],
    ("recent_4_after_5s", "recent_4; the ration counts from 5 s after the first token",
     dict(RECENT_4, ration_after_s=5.0), True),
    # the runtime's policy of the sixth session (recent_4_after_5s) with idle windows reading chunk groups
    *[(f"recent_4_after_5s_idle_group_{g}", f"recent_4_after_5s; idle windows read chunk groups of up to {g} "
       f"(QSE_SHADOW_IDLE_GROUP={g}): less device time a chunk, a request waits for at most one group",
       dict(RECENT_4, ration_after_s=5.0, idle_group=g), True) for g in (4, 16)],
]
# the traces do not say where a re-rendered output diverges: the other end of the range, for a few rows
SENSITIVITY = [("runtime", {}), ("runtime_2026_11_29", RUNTIME_2026_11_29), ("ckpt_plus", CKPT_PLUS)]


def _row(report: dict) -> dict:
    fu = report["behind_tokens_followups"]
    misses = report["misses"]
    return {
        "fresh_share": report["fresh_share"],
        "fresh_share_followups": report["fresh_share_followups"],
        "behind_followups_p50": fu["p50"], "behind_followups_p90": fu["p90"], "behind_followups_p99": fu["p99"],
        "decode_loss": report["decode_loss"],
        "prefill_loss": report["prefill_loss"],
        "reader_s": {k: round(v / 1000, 3) for k, v in report["reader_ms"].items()},
        "request_wait_ms_max": report["request_wait_ms"]["max"],
        "request_wait_ms_p50": report["request_wait_ms"]["p50"],
        "request_wait_ms_p99": report["request_wait_ms"]["p99"],
        "request_waits": report["request_wait_ms"]["n"],
        "missed": misses["num_missed"],
        "missed_by_cause": {c: v["n"] for c, v in misses["by_cause"].items()},
        "max_checkpoints_held": report["checkpoints"]["max_held_by_a_session"],
        "max_checkpoint_bytes_per_session_0_8b": report["checkpoints"]["max_bytes_per_session_0_8b"],
    }


_RECORDS: dict = {}


def _run(job: tuple) -> tuple:
    trace_key, trace_path, model_key, model_json, overrides = job
    if trace_key not in _RECORDS:
        _RECORDS[trace_key] = convert(trace_path).records
    model = ReadModel.from_json(model_json)
    report = simulate(_RECORDS[trace_key], model, SimOptions.of(**overrides)).report()
    return job, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "data" / "traces")
    p.add_argument("--read-model", type=Path,
                   default=ROOT / "benchmarks" / "results" / "shadow_measure-graph-v12-groups-final-2026-11-29-h200.json")
    p.add_argument("--read-model-preset", default=None)
    p.add_argument("--read-model-ops", default=None)
    p.add_argument("--target-ms-per-1000", type=float, default=8.0)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks" / "results" / f"replay-policies-{dt.date.today().isoformat()}.json")
    args = p.parse_args(argv)

    measured = ReadModel.load(args.read_model, args.read_model_preset, args.read_model_ops)
    models = {"measured": measured,
              f"target_{args.target_ms_per_1000:g}ms": ReadModel.flat(args.target_ms_per_1000,
                                                                       source=f"flat {args.target_ms_per_1000:g} ms per "
                                                                              "1000 tokens at grid 512 (the read-rate goal, TARGETS.md)")}
    jobs = []
    for tkey, tname in TRACES.items():
        for mkey, model in models.items():
            for _name, _what, overrides, _rt in POLICIES:
                jobs.append((tkey, str(args.traces / tname), mkey, model.to_json(), overrides))
            for _name, overrides in SENSITIVITY:
                jobs.append((tkey, str(args.traces / tname), mkey, model.to_json(),
                             dict(overrides, short_prompt_kept="previous_prompt")))
    results: dict = {}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for job, report in pool.map(_run, jobs):
            tkey, _, mkey, _, overrides = job
            results[(tkey, mkey, json.dumps(overrides, sort_keys=True))] = report

    def get(tkey, mkey, overrides):
        return results[(tkey, mkey, json.dumps(overrides, sort_keys=True))]

    def wins(overrides: dict, base: dict) -> dict:
        """Against the row of `base`: at least as fresh and no more decode loss everywhere, fresher on one
        (`wins`); at least as fresh and strictly less decode loss everywhere (`fresher_or_equal_and_cheaper`)."""
        pairs = [(get(t, m, overrides), get(t, m, base)) for t in TRACES for m in models]
        fresh = all(r["fresh_share"] >= b["fresh_share"] and r["fresh_share_followups"] >= b["fresh_share_followups"]
                    for r, b in pairs)
        return {"wins": (fresh and all(r["decode_loss"] <= b["decode_loss"] for r, b in pairs)
                         and any(r["fresh_share"] > b["fresh_share"] for r, b in pairs)),
                "fresher_or_equal_and_cheaper": fresh and all(r["decode_loss"] < b["decode_loss"] for r, b in pairs)}

    table = []
    for name, what, overrides, in_runtime in POLICIES:
        cells = {f"{t}/{m}": _row(get(t, m, overrides)) for t in TRACES for m in models}
        delays = any((get(t, m, overrides)["prefill_loss"] or 0) > 0 for t in TRACES for m in models)
        table.append({"policy": name, "what": what, "options": SimOptions.of(**overrides).to_json(),
                      "in_runtime": in_runtime, "wins_on_both_vs_runtime": wins(overrides, {})["wins"],
                      "vs_runtime_2026_11_29": wins(overrides, RUNTIME_2026_11_29),
                      "adds_first_token_delay": delays, "results": cells})
    sensitivity = []
    for name, overrides in SENSITIVITY:
        o = dict(overrides, short_prompt_kept="previous_prompt")
        sensitivity.append({"policy": name, "options": SimOptions.of(**o).to_json(),
                            "results": {f"{t}/{m}": _row(get(t, m, o)) for t in TRACES for m in models}})
    meta_inputs = {t: {k: v for k, v in convert(args.traces / n, max_sessions=1).meta.items()
                       if k not in ("num_sessions", "num_records")} for t, n in TRACES.items()}
    out = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "device": f"CPU ({platform.machine()}); a virtual clock, no timing of this machine enters the figures",
        "read_models": {k: m.to_json()["read_model"] for k, m in models.items()},
        "traces": {t: str(args.traces / n) for t, n in TRACES.items()},
        "trace_conversion": meta_inputs,
        "sizes": {t: {"num_sessions": get(t, "measured", {})["num_sessions"],
                      "num_turns": get(t, "measured", {})["num_turns"],
                      "num_followup_turns": get(t, "measured", {})["num_followup_turns"]} for t in TRACES},
        "engine_model": "one engine per session: each session replayed alone on its own served model and reader",
        "wins_rule": ("wins_on_both_vs_runtime: at least as fresh (all turn starts and follow-ups) and no more "
                      "decode loss than the runtime row on every trace and read model, and fresher on one; "
                      "vs_runtime_2026_11_29: the same against the runtime before the ration delay (wins), and at "
                      "least as fresh with strictly less decode loss everywhere (fresher_or_equal_and_cheaper); a "
                      "policy that reads during the served prefill also delays the first token "
                      "(adds_first_token_delay, prefill_loss), which the two measures do not count"),
        "miss_causes": MISS_CAUSES,
        "policies": table,
        "sensitivity_short_prompt_kept_previous_prompt": sensitivity,
        "notes": [
            "decode_loss is the replay's estimate: reader time between decode rounds / the served model's decode time "
            "(trace timing; the served decode is the seed's GB10 rate, 36 tok/s, where a trace has no timing); the GPU "
            "A/B (benchmarks/shadow_ab.py) must confirm any change before it becomes the default",
            "recent and divergence checkpoints are the runtime reader's (QSE_SHADOW_RECENT_CHECKPOINTS, "
            "QSE_SHADOW_DIVERGENCE_CHECKPOINTS); pin_first is the simulator's only; a checkpoint is one recurrent "
            "state copy (19,537,920 bytes on the 0.8B), its copy time is not modelled",
            "ration_after_s: the ration counts from that many seconds after the first token "
            "(QSE_SHADOW_RATION_AFTER_S); a turn whose decode is shorter spends no ration, its backlog is left "
            "to the idle window after it",
            "prefill_loss is reader time during the served prefill / the served prefill time: the first token comes "
            "that much later",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"written": str(args.out)}))
    for row in table:
        cells = " | ".join(f"{k} {100 * v['fresh_share']:.2f}% p90 {v['behind_followups_p90']} "
                           f"{100 * v['decode_loss']:.3f}%" for k, v in row["results"].items())
        old = row["vs_runtime_2026_11_29"]
        flag = (("WIN" if row["wins_on_both_vs_runtime"] else "   ")
                + (" OLD:" + ("win" if old["wins"] else "   ") + ("<" if old["fresher_or_equal_and_cheaper"] else " "))
                + ("+TTFT" if row["adds_first_token_delay"] else "     "))
        print(f"{row['policy']:<28} {flag} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
