"""`qse replay`: replay a usage ledger (or a public trace) through the reader's policy; one JSON object out.

    qse replay LEDGER [--format auto|weka|mooncake|azure|tracelab|ledger] [--read-model RESULTS.json]
                      [--read-model-preset qwen3.5-0.8b] [--read-model-ops triton]
                      [--out DIR] [--json-out REPORT.json] [--chart REPLAY.png]
                      [--ration 0.02] [--ration-after-s 0] [--slice-ms 150] [--idle-poll-s 0.2] [--idle-burst-s 2]
                      [--grid 512] [--decode-tok-s 36] [--prefill-tok-s 936] [--max-sessions N]
                      [--prefill-share 0] [--idle-wake on|off] [--ration-from first_token|turn_start]
                      [--no-checkpoint-at-line] [--recent-checkpoints N] [--pin-first-checkpoint]
                      [--divergence-checkpoints N]
    qse replay convert TRACE [--format ...] -o LEDGER.jsonl     (writes LEDGER.jsonl and LEDGER.jsonl.meta.json)

Defaults come from the settings registry (QSE_SHADOW_RATION, ...); the read model defaults to the
seed's 87 ms per 1,000 tokens at grid 512 (--ms-per-1000 changes it; --read-model loads a results file,
see qse/replay/read_model.py for its format; a benchmarks/shadow_measure.py result is read as it is,
its 0.8B row unless --read-model-preset/--read-model-ops say otherwise). The report carries the
command line, the read model (with its source) and the cause of every turn start that was not fresh.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from qse.policy import Policy
from qse.replay.read_model import SEED_MS_PER_1000_TOKENS, ReadModel, ReadModelError
from qse.replay.simulator import RATION_FROM, SimOptions, simulate
from qse.replay.traces import FORMATS, Rates, TraceError, convert
from qse.replay.usage import UsageError, write_usage
from qse.settings import SETTINGS


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS, help="input format (auto: from the first line)")
    p.add_argument("--decode-tok-s", type=float, default=Rates.decode_tok_s,
                   help="served decode rate where the trace has no timing (seed's GB10: 36)")
    p.add_argument("--prefill-tok-s", type=float, default=Rates.prefill_tok_s,
                   help="served prefill rate where the trace has no timing (seed's GB10: 936)")
    p.add_argument("--max-sessions", type=int, default=None, help="only the first N sessions")


def replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qse replay", description="Replay sessions through the shadow reader's policy.")
    p.add_argument("ledger", type=Path, help="usage ledger (JSONL) or a public trace (see --format)")
    _trace_args(p)
    p.add_argument("--read-model", type=Path, default=None,
                   help='JSON with {"read_model": {"points": [[ctx, ms], ...], "grid": 512}}, or a shadow_measure result')
    p.add_argument("--read-model-preset", default=None,
                   help="row of a shadow_measure result to use (default: qwen3.5-0.8b)")
    p.add_argument("--read-model-ops", default=None,
                   help="ops of that row (naive, triton, ...), needed when the preset was measured with several")
    p.add_argument("--ms-per-1000", type=float, default=SEED_MS_PER_1000_TOKENS,
                   help="flat read rate when no --read-model (seed's GB10: 87)")
    p.add_argument("--served-read-model", type=Path, default=None,
                   help="the served model's chunk costs (the --read-model format) for its TTFT and rounds; "
                        "default: the reader's")
    p.add_argument("--served-ms-per-1000", type=float, default=None,
                   help="the served model's flat read rate, ms per 1000 tokens (instead of --served-read-model)")
    p.add_argument("--out", type=Path, default=None, help="write report.json and replay.png here")
    p.add_argument("--json-out", type=Path, default=None, help="write the report (indented JSON) to this file")
    p.add_argument("--chart", type=Path, default=None, help="write the chart (PNG) to this file")
    p.add_argument("--ration", type=float, default=None, help="reader share of the time since first token (QSE_SHADOW_RATION)")
    p.add_argument("--ration-after-s", type=float, default=None,
                   help="the ration counts from this many seconds after the first token (QSE_SHADOW_RATION_AFTER_S)")
    p.add_argument("--slice-ms", type=float, default=None, help="longest slice between decode rounds (QSE_SHADOW_SLICE_MS)")
    p.add_argument("--idle-poll-s", type=float, default=None, help="idle window poll (QSE_SHADOW_IDLE_POLL_S)")
    p.add_argument("--idle-burst-s", type=float, default=None, help="longest idle burst (QSE_SHADOW_IDLE_BURST_S)")
    p.add_argument("--grid", type=int, default=None, help="rows per chunk (QSE_SHADOW_GRID)")
    p.add_argument("--checkpoints", type=int, default=None, help="checkpoints per session (QSE_SHADOW_CHECKPOINTS)")
    p.add_argument("--prefill-share", type=float, default=0.0, help="exploratory: read during the served prefill, this share of it")
    p.add_argument("--idle-wake", choices=("on", "off"), default=None,
                   help="the idle window looks as soon as a turn ends, or at its next poll only (QSE_SHADOW_IDLE_WAKE)")
    p.add_argument("--ration-from", choices=RATION_FROM, default="first_token",
                   help="count the ration from the first token (the rule) or the turn start (the seed's first build)")
    p.add_argument("--no-checkpoint-at-line", dest="checkpoint_at_line", action="store_false",
                   help="the old reader: no prompt-end checkpoint where the reader already stands (only a chunk "
                        "ending on the line takes one)")
    p.add_argument("--recent-checkpoints", type=int, default=None,
                   help="also keep the state at the newest N grid lines read (QSE_SHADOW_RECENT_CHECKPOINTS)")
    p.add_argument("--pin-first-checkpoint", action="store_true",
                   help="exploratory: keep the lowest prompt-end checkpoint when the cap would drop it")
    p.add_argument("--divergence-checkpoints", type=int, default=None,
                   help="checkpoint the grid lines of the newest N re-render points (QSE_SHADOW_DIVERGENCE_CHECKPOINTS)")
    p.add_argument("--idle-group", type=int, default=None,
                   help="chunks an idle launch may read, as a chunk group (QSE_SHADOW_IDLE_GROUP)")
    p.add_argument("--served-rounds", action="store_true",
                   help="also serve every record on one served model in the scheduler's rounds (QSE_MAX_RUNNING, "
                        "QSE_ROUND_TOKEN_BUDGET, QSE_DECODE_YIELD_MS): the report's served_rounds gives TTFT and "
                        "tokens/s under rounds")
    p.add_argument("--decode-round-ms", type=float, default=None,
                   help="a decode round's ms for --served-rounds (default: the records' median decode ms per id)")
    p.add_argument("--slice-overhead-ms", type=float, default=None,
                   help="modelling: each reader slice's fixed cost to the decode beyond its chunks (benchmarks/NOTES.md)")
    p.add_argument("--min-slice-ms", type=float, default=None,
                   help="a slice opens once this much is earned (QSE_SHADOW_MIN_SLICE_MS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qse replay convert", description="Convert a public trace to the usage ledger.")
    p.add_argument("trace", type=Path)
    _trace_args(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="the usage ledger to write (JSONL)")
    return p


def _fail(message: str) -> int:
    print(f"qse replay: {message}", file=sys.stderr)
    return 2


def convert_main(argv: list[str]) -> int:
    args = convert_parser().parse_args(argv)
    try:
        converted = convert(args.trace, args.format, Rates(args.decode_tok_s, args.prefill_tok_s), args.max_sessions)
    except (OSError, TraceError, UsageError, ValueError) as exc:
        return _fail(str(exc))
    n = write_usage(args.output, converted.records, converted.meta)
    print(json.dumps({"ledger": str(args.output), "num_records": n, "meta": converted.meta}, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    args = replay_parser().parse_args(argv)
    try:
        if args.read_model is not None:
            read_model = ReadModel.load(args.read_model, args.read_model_preset, args.read_model_ops)
        elif args.read_model_preset is not None or args.read_model_ops is not None:
            raise ValueError("--read-model-preset and --read-model-ops need --read-model")
        else:
            read_model = ReadModel.flat(args.ms_per_1000)
        if args.served_read_model is not None and args.served_ms_per_1000 is not None:
            raise ValueError("--served-read-model and --served-ms-per-1000 name the same thing: give one")
        served_model = (ReadModel.load(args.served_read_model) if args.served_read_model is not None
                        else ReadModel.flat(args.served_ms_per_1000) if args.served_ms_per_1000 is not None
                        else None)
        # the entry point: the policy from the QSE_* switches, the flags over it
        options = SimOptions.of(
            Policy.from_settings(SETTINGS), ration=args.ration, ration_after_s=args.ration_after_s,
            slice_ms=args.slice_ms, min_slice_ms=args.min_slice_ms, slice_overhead_ms=args.slice_overhead_ms,
            idle_poll_s=args.idle_poll_s, idle_burst_s=args.idle_burst_s, grid=args.grid,
            checkpoints=args.checkpoints, prefill_share=args.prefill_share,
            idle_wake=None if args.idle_wake is None else args.idle_wake == "on",
            ration_from=args.ration_from, checkpoint_at_line=args.checkpoint_at_line,
            recent_checkpoints=args.recent_checkpoints, pin_first_checkpoint=args.pin_first_checkpoint,
            divergence_checkpoints=args.divergence_checkpoints, idle_group=args.idle_group,
            served_rounds=args.served_rounds, decode_round_ms=args.decode_round_ms)
        converted = convert(args.ledger, args.format, Rates(args.decode_tok_s, args.prefill_tok_s), args.max_sessions)
    except (OSError, TraceError, UsageError, ReadModelError, ValueError) as exc:
        return _fail(str(exc))
    show = not args.no_progress and sys.stderr.isatty() and len({r.session for r in converted.records}) >= 50
    result = simulate(converted.records, read_model, options, progress=show, served_model=served_model)
    report = result.report()
    report["command"] = shlex.join(["qse", "replay", *argv])
    report["input"] = {"path": str(args.ledger), **converted.meta}
    report["read_model"] = read_model.to_json()["read_model"]
    report["served_read_model"] = (served_model or read_model).to_json()["read_model"]
    report["engine_model"] = "one engine per session: each session replayed alone on its own served model and reader"
    if args.out is not None or args.chart is not None:
        from qse.replay.chart import ChartUnavailable, write_chart

        charts = []
        if args.out is not None:
            charts.append((args.out, "replay.png"))
        if args.chart is not None:
            charts.append((args.chart.parent, args.chart.name))
        try:
            for out_dir, name in charts:
                report["chart"] = str(write_chart(result, out_dir, name=name, title=args.ledger.name))
        except ChartUnavailable as exc:  # the report stands without its picture: write it, say how to draw it
            report["chart"] = None
            sys.stderr.write(f"qse replay: {exc}\n")
    text = json.dumps(report, indent=1, sort_keys=True) + "\n"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
