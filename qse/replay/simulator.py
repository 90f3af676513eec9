"""Replay sessions through qse/core's decisions on a virtual clock.

Each session of a usage ledger is replayed on its own engine (the served model serves only that
session, as for one agent or one user): its turns arrive as recorded, the served model prefills
from arrival to first token and decodes to the end, and the reader reads the session in whole grid
chunks whenever the conductor's own scheduler (qse/core/scheduler.py) lets it: the replay feeds it the
events the conductor feeds it (a turn arrives, a round ends, the idle window looks, a read ends, a turn
ends) on the virtual clock and carries out its actions through the same `PlanDriver` loop the runtime
runs, charging the same `GpuLedger`. With `served_rounds`, every record is also served on one served model
in the scheduler's rounds (qse/replay/rounds.py), for the served TTFT and tokens/s under rounds. A chunk
costs what the read model says at its context; the estimator learns from those costs, so decisions
are taken on estimates and accounted on "measurements", as in the server. The replay reads one chunk
at a time; the server launches the next chunk while the device runs the one before (`ReaderPlan.lookahead`),
which hides the host's launch (not in the read model, whose costs are device time between marks) and
takes the same decisions wherever a chunk costs what it was estimated to.

Time the reader takes from the served model pushes the rest of the session later (the client waits
for the answer): a slice between decode rounds lengthens the turn, and a request that arrives during
an idle chunk starts when that chunk ends.

A turn start is where freshness is measured. The new prompt keeps what the session held before it
up to `shared_prefix_tokens`; when the whole previous prompt is shared, the previous output is taken
as kept too (inside a tool loop the template re-renders it verbatim), capped at the new prompt.
If the reader had read past what is kept, it goes back to its newest checkpoint at or below, or to 0.
Which checkpoints a session holds, and where it goes back to, the session's checkpoint book decides
(qse/core/checkpoints.py: the reader's and the served model's own rules, not a copy of them); the
replay only tells it what was fed and read. Behind = kept - read after that; fresh = behind < grid. A session's first turn holds nothing before it and is fresh by
definition; the report gives both all turn starts and follow-up turns only, and the cause of every
miss (`MISS_CAUSES`).

The policy is the runtime's own object (`SimOptions.policy`, a qse/policy.py `Policy`, whose defaults are the
settings registry's): the replay and the conductor cannot drift apart on a default.

Policy switches: `ration_after_s` (the ration counts from that many seconds after the first token,
as the runtime's QSE_SHADOW_RATION_AFTER_S: a shorter turn's decode loses nothing and its backlog
waits for the idle window; 0 counts from the first token), `ration_from="turn_start"` (the seed's
first build, to show its decode loss), `prefill_share` (read during the served prefill, this share
of its time: the first token comes later, the decode is untouched); the last two are off by default.
The policy's `idle_wake` (QSE_SHADOW_IDLE_WAKE, on) has the idle window look the moment a turn ends instead
of at its next poll, as the runtime's does when its round loop ends.

Checkpoint switches: `checkpoint_at_line` (take the prompt end's checkpoint at once when the reader
already stands on that line, not only when a chunk ends there; on, as the runtime's reader does),
`recent_checkpoints` (also keep the state at the newest N grid lines read, a ring beside the
prompt-end checkpoints; 4, QSE_SHADOW_RECENT_CHECKPOINTS), `divergence_checkpoints` (the grid line
at or below each of the newest N places where a prompt re-rendered becomes a checkpoint line too, in
N slots of its own: the re-read after the rollback takes it, and the next re-render at the same
place finds it; 0, QSE_SHADOW_DIVERGENCE_CHECKPOINTS), both the runtime reader's options too, and
`pin_first_checkpoint` (the simulator's only: the lowest prompt-end checkpoint is kept when the cap
would drop it). Each checkpoint costs one recurrent state (19,537,920 bytes on the 0.8B) and a
device copy of it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Iterable, NamedTuple

import msgspec

from qse.core import (ChunkCostEstimator, DriveResult, GpuLedger, PlanDriver, Role, SessionBacklog, Stop,
                      TurnRation, Window, plan_read, whole_chunks)
from qse.core.plan import is_fresh
from qse.core.checkpoints import Change, CheckpointBook, CheckpointRules
from qse.core.plan import check_group
from qse.core.scheduler import (Arrived, Busy, IdleOpened, IdlePoll, OpenIdle, ReadEnded, ReadPlan, RoundEnded,
                                Scheduler, SliceView, TurnEnded)
from qse.policy import Policy
from qse.replay.read_model import ReadModel, group_share
from qse.replay.rounds import DecodeCost, RoundsResult, simulate_rounds
from qse.replay.usage import UsageRecord, sessions_of

RATION_FROM = ("first_token", "turn_start")
SHORT_PROMPT_KEPT = ("prompt", "previous_prompt")
CHECKPOINT_BYTES_0_8B = 19_537_920  # one recurrent + conv state of the 0.8B (TARGETS.md)
GOAL_FRESH_SHARE = 0.95  # TARGETS.md: fresh at >= 95 % of turn starts, p90 <= 512 tokens behind
GOAL_BEHIND_P90 = 512

# Why a follow-up turn start was not fresh (one cause each; decided in `_SessionReplay._turn_start`)
MISS_CAUSES = {
    "rollback_below_oldest_checkpoint": ("the new prompt re-renders below every checkpoint (or there is "
                                         "none): the reader goes back to row 0; it had read far enough"),
    "rollback_below_newest_checkpoint": ("the new prompt re-renders below the newest checkpoint: the reader goes "
                                         "back to an older one more than a chunk below; it had read far enough"),
    "rollback_above_newest_checkpoint": ("the new prompt re-renders above the newest checkpoint (the reader had "
                                         "read past it, mostly into the previous output), which is more than a "
                                         "chunk below the re-render; it had read far enough"),
    "rollback_and_backlog": "a rollback, but the reader was a chunk or more behind even without it",
    "backlog_exceeds_idle_gap": ("no rollback; the unread chunks at the previous turn's end cost more GPU time "
                                 "(read model) than the idle gap until this turn arrived"),
    "backlog_idle_gap_unused": ("no rollback; the idle gap would have been long enough for the unread chunks, "
                                "the windows did not use all of it (poll latency, burst ends, estimates)"),
}


@dataclass(frozen=True)
class SimOptions:
    """The runtime's policy (the conductor's own object, with its defaults) and the replay's modelling switches.

    `SimOptions.of(ration_after_s=0.0, prefill_share=0.02)` sorts keyword values between the two."""

    policy: Policy = field(default_factory=Policy)  # ration, windows, grid, checkpoints: what the runtime runs
    # the estimator's prior: the read model's cost at context 0 (True), or the policy's chunk_prior_ms
    prior_from_read_model: bool = True
    estimator_bucket_tokens: int = 4096
    output_kept: bool = True  # modelling: a fully shared previous prompt keeps its output too
    # modelling, when a fully shared prompt is shorter than the previous prompt + output (the output was not
    # kept whole; where it was re-rendered the traces do not say): "prompt" keeps the whole new prompt (the
    # latest place it can be), "previous_prompt" keeps only the previous prompt (the earliest)
    short_prompt_kept: str = "prompt"
    # policy switches the runtime does not have (off by default)
    ration_from: str = "first_token"
    prefill_share: float = 0.0
    # checkpoint switches (as the runtime's reader by default)
    checkpoint_at_line: bool = True  # the runtime's reader does this since 2026-11-29
    pin_first_checkpoint: bool = False
    # the served rounds over all records at once on one served model (simulate_rounds; off by default: a
    # public trace of many users on one model is an overload study that takes minutes); a decode round's ms,
    # None: the records' median decode time per output id (no record with a first token: no rounds)
    served_rounds: bool = False
    decode_round_ms: float | None = None
    # modelling: what each of the reader's slices inside a decode costs the served model beyond the chunks' device
    # time (the hop to the reader's thread, the rounds' pipeline drained and refilled); 0: nothing
    slice_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.short_prompt_kept not in SHORT_PROMPT_KEPT:
            raise ValueError(f"short_prompt_kept must be one of {SHORT_PROMPT_KEPT}, got {self.short_prompt_kept!r}")
        if self.ration_from not in RATION_FROM:
            raise ValueError(f"ration_from must be one of {RATION_FROM}, got {self.ration_from!r}")
        p = self.policy
        if p.grid <= 0:
            raise ValueError(f"grid must be a positive number of rows, got {p.grid}")
        for name in ("checkpoints", "recent_checkpoints", "divergence_checkpoints"):
            if getattr(p, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(p, name)}")
        if not (math.isfinite(self.slice_overhead_ms) and self.slice_overhead_ms >= 0):
            raise ValueError(f"slice_overhead_ms must be a finite number of ms >= 0, got {self.slice_overhead_ms!r}")
        TurnRation.reader(p)  # the core's own checks
        check_group(p.idle_group, "idle_group")

    @classmethod
    def of(cls, policy: Policy | None = None, **values) -> "SimOptions":
        """Options from keyword values: a Policy field's goes to the policy (over `policy`, default the shipped
        one), the rest are the replay's own; a None value is left out (a flag not given)."""
        given = {k: v for k, v in values.items() if v is not None}
        policy_fields = {f.name for f in fields(Policy)}
        unknown = set(given) - policy_fields - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown replay option(s) {sorted(unknown)}")
        ours = {k: v for k, v in given.items() if k not in policy_fields}
        if "chunk_prior_ms" in given:
            ours.setdefault("prior_from_read_model", False)
        return cls(policy=replace(policy or Policy(), **{k: v for k, v in given.items() if k in policy_fields}),
                   **ours)

    @property
    def grid(self) -> int:
        return self.policy.grid

    @property
    def checkpoint_rules(self) -> CheckpointRules:
        """The reader's checkpoint rules (the policy's counts) with the replay's two switches."""
        return CheckpointRules.counted(self.grid, **self.policy.reader_checkpoints(), at_line=self.checkpoint_at_line,
                                       pin_first=self.pin_first_checkpoint)

    @property
    def max_checkpoints_per_session(self) -> int:
        return self.checkpoint_rules.max_held

    def to_json(self) -> dict:
        """The options as the report shows them: the policy's fields and the replay's, side by side (paths as text)."""
        own = asdict(self)
        policy = {k: (str(v) if isinstance(v, Path) else v) for k, v in own.pop("policy").items()}
        return {**policy, **own}


