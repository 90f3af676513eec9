#!/usr/bin/env python
"""What verifying k drafted tokens costs against one decode step: the number that says whether drafting pays.

    python benchmarks/spec_measure.py [--preset qwen3.5-9b] [--context 8000] [--ks 1,2,3,4,5,6,7] [--batches 1,8]
    python benchmarks/spec_measure.py --tiny --out DIR      (the embedded model on CPU: the flow only; the MTP
                                                             rows on a tiny model with an MTP head)

The verify is the served path's own: DecodeRounds.verify reads each running sequence's token and its k drafts
(k + 1 rows a sequence, logits at every row) in one forward, its GDN rows stepped into scratch slots, and
DecodeRounds.keep makes the accepted row's state the sequence's; a decode round (DecodeRounds.run) reads one
row a sequence. Both run as CUDA graphs (one per batch bucket and width) on one KV pool over sequences of
--context tokens (random KV rows and GDN state: the cost does not depend on the values), back to back, timed
by device events. Per batch and k:
- the verify's device ms (keep included), its ratio to one decode round of the same batch;
- the oracle drafter: the drafts are the served model's own greedy continuation (taken first by plain decoding
  of the same sequences), so every draft is accepted; both loops read each step's ids back to the host as a
  server does, and their tokens/s are timed on the wall; the loops' ids are compared (on production kernels
  a verify row may round differently from a one-row step, so `oracle_ids_equal` may fail on a near-tie);
- the oracle of the verify path itself (`oracle_self_*`): the drafts are the ids the oracle loop emitted, so a
  near-tie parting cannot turn them wrong: the upper bound a drafter's accuracy allows;
- what a step would bring at the published acceptance lengths (tokens a step, the bonus token included:
  1.87, 2.50, 3.06 at k = 1, 2, 3 on a 27B-class hybrid; SGLang reports ~3.1-3.3 at k = 3 on Qwen3.5-397B and
  Qwen3-Next), as tokens per decode round's time, the drafter's own cost left out (the MTP head is one decoder
  layer: about 1/32 of the 9B a token).

MTP rows (`mtp_rows`, where the model has an MTP head; k in --mtp-ks): the rounds draft with the head themselves
(DecodeRounds(mtp=True): its KV in one more slot of the pool, every round's final hiddens tapped). A cycle is
what a step of MTP speculation costs on the device, graphed: a verify of k + 1 rows (the next token and the last
cycle's drafts, a device tensor), keep, and the head's draft (its extend over the k + 1 rows just verified, then k
drafts, argmax on the device). Per batch and k: verify_ms, draft_ms, cycle_ms (the three back to back), and the
cycle over one plain decode round of the same batch (rounds without the head); `projected_x_plain` is the
published tokens a step over that ratio, the drafts' cost included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import PAGE_ROWS, on_this_machine, random_pool, random_sequences  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import device_ms  # noqa: E402
from qse.engine.engine import DeviceClock, Engine  # noqa: E402
from qse.engine.rounds import DecodeRounds, pool_slots_for  # noqa: E402
from qse.engine.spec_check import oracle_loop, plain_loop  # noqa: E402
from qse.models import resolve  # noqa: E402

PUBLISHED_ACCEPTANCE = {1: 1.87, 2: 2.50, 3: 3.06}  # tokens a step, bonus included (the sources)


def measure_batch(engine: Engine, batch: int, ks: list[int], context: int, reps: int, steps: int,
                  clock: DeviceClock) -> list[dict]:
    cfg, device = engine.cfg, engine.device
    width = max(ks) + 1
    per_seq = -(-(context + 3 * reps + 2 * steps + width + 16) // PAGE_ROWS)
    pool, gen = random_pool(engine, batch * (per_seq + 1) + 2)
    rounds = DecodeRounds(engine, pool, max_running=batch, buckets=(batch,), verify_width=width)
    caches = random_sequences(engine, pool, batch, context, gen)
    slots = [rounds.admit(c) for c in caches]
    starts = [rounds.store(s).clone_state() for s in slots]
    host_gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, min(cfg.vocab_size, 150_000), (batch,), generator=host_gen).tolist()

    def reset() -> None:  # every loop starts from the same sequences
        for slot, cache, (rec, conv) in zip(slots, caches, starts):
            cache.set_state(rec, conv)
            cache.length = context
            rounds.states.load(slot, cache)

    tokens = torch.tensor(first, device=device)
    decode_ms = round(device_ms(lambda: rounds.run(slots, tokens), reps, clock), 4)
    reset()
    continuation, plain_s = plain_loop(rounds, slots, first, steps)
    plain_tps = round(batch * steps / plain_s, 1)
    rows = []
    for k in ks:
        reset()
        rows_in = [[t] + [0] * k for t in first]

        def verify_step() -> None:
            rounds.verify(slots, rows_in)
            rounds.keep(slots, [0] * batch)

        verify_ms = round(device_ms(verify_step, reps, clock), 4)
        ratio = round(verify_ms / decode_ms, 4)
        reset()
        oracle_ids, oracle_s = oracle_loop(rounds, slots, continuation, k, steps)
        row = {"batch": batch, "k": k, "rows": k + 1, "decode_round_ms": decode_ms, "verify_ms": verify_ms,
               "x_decode_round": ratio, "plain_tokens_per_s": plain_tps,
               "oracle_tokens_per_s": round(batch * steps / oracle_s, 1),
               "oracle_ids_equal": oracle_ids == continuation}
        row["oracle_x_plain"] = round(row["oracle_tokens_per_s"] / plain_tps, 3)
        # the oracle of the verify path itself: drafts are the ids that loop emitted, so no near-tie parting
        # between a verify row and a one-row step turns the drafts wrong (every draft is kept where the verify
        # reproduces its own ids; `self_ids_equal` says whether it did)
        reset()
        self_ids, self_s = oracle_loop(rounds, slots, oracle_ids, k, steps)
        row["oracle_self_tokens_per_s"] = round(batch * steps / self_s, 1)
        row["oracle_self_x_plain"] = round(row["oracle_self_tokens_per_s"] / plain_tps, 3)
        row["oracle_self_ids_equal"] = self_ids == oracle_ids
        if k in PUBLISHED_ACCEPTANCE:  # tokens a step over the step's cost in decode rounds, drafts not counted
            row["published_tokens_per_step"] = PUBLISHED_ACCEPTANCE[k]
            row["projected_x_plain"] = round(PUBLISHED_ACCEPTANCE[k] / ratio, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    rounds.release_all()
    return rows


def measure_mtp_batch(engine: Engine, batch: int, ks: list[int], context: int, reps: int,
                      clock: DeviceClock) -> list[dict]:
    """The MTP cycle against a plain decode round, per k (the module docstring)."""
    cfg, device = engine.cfg, engine.device
    width = max(ks) + 1
    # every timed call keeps one row a sequence (accepted 0); each measurement starts from the same lengths
    per_seq = -(-(context + 3 * (reps + 3) + 2 * width + 16) // PAGE_ROWS)
    pool, gen = random_pool(engine, batch * (per_seq + 1) + 3, pool_slots_for(cfg, mtp=True))
    caches = random_sequences(engine, pool, batch, context, gen)
    starts = [c.clone_state() for c in caches]
    host_gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, min(cfg.vocab_size, 150_000), (batch,), generator=host_gen).to(device)

    # the plain round: rounds without the head (no tap), on the same sequences
    plain = DecodeRounds(engine, pool, max_running=batch, buckets=(batch,))
    slots = [plain.admit(c) for c in caches]
    decode_ms = round(device_ms(lambda: plain.run(slots, tokens), reps, clock), 4)
    for slot in slots:
        plain.release(slot, keep=False)
    plain.release_all()

    rounds = DecodeRounds(engine, pool, max_running=batch, buckets=(batch,), verify_width=width, mtp=True)
    for cache, (rec, conv) in zip(caches, starts):
        cache.set_state(rec, conv)
        cache.length = context
    slots = [rounds.admit(c) for c in caches]
    accepted = torch.zeros(batch, dtype=torch.long, device=device)

    def reset() -> None:
        for slot, cache, (rec, conv) in zip(slots, caches, starts):
            cache.set_state(rec, conv)
            cache.length = context
            rounds.states.load(slot, cache)

    rows = []
    for k in ks:
        rows_in = torch.cat((tokens[:, None], torch.zeros(batch, k, dtype=torch.long, device=device)), 1)

        def verify_step() -> None:
            rounds.verify(slots, rows_in)
            rounds.keep(slots, [0] * batch)

        def draft_step() -> None:
            rounds.draft(slots, tokens, accepted, k=k)

        def cycle() -> None:
            verify_step()
            draft_step()

        reset()
        verify_ms = round(device_ms(verify_step, reps, clock), 4)
        draft_ms = round(device_ms(draft_step, reps, clock), 4)  # after the last verify (the head reads its rows)
        reset()
        cycle_ms = round(device_ms(cycle, reps, clock), 4)
        ratio = round(cycle_ms / decode_ms, 4)
        row = {"batch": batch, "k": k, "rows": k + 1, "decode_round_ms": decode_ms, "verify_ms": verify_ms,
               "draft_ms": draft_ms, "cycle_ms": cycle_ms, "x_decode_round": ratio}
        if k in PUBLISHED_ACCEPTANCE:  # tokens a step over the cycle's cost in decode rounds, drafts counted
            row["published_tokens_per_step"] = PUBLISHED_ACCEPTANCE[k]
            row["projected_x_plain"] = round(PUBLISHED_ACCEPTANCE[k] / ratio, 3)
        print(json.dumps({"mtp": True, **row}), flush=True)
        rows.append(row)
    for slot in slots:
        rounds.release(slot, keep=False)
    rounds.release_all()
    return rows


def has_mtp_head(engine: Engine) -> bool:
    try:
        engine.model.mtp_head()
    except (AttributeError, ValueError):  # a family without one, or a checkpoint loaded without it
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--ks", default="1,2,3,4,5,6,7", help="draft lengths k: verifies of k + 1 rows")
    p.add_argument("--batches", default="1,8", help="running sequences a verify holds")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--steps", type=int, default=96, help="tokens a sequence in the plain and oracle loops")
    p.add_argument("--mtp-ks", default="1,2,3", help="draft lengths of the MTP rows ('': none)")
    p.add_argument("--tiny", action="store_true", help="the embedded model on CPU (graphs' CPU rehearsal)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    mtp_ks = [int(k) for k in args.mtp_ks.split(",") if k.strip()]
    if any(k < 1 for k in ks + mtp_ks) or any(b < 1 for b in batches):
        p.error(f"--ks, --mtp-ks and --batches must be >= 1, got {args.ks!r}, {args.mtp_ks!r} and {args.batches!r}")
    device, dtype, cache_dir = on_this_machine()
    spec = args.preset
    if args.tiny:
        device, dtype, spec = torch.device("cpu"), torch.float32, ""
        # k = 1 and 3: the shortest verify and the one the goals read (CI runs this: a minute is its budget)
        args.context, args.reps, args.steps, batches = 100, 2, 6, [1, 2]
        ks, mtp_ks = [k for k in ks if k in (1, 3)], [k for k in mtp_ks if k in (1, 3)]
    engine = Engine(resolve(spec, device, dtype, cache_dir))
    clock = DeviceClock(device)
    rows = [row for b in batches for row in measure_batch(engine, b, ks, args.context, args.reps, args.steps, clock)]
    mtp_engine, mtp_preset = engine, spec or "embedded"
    if args.tiny:  # the embedded model has no MTP head: the head's flow on a tiny model that has one
        from benchmarks.mtp_measure import tiny_engine

        mtp_engine, mtp_preset = tiny_engine(), "tiny-mtp"
    mtp_rows = []
    if mtp_ks and has_mtp_head(mtp_engine):
        mtp_rows = [row for b in batches
                    for row in measure_mtp_batch(mtp_engine, b, mtp_ks, args.context, args.reps, clock)]
    one = {r["k"]: r for r in rows if r["batch"] == 1}
    most = max(batches)
    widest = {r["k"]: r for r in rows if r["batch"] == most}
    goals = {
        "verify_4_rows_le_1.15x_step": one[3]["x_decode_round"] <= 1.15 if 3 in one else None,
        "oracle_k3_ge_2.5x_plain_batch_1": one[3]["oracle_self_x_plain"] >= 2.5 if 3 in one else None,
        "projected_ge_1.8x_at_2.5": 2.5 / one[3]["x_decode_round"] >= 1.8 if 3 in one else None,
        f"batch_{most}_not_slower_at_2.5": (2.5 / widest[3]["x_decode_round"] >= 1.0) if 3 in widest and most > 1 else None,
    }
    result = {**result_header("triton", device=None if device.type == "cuda" else "cpu"), "preset": spec or "embedded",
              "kernels": engine.kernels, "context": args.context, "reps": args.reps, "steps": args.steps,
              "rows": rows, "goals": goals, "mtp_preset": mtp_preset if mtp_rows else None, "mtp_rows": mtp_rows}
    write_result(result, args.out, "spec_measure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
