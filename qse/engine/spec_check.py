"""`qse spec-check`: speculative greedy decoding against plain greedy decoding, token for token, on the model and
kernels the server would use; the gate of speculative decoding's exactness, with its near-tie rule.

Greedy verification emits plain decoding's ids exactly where a verify row's logits are the bits a one-row decode
round gives: on the row-invariant kernels (QSE_KERNELS=invariant), and on the production kernels wherever a round
holds 32 rows or fewer (B sequences x (k + 1) rows <= 32: rounds that verify send every call of 1 to 32 rows
through the skinny GEMM, qse_kernels.rows_alike). Past 32 rows a verify's GEMMs are cuBLAS's, which pick their
algorithm by the row count, so a row's logits differ in their last bits and the ids may part where the plain
run's top two logits are nearly tied. The gate, per sequence and drafter:

    position    0    1    2    3    4    5 ...
    plain       a    b    c    d    e    f          plain_loop: one-row rounds, each round's top TOP_K kept
    spec        a    b    c    x    .    .          spec_loop: verify and keep, the drafter's k ids a step
                               ^ the first parting: gap = plain's top-1 logit there - its logit of x
                                 (not compared past it: the two runs read different contexts from there)

Equal ids pass; a parting passes when it is a near-tie (gap <= tolerance) and fails otherwise. Position 0 is the
prefill's pick, the same on both sides; position p >= 1 is the id after the prompt and p earlier ids.

The drafters: the oracle (each sequence's plain continuation itself, so every row of every verify is checked and
all are accepted up to a parting) and prompt lookup (the server's TurnDrafts, over a prompt that repeats itself:
drafts of every acceptance length, rejected ones included). Both runs start from the same prefilled states; the
plain run goes first (the oracle's drafts are its ids).

Each run also reports the drift: at every row whose context is the plain run's (before a parting), the largest
difference between the verify row's logits and the plain round's at the plain round's top ids; and each parting
its own row's. A parting's gap is always under twice its row's drift (that is why it parted); what tells a
rounding from a fault is how its row's drift stands against the rows before it. The derived tolerance counts
only the head's last rounding; the drift measures what every layer's differing roundings add up to.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch

from .engine import Engine
from .kv import KVPool, PagedKV
from .rounds import DecodeRounds
from .speculative import accept_greedy
from .turn_drafts import TurnDrafts

DRAFTERS = ("oracle", "ngram")
# the plain run keeps each round's TOP_K logits and their ids; a speculative pick outside them is never a near-tie
# (TOP_K ids within the tolerance of the top one and the pick not among them: no rounding moves a logit that far)
TOP_K = 64
# the logit magnitude the default tolerance is scaled to: a served model's top logits are ~10
LOGIT_MAGNITUDE = 10.0
MOTIF_IDS = 64  # the repeated piece of a prompt
MUTATE_EVERY = 16  # one id in this many of each copy after the first is drawn afresh
PROMPT_ID_LIMIT = 150_000  # prompt ids are drawn below this (ordinary tokens, no specials)


class SpecCheckError(ValueError):
    """A request the check cannot run (a bad count, a window too long); the message names the value."""


def default_tolerance(dtype: torch.dtype) -> float:
    """The near-tie tolerance for a model computing in `dtype`: LOGIT_MAGNITUDE * eps / sqrt(2).

    The final hidden state the fp32 head reads is rounded to the activation dtype; a verify's rows and a one-row
    round compute it by different algorithms, so their roundings differ, relatively, by up to eps (one unit in
    the last place; half of it on average) in every element. The head sums those elements, so a logit of
    magnitude L moves by about L * eps / 2, and the gap between two logits, each moved independently, by sqrt(2)
    times that: L * eps / sqrt(2), 0.055 for bf16 (eps 2^-7) at L = 10, 0.0069 for fp16. The head's own fp32
    output rounding bounds it below (float64 activations: fp32's eps)."""
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    return LOGIT_MAGNITUDE * eps / math.sqrt(2.0)


def check_request(num_sequences: int, context: int, steps: int, k: int, tolerance: float | None = None,
                  drafters: Sequence[str] = DRAFTERS) -> None:
    """Raise SpecCheckError, naming the value, unless the counts are positive, the tolerance is finite and not
    negative, and the drafters are known."""
    for name, value in (("sequences", num_sequences), ("context", context), ("steps", steps), ("k", k)):
        if not (isinstance(value, int) and value >= 1):
            raise SpecCheckError(f"--{name} must be an integer >= 1, got {value!r}")
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise SpecCheckError(f"--tolerance must be a finite logit gap >= 0, got {tolerance!r}")
    unknown = [d for d in drafters if d not in DRAFTERS]
    if unknown or not drafters:
        raise SpecCheckError(f"--drafter must name {' or '.join(DRAFTERS)}, got {list(drafters)!r}")


def repetitive_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` ids: a random motif of MOTIF_IDS ids repeated, one id in MUTATE_EVERY of each later copy drawn
    afresh (prompt lookup finds earlier copies, at n-grams of every length; a model continues it, not certainly)."""
    gen = torch.Generator().manual_seed(seed)
    limit = min(vocab_size, PROMPT_ID_LIMIT)
    motif = torch.randint(0, limit, (MOTIF_IDS,), generator=gen)
    ids = motif.repeat(-(-length // MOTIF_IDS))[:length]
    fresh = torch.rand(length, generator=gen) < 1.0 / MUTATE_EVERY
    fresh[:MOTIF_IDS] = False
    ids[fresh] = torch.randint(0, limit, (int(fresh.sum()),), generator=gen)
    return ids.tolist()


# ---- the loops (benchmarks/spec_measure.py times them) --------------------------------------------------------
def plain_loop(rounds: DecodeRounds, slots: list[int], first: list[int], steps: int,
               on_logits: Callable[[int, torch.Tensor], None] | None = None) -> tuple[list[list[int]], float]:
    """Greedy decoding by one-row rounds, each round's ids read back: every sequence's ids (first, then `steps`
    more) and the wall s. on_logits(step, logits [B, vocab]) sees each round's logits before its argmax."""
    ids, out = list(first), [[t] for t in first]
    t0 = time.perf_counter()
    for step in range(steps):
        logits = rounds.run(slots, ids)
        if on_logits is not None:
            on_logits(step, logits)
        ids = logits.argmax(-1).tolist()
        for row, token in zip(out, ids):
            row.append(token)
    return out, time.perf_counter() - t0


# propose(i, ids): sequence i's drafts after its ids so far (any number; spec_loop pads or cuts them to k)
Propose = Callable[[int, list[int]], list[int]]
# on_verify(logits [B, k + 1, vocab], ids before the step, drafts, accepted, next ids)
OnVerify = Callable[[torch.Tensor, list[list[int]], list[list[int]], list[int], list[int]], None]


def spec_loop(rounds: DecodeRounds, slots: list[int], first: list[int], propose: Propose, k: int, steps: int,
              on_verify: OnVerify | None = None) -> tuple[list[list[int]], float]:
    """Greedy decoding by verify and keep, k drafts a sequence a step (short proposals padded with id 0: a draft
    only decides how many ids a verify yields): every sequence's ids (first, then `steps` more) and the wall s."""
    out = [[t] for t in first]
    t0 = time.perf_counter()
    while min(len(o) for o in out) <= steps:
        drafts = [(list(propose(i, o)) + [0] * k)[:k] for i, o in enumerate(out)]
        logits = rounds.verify(slots, [[o[-1]] + d for o, d in zip(out, drafts)])
        accepted, nxt = accept_greedy(torch.tensor(drafts, device=logits.device), logits.argmax(-1))
        accepted, nxt = accepted.tolist(), nxt.tolist()  # one read back a step, as a server's
        if on_verify is not None:
            on_verify(logits, out, drafts, accepted, nxt)
        rounds.keep(slots, accepted)
        for o, d, a, n in zip(out, drafts, accepted, nxt):
            o += d[:a] + [n]
    return [o[: steps + 1] for o in out], time.perf_counter() - t0


def oracle_drafts(continuation: list[list[int]], k: int) -> Propose:
    """Each sequence's next k ids of its plain continuation (fewer at its end)."""
    return lambda i, ids: continuation[i][len(ids): len(ids) + k]


def oracle_loop(rounds: DecodeRounds, slots: list[int], continuation: list[list[int]], k: int,
                steps: int) -> tuple[list[list[int]], float]:
    """spec_loop with the oracle's drafts: each sequence's plain continuation, so every draft is accepted (where
    a verify row picks what the one-row round picked)."""
    return spec_loop(rounds, slots, [c[0] for c in continuation], oracle_drafts(continuation, k), k, steps)


def lookup_drafts(prompts: list[list[int]], k: int) -> Propose:
    """The server's drafts of a turn without a prediction (TurnDrafts: prompt lookup over its prompt and output)."""
    turns = [TurnDrafts(p, k) for p in prompts]

    def propose(i: int, ids: list[int]) -> list[int]:
        turn = turns[i]
        turn.append(ids[len(turn.output):])
        return turn.propose()

    return propose


def first_parting(plain: Sequence[int], spec: Sequence[int]) -> int | None:
    """The first position where the two runs' ids differ; None where they are equal."""
    return next((p for p, (a, b) in enumerate(zip(plain, spec)) if a != b), None)


# ---- the check ---------------------------------------------------------------------------------------------
def run_spec_check(engine: Engine, num_sequences: int = 8, context: int = 512, steps: int = 128, k: int = 3,
                   drafters: Sequence[str] = DRAFTERS, tolerance: float | None = None, page_rows: int = 512,
                   graphs: bool | None = None, seed: int = 0) -> dict[str, Any]:
    """Plain greedy decoding and speculative decoding (each drafter in turn) of `num_sequences` sequences, each
    after its own repetitive prompt of `context` ids, `steps` ids after the prefill's; the report (`pass`: no
    parting that is not a near-tie). tolerance: the near-tie gap (None: default_tolerance of the engine's
    dtype). page_rows: the KV pages' rows (the server's: its grid); graphs: as DecodeRounds'."""
    check_request(num_sequences, context, steps, k, tolerance, drafters)
    if not page_rows >= 1:
        raise SpecCheckError(f"page_rows must be >= 1, got {page_rows!r}")
    window = engine.cfg.max_position_embeddings
    if context + steps + k + 2 > window:
        raise SpecCheckError(f"--context {context} + --steps {steps} + --k {k} + 2 rows exceed the model window "
                             f"({window}): ask for fewer")
    tol = default_tolerance(engine.dtype) if tolerance is None else float(tolerance)
    with torch.inference_mode():
        rig = _Rig(engine, num_sequences, context, steps, k, page_rows, graphs, seed)
        try:
            t0 = time.perf_counter()
            plain, tops = rig.plain()
            plain_s = time.perf_counter() - t0
            runs = [rig.spec(name, plain, tops, tol) for name in drafters]
        finally:
            rig.close()
    partings = [p for run in runs for p in run["partings"]]
    return {
        "model": engine.name, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "kernels": engine.kernels, "graphs": rig.rounds.capture, "sequences": num_sequences, "context": context,
        "steps": steps, "k": k, "drafters": list(drafters), "tolerance": tol,
        "tolerance_source": "default" if tolerance is None else "flag",
        "tokens_compared": sum(run["tokens_compared"] for run in runs),
        "equal_sequences": sum(run["equal_sequences"] for run in runs),
        "sequences_compared": num_sequences * len(runs),
        "near_ties": sum(p["near_tie"] for p in partings),
        "partings": partings, "pass": all(p["near_tie"] for p in partings),
        "max_drift": max(run["drift"]["max"] for run in runs),
        "plain_wall_s": round(plain_s, 3), "runs": runs,
    }


class _Rig:
    """The sequences prefilled into one KV pool, admitted to one DecodeRounds; `reset` puts every sequence back
    at its prompt's end (the prompt's KV rows stay; rows above it are written again)."""

    def __init__(self, engine: Engine, num_sequences: int, context: int, steps: int, k: int, page_rows: int,
                 graphs: bool | None, seed: int):
        cfg = engine.cfg
        self.engine, self.steps, self.k, self.context = engine, steps, k, context
        # a sequence's rows: its prompt, its ids, and the last verify's rows past them
        per_seq = -(-(context + steps + 2 * (k + 1) + 1) // page_rows)
        pool = KVPool(num_sequences * per_seq + 2, page_rows, len(cfg.attention_layers), cfg.num_key_value_heads,
                      cfg.head_dim, engine.dtype, engine.device)
        self.rounds = DecodeRounds(engine, pool, max_running=num_sequences, graphs=graphs, verify_width=k + 1)
        self.prompts = [repetitive_prompt(context, cfg.vocab_size, seed + i) for i in range(num_sequences)]
        self.caches, self.first = [], []
        for prompt in self.prompts:
            cache = engine.new_cache(kv=PagedKV(pool))
            logits, _ = engine.prefill(cache, engine.host_ids(prompt), page_rows)
            self.first.append(int(logits[-1].argmax()))
            self.caches.append(cache)
        self.slots = [self.rounds.admit(c) for c in self.caches]
        self.starts = [self.rounds.store(s).clone_state() for s in self.slots]

    def reset(self) -> None:
        for slot, cache, (rec, conv) in zip(self.slots, self.caches, self.starts):
            cache.set_state(rec, conv)
            cache.length = self.context
            self.rounds.states.load(slot, cache)

    def plain(self) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor]]:
        """The plain run's ids and its rounds' top logits and ids, host [steps, B, TOP_K] each."""
        self.reset()
        values, ids = [], []
        top = min(TOP_K, self.engine.cfg.vocab_size)

        def keep_top(step: int, logits: torch.Tensor) -> None:
            v, i = logits.float().topk(top, dim=-1)
            values.append(v)
            ids.append(i)

        out, _ = plain_loop(self.rounds, self.slots, self.first, self.steps, keep_top)
        return out, (torch.stack(values).cpu(), torch.stack(ids).cpu())

    def spec(self, drafter: str, plain: list[list[int]], tops: tuple[torch.Tensor, torch.Tensor],
             tol: float) -> dict[str, Any]:
        """One drafter's speculative run against the plain one: its partings and counts."""
        self.reset()
        k, steps = self.k, self.steps
        propose = oracle_drafts(plain, k) if drafter == "oracle" else lookup_drafts(self.prompts, k)
        spec_gaps: dict[int, float] = {}  # sequence -> its verify row's own gap at the parting
        row_drifts: dict[int, float] = {}  # sequence -> the drift at its parting's row
        drifts: list[float] = []  # the drift at every row before a parting (the two paths' usual difference)
        counts = {"verifies": 0, "ids": 0}
        values, top_ids = tops

        def drift(logits_row: torch.Tensor, i: int, pos: int) -> float:
            """The largest difference between this verify row's logits and the plain round's at the plain
            round's top ids, for the same position after the same ids."""
            ids = top_ids[pos - 1, i].to(logits_row.device)
            return float((logits_row.float().index_select(0, ids).cpu() - values[pos - 1, i]).abs().max())

        def watch(logits, before, drafts, accepted, nxt) -> None:
            counts["verifies"] += 1
            counts["ids"] += sum(accepted) + len(accepted)
            for i, (ids, d, a, n) in enumerate(zip(before, drafts, accepted, nxt)):
                if i in spec_gaps:
                    continue
                for row, token in enumerate(d[:a] + [n]):
                    pos = len(ids) + row
                    if pos > steps:
                        break
                    # the row read the plain run's ids up to pos (the rows before it matched them)
                    if token != plain[i][pos]:  # the verify's margin of its pick over the plain id
                        spec_gaps[i] = float(logits[i, row, token] - logits[i, row, plain[i][pos]])
                        row_drifts[i] = drift(logits[i, row], i, pos)
                        break
                    drifts.append(drift(logits[i, row], i, pos))

        t0 = time.perf_counter()
        spec, _ = spec_loop(self.rounds, self.slots, self.first, propose, k, steps, watch)
        wall_s = time.perf_counter() - t0
        partings, compared = [], 0
        for i, (want, got) in enumerate(zip(plain, spec)):
            pos = first_parting(want, got)
            if pos is None:
                compared += steps
                continue
            compared += pos
            # the plain round that picked position pos read position pos - 1
            row_values, row_ids = values[pos - 1, i], top_ids[pos - 1, i]
            where = (row_ids == got[pos]).nonzero()
            bound = not len(where)
            gap = float(row_values[0] - (row_values[-1] if bound else row_values[int(where[0])]))
            partings.append({"drafter": drafter, "sequence": i, "position": pos, "plain_id": want[pos],
                             "spec_id": got[pos], "gap": gap, "gap_is_lower_bound": bound,
                             "spec_gap": spec_gaps.get(i), "row_drift": row_drifts.get(i), "tolerance": tol,
                             "near_tie": not bound and gap <= tol})
        return {"drafter": drafter, "equal_sequences": len(plain) - len(partings), "tokens_compared": compared,
                "verifies": counts["verifies"],
                # ids a sequence takes from a verify: its accepted drafts and the next id
                "ids_per_verify": round(counts["ids"] / max(1, counts["verifies"] * len(plain)), 3),
                "wall_s": round(wall_s, 3), "partings": partings,
                # how far the verify's logits stood from the plain run's at the rows both read alike (the plain
                # run's top ids): the numbers a near-tie tolerance for these kernels should be read from
                "drift": {"rows": len(drifts), "max": max(drifts, default=0.0),
                          "median": float(torch.tensor(drifts).median()) if drifts else 0.0}}

    def close(self) -> None:
        for slot in self.slots:
            self.rounds.release(slot, keep=False)
        self.rounds.release_all()


__all__ = ["DRAFTERS", "SpecCheckError", "check_request", "default_tolerance", "first_parting", "lookup_drafts",
           "oracle_drafts", "oracle_loop", "plain_loop", "repetitive_prompt", "run_spec_check", "spec_loop"]