class TurnStart(NamedTuple):
    session: str
    turn: int
    arrival_s: float  # virtual wall clock, after the session's shifts
    kept_tokens: int  # what the new prompt keeps of what the session held
    behind_tokens: int
    rolled_back_tokens: int  # read rows the reader lost going back to a checkpoint
    fresh: bool
    prompt_ready_s: float | None  # from arrival until the prompt's whole chunks were read (None: not before the next turn)
    cause: str = "fresh"  # "first_turn", "fresh" or one of MISS_CAUSES
    behind_without_rollback: int = 0  # kept - what the reader had read, before going back
    idle_gap_s: float = 0.0  # from the previous turn's end to this arrival
    backlog_ms_at_prev_end: float = 0.0  # read-model cost of the chunks up to kept's line, unread at the previous end
    prev_prompt_read: bool = True  # at the previous turn's end every whole chunk of its prompt was read
    # the served model's time to the first token (read-model ms: the grid chunks and the tail under one chunk
    # the turn reads), with the session cache (from the newest kept line or checkpoint at or below `kept`)
    # and cold (the whole prompt); `served_from` is the row the cached turn read from
    served_ttft_cached_ms: float = 0.0
    served_ttft_cold_ms: float = 0.0
    served_from: int = 0


class Decision(NamedTuple):
    """One plan carried out: the decision trace the equivalence test compares."""

    session: str
    turn: int  # the turn it belongs to (idle: the turn it preceded)
    window: Window
    opened_s: float
    start_row: int
    num_chunks: int
    gpu_us: int
    stop: Stop


