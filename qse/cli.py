"""`qse`: the command line. Every command but `serve` prints one JSON object on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .policy import Policy
from .settings import SETTINGS, SHIPPED_CONFIG, SettingError


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"qse: error: {message}\n")
    return code


def _load(spec: str, device: str, dtype: str, kernels: str = ""):
    """The engine over model `spec`; kernels: the op set (empty: the policy's, QSE_KERNELS)."""
    from .engine.engine import Engine
    from .models import pick_device, pick_dtype, resolve

    dev = pick_device(device)
    resolved = resolve(spec, dev, pick_dtype(dtype, dev), SETTINGS.cache_dir())
    policy = _policy()
    return Engine(resolved, kernels=kernels or policy.kernels, pdl=policy.pdl)


def _policy() -> Policy:
    """The commands' policy: read from the QSE_* switches here, at the entry point, and handed down."""
    return Policy.from_settings(SETTINGS)


def cmd_settings(args: argparse.Namespace) -> int:
    # config_dir: the serve.env and profiles shipped with qse, to copy from when installed from a wheel
    _emit({"settings": SETTINGS.table(), "config_dir": str(SHIPPED_CONFIG)})
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .engine.sampling import Sampler, SamplingParams

    engine = _load(args.model, args.device, args.dtype)
    chat = engine.chat
    if not args.prompt:
        return _fail("--prompt is empty: give the text to answer")
    prompt = chat.render([{"role": "user", "content": args.prompt}], enable_thinking=not args.no_think)
    ids = chat.tokenizer.encode(prompt)
    sampler = Sampler(SamplingParams(temperature=args.temperature, seed=args.seed), chat.tokenizer.vocab_size)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits, prefill_ms = engine.prefill(cache, torch.tensor(ids), SETTINGS.get("QSE_SERVED_GRID"))
    out: list[int] = []
    decode_ms = 0.0
    for _ in range(args.max_tokens):
        token = sampler(logits[-1])
        if token in chat.stop_ids:
            break
        out.append(token)
        if len(out) == args.max_tokens:
            break
        logits, ms = engine.forward(cache, torch.tensor([token]), "last")
        decode_ms += ms
    text = chat.tokenizer.decode(out)
    parsed = chat.parse(text, prompt)
    _emit({"model": engine.name, "prompt_tokens": len(ids), "output_tokens": len(out), "token_ids": out, "text": text,
           "reasoning": parsed.reasoning, "content": parsed.content, "prefill_ms": round(prefill_ms, 3),
           "decode_ms_per_token": round(decode_ms / max(1, len(out) - 1), 3),
           "wall_s": round(time.perf_counter() - t0, 3)})
    return 0


def cmd_refcheck(args: argparse.Namespace) -> int:
    from .models.refcheck import run_refcheck

    _emit(run_refcheck(args.model, args.device, args.dtype, args.positions, args.seed, args.chunk,
                       cache_dir=SETTINGS.cache_dir()))
    return 0


def cmd_shadow_check(args: argparse.Namespace) -> int:
    from .shadow.check import run_shadow_check

    engine = _load(args.model, args.device, args.dtype)
    policy = _policy()
    _emit(run_shadow_check(engine, Path(args.session), args.grid or policy.grid, args.probes, pool_gb=args.pool_gb,
                           noise_floor=args.noise_floor, chunk_group=policy.chunk_group))
    return 0


def cmd_cache_check(args: argparse.Namespace) -> int:
    from .sessions.check import run_cache_check

    engine = _load(args.model, args.device, args.dtype)
    grid = args.grid or _policy().served_grid
    if args.edit_every < 0:
        raise SystemExit(f"qse cache-check: --edit-every must be >= 0, got {args.edit_every}")
    group = args.chunk_group or _policy().served_chunk_group
    if group < 1:
        raise SystemExit(f"qse cache-check: --chunk-group must be >= 1 chunks, got {group}")
    _emit(run_cache_check(engine, Path(args.session), grid, decode_tokens=args.decode_tokens,
                          edit_every=args.edit_every, chunk_group=group))
    return 0


def cmd_spec_check(args: argparse.Namespace) -> int:
    from .engine.spec_check import check_request, run_spec_check

    policy = _policy()
    drafters = ["oracle", "ngram"] if args.drafter == "both" else [args.drafter]
    k = policy.spec_draft if args.k is None else args.k
    check_request(args.sequences, args.context, args.steps, k, args.tolerance, drafters)  # before the model loads
    engine = _load(args.model, args.device, args.dtype, args.kernels)
    report = run_spec_check(engine, args.sequences, args.context, args.steps, k, drafters, args.tolerance,
                            page_rows=policy.served_grid, graphs=None if policy.served_graphs else False,
                            seed=args.seed)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    _emit(report)
    return 0 if report["pass"] else 1


def _parked_ids(sessions_dir: str) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every parked session's ids by session id (qse/store/disk.py's files; only the ids, checked against their
    hash: another reader's fingerprints do not matter to router-eval), and the unreadable files by reason."""
    from collections import Counter

    from .store import disk

    root = Path(sessions_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no parked sessions at {root}: give the reader's disk tier (QSE_SHADOW_DISK)")
    ids_of: dict[str, list[int]] = {}
    misses: Counter = Counter()
    for path in sorted(root.iterdir()):
        if not path.name.endswith(disk.SUFFIX) or disk.is_temp_name(path.name):
            continue
        try:
            header = disk.read_header(path)
            ids = disk.read_tensors(header, ["ids"])["ids"]
            if disk.tensor_sha256(ids) != header.meta.get("ids_sha256"):
                raise disk.FileMiss("checksum", "the ids do not match their hash")
        except disk.FileMiss as miss:
            misses[miss.reason] += 1
            continue
        ids_of[header.meta.get("session_id", path.name)] = [int(i) for i in ids.tolist()]
    return ids_of, dict(misses)


def cmd_router_eval(args: argparse.Namespace) -> int:
    from .runtime.router import ROUTER_CLASSES, ROUTER_QUESTION
    from .shadow.reader import ShadowReader
    from .shadow.router_eval import Question, evaluate, parse_mapping, question_ids, read_journal

    if args.question and not args.classes:
        return _fail("--question needs --classes: the classes its letters A, B, ... stand for")
    classes = [c.strip() for c in args.classes.split(",")] if args.classes else list(ROUTER_CLASSES)
    if args.question:
        question = Question(args.question, tuple(classes))
    else:  # the live question's instruction over these classes (the live question itself by default)
        question = Question.listing(ROUTER_QUESTION.split(" Classes: ")[0], classes)
    mapping = parse_mapping(args.map)
    entries = read_journal(args.journal)
    ids_of, misses = _parked_ids(args.sessions)
    engine = _load(args.model, args.device, args.dtype)
    grid = args.grid or _policy().grid
    longest = max((len(ids) for ids in ids_of.values()), default=0)
    # room for the longest session and its fork (the question, padded), in whole pages
    pool_bytes = int(args.pool_gb * (1 << 30)) or engine.state_bytes_per_token() * (longest + 4 * grid + 4096)
    reader = ShadowReader(engine, grid=grid, pool_bytes=pool_bytes)
    t0 = time.perf_counter()
    out = evaluate(reader, question, question_ids(engine.chat, question), entries, ids_of, mapping)
    _emit({"model": engine.name, "grid": grid, "journal": str(args.journal), "sessions": str(args.sessions),
           "parked_files": len(ids_of), "file_misses": misses, "question": question.text, **out,
           "wall_s": round(time.perf_counter() - t0, 3)})
    return 0


def cmd_quality_gate(args: argparse.Namespace) -> int:
    from .models.quality import default_text, run_quality_gate, thresholds_for

    if not args.reference:
        return _fail("--reference is empty: give the BF16 checkpoint the FP8 weights were made from")
    thresholds, source = thresholds_for(args.model, args.max_kl, args.min_top1)
    quantised = _load(args.model, args.device, args.dtype)
    reference = _load(args.reference, args.device, args.dtype)
    text = Path(args.text).read_text() if args.text else default_text()
    ids = quantised.chat.tokenizer.encode(text)[: args.positions]
    report = run_quality_gate(quantised, reference, ids, thresholds, args.chunk)
    _emit({"model": quantised.name, "reference": reference.name, "kernels": quantised.kernels,
           "text": args.text or "qse/data", "threshold_source": source, **report})
    return 0 if report["pass"] else 1


def cmd_serve(args: list[str]) -> int:
    from .server.cli import serve_main

    return serve_main(args)


def cmd_replay(args: list[str]) -> int:
    from .replay.cli import main as replay_main

    return replay_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qse", description="Serve Qwen3.5 hybrid models with an exact shadow reader.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start the OpenAI-compatible server (qse serve --help)", add_help=False)
    sub.add_parser("replay", help="replay a usage ledger through the conductor's decisions (qse replay --help)", add_help=False)
    sub.add_parser("settings", help="print every QSE_* switch").set_defaults(fn=cmd_settings)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default=SETTINGS.get("QSE_MODEL"), help="checkpoint dir or preset; empty: the embedded default")
        sp.add_argument("--device", default=SETTINGS.get("QSE_DEVICE"))
        sp.add_argument("--dtype", default=SETTINGS.get("QSE_DTYPE"))

    g = sub.add_parser("generate", help="greedy decode through the chat template")
    model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-think", action="store_true", help="render with enable_thinking=false")
    g.set_defaults(fn=cmd_generate)

    r = sub.add_parser("refcheck", help="teacher-forced comparison with transformers' Qwen3_5ForCausalLM")
    model_args(r)
    r.add_argument("--positions", type=int, default=256)
    r.add_argument("--chunk", type=int, default=0, help="also read in chunks of this size with carried state")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(fn=cmd_refcheck)

    s = sub.add_parser("shadow-check", help="feed a session turn by turn, compare with one fresh prefill")
    model_args(s)
    s.add_argument("--session", required=True, help="JSONL, one turn a line")
    s.add_argument("--grid", type=int, default=0)
    s.add_argument("--probes", type=int, default=8)
    s.add_argument("--pool-gb", type=float, default=0.0, help="KV pool size; default fits the session")
    s.add_argument("--noise-floor", action="store_true",
                   help="also read the session with the same weights in fp32 (torch ops) and report each probe's "
                        "KL between the two dtypes: the rounding noise the grid's KL compares with")
    s.set_defaults(fn=cmd_shadow_check)

    c = sub.add_parser("cache-check", help="feed a session through the served model's turns across the cache's "
                       "tiers; every turn's first token and kept state against a cold prefill")
    model_args(c)
    c.add_argument("--session", required=True, help="JSONL, one turn a line (the format of shadow-check)")
    c.add_argument("--grid", type=int, default=0, help="default QSE_SERVED_GRID")
    c.add_argument("--chunk-group", type=int, default=0,
                   help="chunks a served launch may read (default QSE_SERVED_CHUNK_GROUP); the cold prefill reads one at a time")
    c.add_argument("--decode-tokens", type=int, default=4, help="greedy tokens compared after the first")
    c.add_argument("--edit-every", type=int, default=3,
                   help="an edited copy of every N-th turn goes first (ids dropped below the kept line: a rollback); 0: none")
    c.set_defaults(fn=cmd_cache_check)

    v = sub.add_parser("spec-check", help="speculative greedy decoding against plain greedy decoding, token for "
                       "token; exit 1 on a parting that is not a near-tie")
    model_args(v)
    v.add_argument("--kernels", default="", help="naive, triton, invariant or auto (default QSE_KERNELS: the server's)")
    v.add_argument("--sequences", type=int, default=8, help="sequences decoded together")
    v.add_argument("--context", type=int, default=512, help="ids of each sequence's prompt (a repeated random motif)")
    v.add_argument("--steps", type=int, default=128, help="ids compared a sequence after the prefill's")
    v.add_argument("--k", type=int, default=None, help="drafts a verify (default QSE_SPEC_DRAFT)")
    v.add_argument("--drafter", default="both", choices=["oracle", "ngram", "both"],
                   help="oracle: the plain continuation (every row verified); ngram: the server's prompt lookup")
    v.add_argument("--tolerance", type=float, default=None,
                   help="near-tie logit gap (default: 10 x the dtype's eps / sqrt 2, 0.055 for bf16)")
    v.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    v.add_argument("--out", "--json", dest="out", default="", help="also write the report to this file")
    v.set_defaults(fn=cmd_spec_check)

    e = sub.add_parser("router-eval", help="ask the journaled router questions again with another reader or question")
    model_args(e)
    e.set_defaults(model=SETTINGS.get("QSE_SHADOW_MODEL") or SETTINGS.get("QSE_MODEL"))
    e.add_argument("--journal", required=True, help="the shadow journal (shadow.jsonl) or its directory")
    e.add_argument("--sessions", required=True, help="the parked sessions' directory (the reader's disk tier)")
    e.add_argument("--classes", default="", help="comma-separated classes (letters A, B, ...); default: the live router's")
    e.add_argument("--question", default="", help="the whole question text (needs --classes); default: the live "
                                                  "router's instruction listing the classes")
    e.add_argument("--map", default="", help="journal class -> question class, e.g. code_edit=code,debug=code,*=other")
    e.add_argument("--grid", type=int, default=0, help="rows per chunk (default QSE_SHADOW_GRID: the live reader's)")
    e.add_argument("--pool-gb", type=float, default=0.0, help="KV pool size; default fits the longest session")
    e.set_defaults(fn=cmd_router_eval)

    q = sub.add_parser("quality-gate", help="FP8 weights against the weights they were made from: KL and top-1 "
                                            "agreement, teacher-forced; exit 1 below the weight set's thresholds")
    model_args(q)
    q.add_argument("--reference", default="", help="the checkpoint the FP8 weights were made from (BF16)")
    q.add_argument("--text", default="", help="a text file to read teacher-forced (default: qse's data files)")
    q.add_argument("--positions", type=int, default=1024)
    q.add_argument("--chunk", type=int, default=256, help="positions a forward")
    q.add_argument("--max-kl", type=float, default=None, help="mean KL allowed, nats (default: the weight set's)")
    q.add_argument("--min-top1", type=float, default=None, help="top-1 agreement required (default: the weight set's)")
    q.set_defaults(fn=cmd_quality_gate)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    if argv and argv[0] == "replay":
        return cmd_replay(argv[1:])
    args = build_parser().parse_args(argv)
    import structlog

    # stdout carries the command's one JSON object: log events (the store's, the reader's) go to stderr
    structlog.configure(logger_factory=lambda *args: structlog.PrintLogger(sys.stderr))  # sys.stderr of the moment
    try:
        return args.fn(args)
    except (ValueError, KeyError, FileNotFoundError, SettingError, MemoryError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return _fail(str(message))


if __name__ == "__main__":
    raise SystemExit(main())