@dataclass
class SimResult:
    options: SimOptions
    turn_starts: list[TurnStart] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    ledger: GpuLedger = field(default_factory=GpuLedger)
    served_prefill_s: float = 0.0
    served_decode_s: float = 0.0
    request_waits_ms: list[float] = field(default_factory=list)
    num_sessions: int = 0
    num_overlapping_turns: int = 0
    num_checkpoints_taken: int = 0
    max_checkpoints_held: int = 0
    num_ration_slices: int = 0  # the reader's slices inside decodes
    rounds: RoundsResult | None = None  # the served rounds over all records (None: not run)
    decode_round_ms: float | None = None  # what a decode round cost there

    def report(self) -> dict:
        return build_report(self)


def _percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (an observed value; None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _dist(values: list[float]) -> dict:
    return {"n": len(values), "p50": _percentile(values, 50), "p90": _percentile(values, 90),
            "p99": _percentile(values, 99), "max": max(values) if values else None}


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def miss_breakdown(starts: list[TurnStart], grid: int) -> dict:
    """Follow-up turn starts by cause: how many missed for each, and the fresh share were they all fresh."""
    follow = [s for s in starts if s.turn > 0]
    missed = [s for s in follow if not s.fresh]
    by_cause: dict[str, dict] = {}
    for cause, why in MISS_CAUSES.items():
        these = [s for s in missed if s.cause == cause]
        by_cause[cause] = {
            "n": len(these),
            "share_of_misses": len(these) / len(missed) if missed else None,
            "share_of_followups": len(these) / len(follow) if follow else None,
            "fresh_share_if_fresh": ((len(starts) - len(missed) + len(these)) / len(starts)) if starts else None,
            "fresh_share_followups_if_fresh": ((len(follow) - len(missed) + len(these)) / len(follow)) if follow else None,
            "behind_tokens": _dist([s.behind_tokens for s in these]),
            "why": why,
        }
    rollback = [s for s in missed if s.cause.startswith("rollback_") and s.cause != "rollback_and_backlog"]
    backlog = [s for s in missed if s.cause.startswith("backlog_")]
    return {
        "num_turn_starts": len(starts), "num_followups": len(follow), "num_missed": len(missed),
        "by_cause": by_cause,
        "rollback_only": {"n": len(rollback), "share_of_misses": len(rollback) / len(missed) if missed else None},
        "backlog": {"n": len(backlog) + by_cause["rollback_and_backlog"]["n"],
                    "share_of_misses": ((len(backlog) + by_cause["rollback_and_backlog"]["n"]) / len(missed))
                    if missed else None},
        "backlog_by_what_was_unread": {
            "previous_output_only": sum(1 for s in missed if s.cause.startswith("backlog_") and s.prev_prompt_read),
            "previous_prompt_too": sum(1 for s in missed if s.cause.startswith("backlog_") and not s.prev_prompt_read),
        },
        "definition": (f"a follow-up turn start misses when behind >= grid ({grid}); 'rollback' causes: the "
                       "reader had read to within a chunk of what the new prompt keeps and only the rollback "
                       "left it behind; 'backlog' causes: it had not read that far (idle gap from the previous "
                       "turn's end to this arrival against the read-model cost of the chunks still unread then)"),
    }


def served_ttft(starts: list[TurnStart]) -> dict:
    """The served model's time to the first token on follow-up turns, with the session cache and cold, in ms
    of the served read model (the reader's read model where none was given)."""
    cached = [s.served_ttft_cached_ms for s in starts]
    cold = [s.served_ttft_cold_ms for s in starts]
    p50_cached, p50_cold = _percentile(cached, 50), _percentile(cold, 50)
    return {"cached": _dist(cached), "cold": _dist(cold),
            "ratio_p50": (p50_cached / p50_cold) if p50_cached is not None and p50_cold else None}


def freshness_goal(report: dict) -> dict:
    """TARGETS.md's freshness goal against this replay, and what stands in its way."""
    fresh, p90 = report["fresh_share"], report["behind_tokens"]["p90"]
    misses = report["misses"]
    met_fresh = fresh is not None and fresh >= GOAL_FRESH_SHARE
    met_p90 = p90 is not None and p90 <= GOAL_BEHIND_P90
    ranked = sorted(((c, v["n"]) for c, v in misses["by_cause"].items() if v["n"]), key=lambda cv: -cv[1])
    rollback = sum(v["n"] for c, v in misses["by_cause"].items() if c.startswith("rollback_"))
    n = misses["num_turn_starts"]
    return {
        "fresh_share_min": GOAL_FRESH_SHARE, "behind_p90_max": GOAL_BEHIND_P90,
        "fresh_share": fresh, "behind_p90": p90, "met_fresh_share": met_fresh, "met_behind_p90": met_p90,
        "met": met_fresh and met_p90,
        "misses_by_cause_largest_first": [{"cause": c, "n": k, "share_of_misses": k / misses["num_missed"]}
                                          for c, k in ranked],
        "fresh_share_if_no_rollback_missed": ((n - misses["num_missed"] + rollback) / n) if n else None,
        "measured_on": "all turn starts (a session's first is fresh by definition); the follow-ups alone are in "
                       "fresh_share_followups and behind_tokens_followups",
    }


def served_rounds(result: SimResult) -> dict | None:
    """The served turns of all sessions at once, in the conductor's rounds (None where they were not run)."""
    if result.rounds is None:
        return None
    return {**result.rounds.summary(), "decode_round_ms": result.decode_round_ms,
            "definition": ("every record served in the scheduler's rounds on one served model: turns that overlap "
                           "in time share rounds (max_running, round_token_budget); a prompt piece costs the served "
                           "read model's chunk at its context, from the row the session cache reuses (the record's "
                           "cached_tokens or, where larger, the per-session replay's served book), a decode round "
                           "decode_round_ms; ttft_s from arrival, tokens_per_s a turn's ids over arrival to end, "
                           "aggregate_tokens_per_s all ids over the first arrival to the last end")}


def decode_round_ms(records: list[UsageRecord]) -> float | None:
    """The records' median decode time per output id, ms (None: no record says when its first token came)."""
    per_id = sorted((r.end_s - r.first_token_s) * 1000 / r.output_tokens for r in records
                    if r.first_token_s is not None and r.output_tokens > 0 and r.end_s > r.first_token_s)
    return per_id[len(per_id) // 2] if per_id else None


def build_report(result: SimResult) -> dict:
    starts = result.turn_starts
    follow = [s for s in starts if s.turn > 0]
    total = result.ledger.balance()
    idle_ms = total.gpu_ms(Role.READER_IDLE)
    ration_ms = total.gpu_ms(Role.READER_RATION)
    prefill_ms = total.gpu_ms(Role.READER_PREFILL)
    decode_ms = result.served_decode_s * 1000
    prefill_served_ms = result.served_prefill_s * 1000
    reader_ms = idle_ms + ration_ms + prefill_ms
    ready = [s.prompt_ready_s for s in starts if s.prompt_ready_s is not None]
    report = {
        "num_sessions": result.num_sessions,
        "num_turns": len(starts),
        "num_followup_turns": len(follow),
        "fresh_share": _share([s.fresh for s in starts]),
        "fresh_share_followups": _share([s.fresh for s in follow]),
        "behind_tokens": _dist([s.behind_tokens for s in starts]),
        "behind_tokens_followups": _dist([s.behind_tokens for s in follow]),
        "rolled_back_tokens": sum(s.rolled_back_tokens for s in starts),
        # a turn whose prompt re-rendered below the reader's read rows: no read policy can be fresh there,
        # the new prompt only arrives with the turn
        "num_rollback_turns": sum(1 for s in follow if s.rolled_back_tokens > 0),
        "fresh_share_followups_without_rollback": _share([s.fresh for s in follow if s.rolled_back_tokens == 0]),
        "reader_ms": {"idle": idle_ms, "ration": ration_ms, "prefill": prefill_ms, "total": reader_ms},
        "reader_share_by_window": ({"idle": idle_ms / reader_ms, "ration": ration_ms / reader_ms,
                                    "prefill": prefill_ms / reader_ms} if reader_ms > 0 else None),
        "served_decode_ms": decode_ms,
        "served_prefill_ms": prefill_served_ms,
        "decode_loss": (ration_ms / decode_ms) if decode_ms > 0 else None,
        # with each slice's fixed cost (SimOptions.slice_overhead_ms): what the decode loses on the wall
        "num_ration_slices": result.num_ration_slices,
        "decode_loss_wall": ((ration_ms + result.num_ration_slices * result.options.slice_overhead_ms) / decode_ms
                             if decode_ms > 0 else None),
        "prefill_loss": (prefill_ms / prefill_served_ms) if prefill_served_ms > 0 else None,
        "estimate_error_ms": {r.value: total.estimate_error_us(r) / 1000
                              for r in (Role.READER_IDLE, Role.READER_RATION, Role.READER_PREFILL)},
        "request_wait_ms": _dist(result.request_waits_ms),
        "prompt_ready_s": {**_dist(ready), "num_not_ready_by_next_turn": len(starts) - len(ready)},
        "num_overlapping_turns": result.num_overlapping_turns,
        "misses": miss_breakdown(starts, result.options.grid),
        "served_ttft_ms": served_ttft(follow),
        "checkpoints": {"max_per_session": result.options.max_checkpoints_per_session,
                        "max_held_by_a_session": result.max_checkpoints_held,
                        "bytes_each_0_8b": CHECKPOINT_BYTES_0_8B,
                        "max_bytes_per_session_0_8b": result.max_checkpoints_held * CHECKPOINT_BYTES_0_8B,
                        "num_taken": result.num_checkpoints_taken},
        "served_rounds": served_rounds(result),
        "options": result.options.to_json(),
    }
    report["goal"] = freshness_goal(report)
    return report


class Simulator:
    """Replays sessions; one estimator and one ledger over the whole replay (an engine that has been running)."""

    def __init__(self, read_model: ReadModel, options: SimOptions = SimOptions(), record_decisions: bool = False,
                 served_model: ReadModel | None = None):
        self.read_model = read_model
        # what a grid chunk of the served model costs (its TTFT with and without the cache, its rounds' prompt
        # pieces); None: the reader's read model stands in for it
        self.served_model = served_model or read_model
        self.options = options
        self.record_decisions = record_decisions
        policy = options.policy
        prior = read_model.ms_per_chunk(0, policy.grid) if options.prior_from_read_model else policy.chunk_prior_ms
        self.estimator = ChunkCostEstimator(prior, options.estimator_bucket_tokens)
        self.prefill = (TurnRation(options.prefill_share, policy.slice_ms, Window.PREFILL)
                        if options.prefill_share > 0 else None)
        self.result = SimResult(options)

    # -- the whole replay ----------------------------------------------------------------------
    def run(self, records: Iterable[UsageRecord], progress: bool = False) -> SimResult:
        """Each session on its own engine (freshness, the reader's windows), then every record in the served
        rounds together (the served TTFT and tokens/s)."""
        records = list(records)
        sessions = sessions_of(records)
        items: Iterable = sessions.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, total=len(sessions), unit="session", desc="replay", file=sys.stderr)
        for session_id, recs in items:
            _SessionReplay(self, session_id).run(recs)
            self.result.num_sessions += 1
        opt = self.options
        round_ms = opt.decode_round_ms if opt.decode_round_ms is not None else decode_round_ms(records)
        if opt.served_rounds and round_ms is not None and records:
            self.result.decode_round_ms = round_ms
            self.result.rounds = simulate_rounds(self._with_served_reuse(sessions), opt.policy, self.served_model,
                                                 DecodeCost(round_ms), keep_plans=False)
        return self.result

    def _with_served_reuse(self, sessions: dict[str, list[UsageRecord]]) -> list[UsageRecord]:
        """Every record with the prompt rows the session cache reuses, as its per-session replay found them
        (`served_from`: the served book's rule, applied once): a public trace records no cached tokens, and
        its turns would otherwise all be read cold in the rounds."""
        reused = {(s.session, s.turn): s.served_from for s in self.result.turn_starts}
        return [msgspec.structs.replace(rec, cached_tokens=max(rec.cached_tokens, reused.get((sid, k), 0)))
                for sid, recs in sessions.items() for k, rec in enumerate(recs)]


class _SessionReplay:
    """One session on its own engine. All times are the virtual wall clock."""

    def __init__(self, sim: Simulator, session_id: str):
        self.sim = sim
        self.opt = sim.options
        self.grid = sim.options.grid
        self.session_id = session_id
        self.committed = 0  # rows read, a multiple of grid
        self.known = 0  # ids the session holds
        self.prompt = 0  # the current turn's prompt length
        policy = self.opt.policy
        # the reader's checkpoints, by the reader's rules (and the replay's two switches)
        self.book = CheckpointBook(self.opt.checkpoint_rules)
        # the served model's own session (qse/sessions/served.py): the line its state stands on after a turn,
        # and its checkpoints, by the served sessions' rules
        self.served_line = 0
        self.served_book = CheckpointBook(CheckpointRules.counted(self.grid, **policy.served_checkpoints()))
        # the conductor's own scheduler, on this session's engine (the estimator and ledger are the replay's)
        self.sched = Scheduler(policy, sim.estimator, sim.result.ledger)
        self.next_look_s = 0.0  # the idle window's first look after the last turn's end
        self.now = 0.0
        self.turn = 0
        self.ready_target = 0
        self.ready_at: float | None = None
        self.arrival = 0.0

    # -- reading ---------------------------------------------------------------------------------
    def _taken(self, change: Change) -> None:
        """Count what the book took (a kind added at a row is one checkpoint taken) and the most held."""
        if change.added:
            result = self.sim.result
            result.num_checkpoints_taken += len(change.added)
            result.max_checkpoints_held = max(result.max_checkpoints_held, len(self.book))

    def _read_chunk(self, row: int) -> float:
        ms = self.sim.read_model.ms_per_chunk(row, self.grid)
        self._chunk_read(row, ms, launch_end=True)
        return ms

    def _read_group(self, row: int, chunks: int) -> tuple[float, int]:
        """A chunk group from `row`, as the reader forms it (a power of two up to `chunks`, ending at the first
        prompt or divergence line inside it); (its ms, the chunks it read)."""
        count = self.book.group_chunks(row, chunks)
        share = group_share(count)
        total = 0.0
        for i in range(count):
            ms = self.sim.read_model.ms_per_chunk(row + i * self.grid, self.grid) * share
            self._chunk_read(row + i * self.grid, ms, launch_end=i == count - 1)
            total += ms
        return total, count

    def _chunk_read(self, row: int, ms: float, launch_end: bool) -> None:
        """The clock and the checkpoints after one chunk (recent checkpoints at a launch's end only, as the
        reader takes them)."""
        self.now += ms / 1000
        end = row + self.grid
        self._taken(self.book.after_chunk(end, launch_end))
        if self.ready_at is None and end >= self.ready_target:
            self.ready_at = self.now - self.arrival

    def _drive(self, window: Window, decision, turn_id: str | None, waiting_at: float | None,
               budget_ms: float, est_ms: float) -> DriveResult | None:
        plan = plan_read(window, session_id=self.session_id, turn_id=turn_id, committed_rows=self.committed,
                         prompt_tokens=self.prompt, known_tokens=self.known, grid=self.grid,
                         budget_ms=budget_ms, first_chunk_est_ms=est_ms, group=self.opt.policy.idle_group)
        if plan is None:
            return None
        opened = self.now
        # the plan's lookahead is 0 here: each launch (a chunk, or a group where the plan allows) is read at once
        driver = PlanDriver(estimator=self.sim.estimator, ledger=self.sim.result.ledger, clock=lambda: self.now)
        res = driver.run(plan, decision, _ReplayPipe(self),
                         request_waiting=lambda: waiting_at is not None and self.now >= waiting_at)
        self.committed = res.end_row
        if self.sim.record_decisions:
            self.sim.result.decisions.append(Decision(self.session_id, self.turn, window, opened, plan.start_row,
                                                      res.num_chunks, res.gpu_us, res.stop))
        return res

    # -- the idle window between two turns -------------------------------------------------------
    def _backlogs(self) -> dict[str, SessionBacklog]:
        num = whole_chunks(self.committed, self.known, self.grid)
        return {self.session_id: SessionBacklog(0.0, num)} if num else {}

    def _idle(self, arrival_s: float) -> float:
        """The scheduler's idle window from its first look after the last turn's end until the request arriving
        at `arrival_s` (no request runs or waits before it). Returns when the turn may start."""
        sched = self.sched
        t = self.next_look_s
        start = arrival_s
        while t < arrival_s:
            action = sched.on(IdlePoll(t, Busy(), has_work=bool(self._backlogs())))
            if not isinstance(action, OpenIdle):
                return start
            self.now = t
            action = sched.on(IdleOpened(t, self._backlogs()))
            while isinstance(action, ReadPlan):
                res = self._carry_out(action, arrival_s)
                action = sched.on(ReadEnded(self.now, res.stop if res is not None else None, self._backlogs()))
            start = max(start, self.now)
            t = action.until
        return start

    def _carry_out(self, action: ReadPlan, waiting_at: float | None) -> DriveResult | None:
        est = self.sim.estimator.estimate_ms(self.committed)
        return self._drive(action.window, action.decision, action.turn_id, waiting_at, action.budget_ms(self.now), est)

    # -- the served prefill (exploratory window) -------------------------------------------------
    def _prefill(self, turn_id: str, start_s: float, prefill_s: float) -> float:
        """Read during the served prefill under its share; returns the reader's time spent (s)."""
        share = self.sim.prefill
        ledger = self.sim.result.ledger
        spent_s = 0.0
        t = start_s
        while share is not None and whole_chunks(self.committed, self.known, self.grid) > 0:
            est = self.sim.estimator.estimate_ms(self.committed)
            spent_us = ledger.spent_us(Role.READER_PREFILL, turn_id) or 0
            sl = share.open_slice(t, start_s, spent_us, est)
            if sl is None:
                t_star = share.earliest_s(start_s, spent_us, est)
                if t_star is None or t_star - start_s - spent_s >= prefill_s:
                    break
                t = max(t_star, t)
                continue
            self.now = t
            self._drive(Window.PREFILL, sl, turn_id, None, sl.budget_us / 1000, est)
            spent_s += self.now - t
            t = self.now
        return spent_s

    # -- the ration between decode rounds --------------------------------------------------------
    def _decode(self, turn_id: str, first_token_s: float, since_s: float, decode_s: float, output_tokens: int) -> float:
        """The scheduler's slices between decode rounds; returns the reader's time inside the decode (s)."""
        if output_tokens < 2 or decode_s <= 0:
            return 0.0
        round_s = decode_s / output_tokens
        reader_s = 0.0
        i = 1  # the boundary after round i: i output ids are known
        while i <= output_tokens - 1:
            self.known = self.prompt + i
            t_i = first_token_s + i * round_s + reader_s
            view = SliceView(None, turn_id, self.session_id, since_s, self.committed, self.known)
            action = self.sched.on(RoundEnded(t_i, (view,)))
            if isinstance(action, ReadPlan):
                self.now = t_i
                self._carry_out(action, None)
                self.now += self.opt.slice_overhead_ms / 1000  # the decode waits on the slice's host steps too
                self.sched.on(ReadEnded(self.now, None))
                self.sim.result.num_ration_slices += 1
                reader_s += self.now - t_i
                i += 1
            elif action.until is None:  # no whole chunk: the round that completes the next one
                i = self.committed + self.grid - self.prompt
            elif math.isinf(action.until):  # the share never pays for a chunk
                break
            else:
                # skip the boundaries well before the first moment a slice could open; the scheduler decides at
                # the ones near it (the core rounds time to whole microseconds, so the boundary just below may do)
                i = max(i + 1, math.floor((action.until - first_token_s - reader_s) / round_s) - 1)
        return reader_s

    # -- one session -----------------------------------------------------------------------------
    def _turn_start(self, rec: UsageRecord, prev: UsageRecord | None, idle_gap_s: float,
                    committed_at_prev_end: int) -> TurnStart:
        kept = 0
        if prev is not None:
            kept = rec.shared_prefix_tokens
            if self.opt.output_kept and rec.shared_prefix_tokens >= prev.prompt_tokens:
                kept = min(rec.prompt_tokens, prev.prompt_tokens + prev.output_tokens)
                if (self.opt.short_prompt_kept == "previous_prompt"
                        and rec.prompt_tokens < prev.prompt_tokens + prev.output_tokens):
                    kept = prev.prompt_tokens
            kept = min(kept, self.known)
        behind_without = max(0, kept - self.committed)
        held = self.book.positions(None)
        rolled_back = 0
        if self.committed > kept:  # the reader's feed: back to the book's row at or below what is kept
            back_to = self.book.roll_back(kept).row
            rolled_back = self.committed - back_to
            self.committed = back_to
        behind = max(0, kept - self.committed)
        fresh = is_fresh(behind, self.grid)
        backlog_ms = 0.0
        prev_prompt_read = prev is None or committed_at_prev_end >= (prev.prompt_tokens // self.grid) * self.grid
        if prev is not None and rolled_back == 0:
            line = (kept // self.grid) * self.grid
            backlog_ms = self.sim.read_model.chunks_ms(committed_at_prev_end, line, self.grid)
        if prev is None:
            cause = "first_turn"
        elif fresh:
            cause = "fresh"
        elif rolled_back:
            if behind_without >= self.grid:
                cause = "rollback_and_backlog"
            elif not held or kept < min(held):
                cause = "rollback_below_oldest_checkpoint"
            elif kept < max(held):
                cause = "rollback_below_newest_checkpoint"
            else:
                cause = "rollback_above_newest_checkpoint"
        else:
            cause = "backlog_exceeds_idle_gap" if backlog_ms > idle_gap_s * 1000 else "backlog_idle_gap_unused"
        cached_ms, cold_ms, served_from = self._served_turn(rec.prompt_tokens, kept)
        return TurnStart(self.session_id, self.turn, self.arrival, kept, behind, rolled_back, fresh, None,
                         cause, behind_without, idle_gap_s, backlog_ms, prev_prompt_read, cached_ms, cold_ms, served_from)

    def _served_turn(self, prompt_tokens: int, kept: int) -> tuple[float, float, int]:
        """The served turn on its session cache (its rules: qse/sessions/served.py): it starts from the newest
        state it holds at or below `kept` (the line it stands on, a checkpoint, or row 0), reads whole chunks
        up to the last grid line below the prompt's end and then the tail (1..grid ids, charged as that share
        of a chunk at its context); cold reads the same from row 0. Returns (cached ms, cold ms, start row)."""
        grid, model = self.grid, self.sim.served_model
        line = ((prompt_tokens - 1) // grid) * grid
        tail = prompt_tokens - line

        def ttft_ms(start: int) -> float:
            return model.chunks_ms(start, line, grid) + model.ms_per_chunk(line, grid) * tail / grid

        book = self.served_book
        start = self.served_line
        if start > min(kept, line):  # the turn's feed goes back (a turn keeps at most `line`: its tail holds an id)
            start = book.roll_back(min(kept, line)).row
        book.feed(prompt_tokens, prompt_tokens, standing=start)
        for end in range(start + grid, line + 1, grid):  # one chunk a launch, as the served turn reads
            book.after_chunk(end)
        self.served_line = line  # the state the turn leaves: its last line
        return ttft_ms(start), ttft_ms(0), start

    def run(self, recs: list[UsageRecord]) -> None:
        result = self.sim.result
        ledger = result.ledger
        shift_s = 0.0  # how much later than recorded this session runs, from the reader's time
        free_s: float | None = None  # when the previous turn ended
        prev: UsageRecord | None = None
        pending: TurnStart | None = None
        committed_at_end = 0
        for k, rec in enumerate(recs):
            self.turn = k
            arrival = rec.arrival_s + shift_s
            if free_s is not None and arrival < free_s:
                result.num_overlapping_turns += 1
                shift_s += free_s - arrival
                arrival = free_s
            idle_gap_s = 0.0 if free_s is None else arrival - free_s
            self.sched.on(Arrived(arrival))  # (the idle window's lattice starts with the first request)
            if free_s is not None:
                start = self._idle(arrival)
                if start > arrival:
                    result.request_waits_ms.append((start - arrival) * 1000)
                    shift_s += start - arrival
                    arrival = start
            if pending is not None:
                result.turn_starts.append(pending._replace(prompt_ready_s=self.ready_at))
            self.arrival = arrival
            start_rec = self._turn_start(rec, prev, idle_gap_s, committed_at_end)

            turn_id = f"{self.session_id}#{k}"
            ledger.open_turn(turn_id)
            self.prompt = rec.prompt_tokens
            self.known = rec.prompt_tokens
            # the reader's feed(prompt, prompt_end): the prompt end's line joins the book's lines
            self._taken(self.book.feed(rec.prompt_tokens, rec.prompt_tokens, standing=self.committed))
            line = (rec.prompt_tokens // self.grid) * self.grid
            self.ready_target = line
            self.ready_at = 0.0 if self.committed >= line else None
            pending = start_rec

            prefill_s = rec.first_token_s - rec.arrival_s
            decode_s = rec.end_s - rec.first_token_s
            ledger.record(Role.SERVED_PREFILL, prefill_s * 1000, turn_id=turn_id)
            reader_prefill_s = self._prefill(turn_id, arrival, prefill_s) if self.sim.prefill else 0.0
            first_token = arrival + prefill_s + reader_prefill_s
            since = first_token if self.opt.ration_from == "first_token" else arrival
            reader_decode_s = self._decode(turn_id, first_token, since, decode_s, rec.output_tokens)
            ledger.record(Role.SERVED_DECODE, decode_s * 1000, turn_id=turn_id)
            ledger.close_turn(turn_id)

            shift_s += reader_prefill_s + reader_decode_s
            free_s = first_token + decode_s + reader_decode_s
            self.next_look_s = self.sched.on(TurnEnded(free_s, turn_id)).until
            self.known = rec.prompt_tokens + rec.output_tokens
            committed_at_end = self.committed
            result.served_prefill_s += prefill_s
            result.served_decode_s += decode_s
            prev = rec
        if free_s is not None:  # after the last turn the idle window reads until the reader catches up
            self.turn = len(recs)
            self._idle(math.inf)
        if pending is not None:
            result.turn_starts.append(pending._replace(prompt_ready_s=self.ready_at))


class _ReplayPipe:
    """The driver's chunks on the virtual clock, chunk groups too (each read, and timed, at its launch)."""

    can_group = True
    reads_at_launch = True

    def __init__(self, session: "_SessionReplay"):
        self.session = session

    def launch(self, row: int, chunks: int) -> tuple[float, int]:
        return (self.session._read_chunk(row), 1) if chunks == 1 else self.session._read_group(row, chunks)

    def finish(self, handle: float) -> float:
        return handle


def simulate(records: Iterable[UsageRecord], read_model: ReadModel | None = None,
             options: SimOptions = SimOptions(), progress: bool = False,
             record_decisions: bool = False, served_model: ReadModel | None = None) -> SimResult:
    """Replay `records` and return the result (`.report()` for the summary). served_model: the served
    model's chunk costs (default: the reader's read model)."""
    sim = Simulator(read_model or ReadModel.flat(), options, record_decisions, served_model)
    return sim.run(records, progress=progress)
