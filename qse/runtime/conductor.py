"""The asyncio conductor: the served model's turns, and the reader's time around and inside them.

    idle loop (every poll_s)         turn (one request at a time on the engine lock)
    ------------------------         ------------------------------------------------
    quiet? -> take engine lock       feed prompt to the reader (rollback if it diverged)
      at the lowest rank             prefill  -> first token (the ration clock starts here)
    read chunks <= burst_s,          decode round, ration slice, decode round, ration slice ...
      stop before the next chunk     end: feed the output, account the turn, emit the record
      once a request waits

The decisions (may the reader read now, how much) come from the budget helpers below; the device
work runs on the engine's own executor thread; every measured slice goes into the GPU-time ledger.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import structlog

from ..engine.engine import Engine
from ..engine.sampling import Sampler, SamplingParams
from ..settings import SETTINGS, EngineSettings
from ..shadow.reader import AskResult, ShadowError, ShadowReader
from .executor import EngineExecutor
from .locks import RANK_NARRATOR, RANK_READER_IDLE, RANK_SERVED, LockBoard

log = structlog.get_logger("qse.conductor")

ROUTER_CLASSES = ["chat", "code_edit", "debug", "design_ui", "explain", "plan", "search", "test", "other"]
ROUTER_QUESTION = (
    "Classify the user's latest request in this session into one class. Classes: "
    + "; ".join(f"{chr(65 + i)}) {c}" for i, c in enumerate(ROUTER_CLASSES))
    + ". Answer with the letter only."
)


@dataclass
class ShadowOptions:
    """The profile's shadow block."""

    mode: str = "on"  # off | on
    narrator: str = "off"  # off | on
    router: str = "off"  # off | shadow
    router_min_tokens: int = 8192


@dataclass
class ConductorConfig:
    ration: float = 0.02
    slice_ms: float = 150.0
    idle_poll_s: float = 0.2
    idle_burst_s: float = 2.0
    narrator_share: float = 0.03
    journal_dir: Path | None = None

    @classmethod
    def from_settings(cls, settings: EngineSettings = SETTINGS) -> "ConductorConfig":
        return cls(
            ration=settings.get("QSE_SHADOW_RATION"),
            slice_ms=settings.get("QSE_SHADOW_SLICE_MS"),
            idle_poll_s=settings.get("QSE_SHADOW_IDLE_POLL_S"),
            idle_burst_s=settings.get("QSE_SHADOW_IDLE_BURST_S"),
            narrator_share=settings.get("QSE_NARRATOR_SHARE"),
            journal_dir=settings.get("QSE_SHADOW_DIR") or settings.cache_dir() / "shadow",
        )


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    session_id: str | None = None  # explicit (X-Session-Id); else mapped by longest common prefix
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    router_label: str | None = None  # the served router's own class for this turn, if a proxy passes it


@dataclass
class TurnRecord:
    request_id: str
    session_id: str | None
    arrival_s: float
    first_token_s: float | None
    end_s: float
    prompt_tokens: int
    shared_prefix_tokens: int
    output_tokens: int
    model: str
    prefill_ms: float
    decode_ms: float
    reader_ration_ms: float
    finish_reason: str
    decode_tokens_per_s: float
    reader_share: float


class Ledger:
    """Measured device time by role, per turn and in total (ms)."""

    ROLES = ("served_prefill", "served_decode", "reader_idle", "reader_ration", "narrator", "reader_ask")

    def __init__(self):
        self.total_ms = {r: 0.0 for r in self.ROLES}
        self.entries = 0

    def add(self, role: str, gpu_ms: float) -> None:
        if role not in self.total_ms:
            raise ValueError(f"unknown ledger role {role!r}; roles: {self.ROLES}")
        self.total_ms[role] += gpu_ms
        self.entries += 1


@dataclass
class TurnBudget:
    """The ration inside one turn: share x time since the first token, minus what was spent."""

    share: float
    slice_ms: float
    first_token_s: float | None = None
    spent_ms: float = 0.0

    def allowance_ms(self, now: float) -> float:
        if self.first_token_s is None:
            return 0.0
        earned = self.share * (now - self.first_token_s) * 1e3
        return min(self.slice_ms, max(0.0, earned - self.spent_ms))


class Conductor:
    def __init__(self, served: Engine, reader: ShadowReader | None, options: ShadowOptions | None = None,
                 config: ConductorConfig | None = None, on_turn: Callable[[TurnRecord], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.served = served
        self.reader = reader if (options or ShadowOptions()).mode == "on" else None
        self.options = options or ShadowOptions()
        self.config = config or ConductorConfig.from_settings()
        self.on_turn = on_turn
        self.clock = clock
        self.board = LockBoard()
        self.ledger = Ledger()
        self.served_exec = EngineExecutor("served")
        self.reader_exec = self.served_exec if (reader is None or reader.engine is served) else EngineExecutor("reader")
        self._idle_task: asyncio.Task | None = None
        self._router_pending: dict[str, list[dict[str, Any]]] = {}
        self._journal_lock = asyncio.Lock()
        self._session_prompts: dict[str, list[int]] = {}
        self._stopping = False
        self.turns = 0
        self.idle_bursts = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.reader is not None and self._idle_task is None:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="qse-idle-reader")

    async def stop(self) -> None:
        """Planned stop: finish the work in flight, then write every resident session (if a disk tier)."""
        self._stopping = True
        if self._idle_task is not None:
            self._idle_task.cancel()
            try:
                await self._idle_task
            except asyncio.CancelledError:
                pass
            self._idle_task = None
        await self.board.engine.acquire(RANK_SERVED)  # waits for the request in flight
        try:
            park_all = getattr(self.reader.residency, "park_all", None) if self.reader is not None else None
            if park_all is not None:
                await self.reader_exec.run(park_all, self.reader)
        finally:
            self.board.engine.release()
        self.served_exec.shutdown()
        if self.reader_exec is not self.served_exec:
            self.reader_exec.shutdown()

    # ---- sessions ----------------------------------------------------------------------------
    def map_session(self, prompt_ids: list[int], explicit: str | None) -> str | None:
        """Explicit id, else the resident session sharing the longest prefix (>= one grid chunk), else new."""
        if self.reader is None:
            return explicit
        if explicit:
            return explicit
        best, best_len = None, 0
        for sid, session in self.reader.sessions.items():
            n = 0
            limit = min(len(session.ids), len(prompt_ids))
            while n < limit and session.ids[n] == prompt_ids[n]:
                n += 1
            if n > best_len:
                best, best_len = sid, n
        if best is not None and best_len >= self.reader.grid:
            return best
        return f"s-{uuid.uuid4().hex[:16]}"

    # ---- the served turn ---------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[int]:
        """Stream the served model's token ids for one request; the reader follows the turn."""
        arrival = self.clock()
        if not req.prompt_ids:
            raise ShadowError("empty prompt: at least one token id is needed")
        self.served.model.check_ids(self.served.ids_tensor(req.prompt_ids).cpu())
        session_id = self.map_session(req.prompt_ids, req.session_id)
        shared = 0
        prev = self._session_prompts.get(session_id or "")
        if prev:
            while shared < min(len(prev), len(req.prompt_ids)) and prev[shared] == req.prompt_ids[shared]:
                shared += 1
        budget = TurnBudget(self.config.ration, self.config.slice_ms)
        out_ids: list[int] = []
        prefill_ms = decode_ms = 0.0
        first_token_s = None
        finish = "length"
        await self.board.engine.acquire(RANK_SERVED)
        try:
            if self.reader is not None and session_id is not None:
                await self.reader_exec.run(self.reader.feed, session_id, list(req.prompt_ids), len(req.prompt_ids))
                self._session_prompts[session_id] = list(req.prompt_ids)
                self._maybe_queue_router(session_id, req)
            sampler = Sampler(req.sampling, vocab_limit=self.served.chat.tokenizer.vocab_size)
            cache = self.served.new_cache()
            logits, ms = await self.served_exec.run(self.served.forward, cache, self.served.ids_tensor(req.prompt_ids), "last")
            prefill_ms += ms
            self.ledger.add("served_prefill", ms)
            while len(out_ids) < req.max_tokens:
                token = sampler(logits[-1])
                if first_token_s is None:
                    first_token_s = self.clock()
                    budget.first_token_s = first_token_s
                if token in req.stop_ids:
                    finish = "stop"
                    break
                out_ids.append(token)
                yield token
                if len(out_ids) >= req.max_tokens:
                    break
                logits, ms = await self.served_exec.run(self.served.forward, cache, self.served.ids_tensor([token]), "last")
                decode_ms += ms
                self.ledger.add("served_decode", ms)
                if self.reader is not None and session_id is not None:
                    await self._ration_slice(session_id, req.prompt_ids, out_ids, budget)
        finally:
            if self.reader is not None and session_id is not None and out_ids:
                await self.reader_exec.run(self.reader.feed, session_id, list(req.prompt_ids) + out_ids)
            self.board.engine.release()
            end = self.clock()
            self.turns += 1
            n_decode = max(0, len(out_ids) - 1)
            record = TurnRecord(
                request_id=req.request_id, session_id=session_id, arrival_s=arrival, first_token_s=first_token_s,
                end_s=end, prompt_tokens=len(req.prompt_ids), shared_prefix_tokens=shared, output_tokens=len(out_ids),
                model=self.served.name, prefill_ms=prefill_ms, decode_ms=decode_ms, reader_ration_ms=budget.spent_ms,
                finish_reason=finish, decode_tokens_per_s=(n_decode / (decode_ms / 1e3)) if decode_ms > 0 else 0.0,
                reader_share=(budget.spent_ms / decode_ms) if decode_ms > 0 else 0.0,
            )
            log.info("turn", **asdict(record))
            if self.on_turn is not None:
                self.on_turn(record)

    async def _ration_slice(self, session_id: str, prompt_ids: list[int], out_ids: list[int], budget: TurnBudget) -> None:
        """Between two decode rounds: whole chunks within the ration, prompt first, then the output."""
        allowance = budget.allowance_ms(self.clock())
        session = self.reader.sessions.get(session_id)
        if session is None or allowance <= 0:
            return
        estimate = session.stats.last_chunk_ms or self.reader.stats.gpu_ms / max(1, self.reader.stats.chunks)
        if estimate <= 0 or estimate > allowance:
            return

        def read_slice() -> list[float]:
            self.reader.engine.synchronize()  # nothing of the reader runs beside a decode round
            if session.behind and len(session.ids) < len(prompt_ids) + len(out_ids):
                self.reader.feed(session_id, list(prompt_ids) + list(out_ids))
            spent, costs = 0.0, []
            est = estimate
            while spent + est <= allowance:
                report = self.reader.read_step(session_id)
                if report is None:
                    break
                spent += report.gpu_ms
                costs.append(report.gpu_ms)
                est = report.gpu_ms
            return costs

        costs = await self.reader_exec.run(read_slice)
        if costs:
            spent = sum(costs)
            budget.spent_ms += spent
            self.ledger.add("reader_ration", spent)
            log.info("ration_slice", session=session_id, chunks=len(costs), gpu_ms=round(spent, 3),
                     allowance_ms=round(allowance, 3))
            await self._answer_router(session_id)

    # ---- the idle window ---------------------------------------------------------------------
    async def _idle_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.idle_poll_s)
            try:
                await self.idle_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the reader must never take the server down
                log.error("idle_read_failed", error=repr(exc))

    async def idle_once(self) -> int:
        """One look at the idle window: read up to idle_burst_s if nothing runs or waits. Returns chunks read."""
        if self.reader is None or not self.board.is_quiet() or not self.reader.sessions_with_backlog():
            return 0
        if not self.board.engine.try_acquire(RANK_READER_IDLE):
            return 0
        chunks = 0
        start = self.clock()
        try:
            while self.clock() - start < self.config.idle_burst_s:
                if self.board.engine.num_waiting:  # a request waits: stop before the next chunk
                    break
                ready = self.reader.sessions_with_backlog()
                if not ready:
                    break
                report = await self.reader_exec.run(self.reader.read_step, ready[0].session_id)
                if report is None:
                    break
                chunks += 1
                self.ledger.add("reader_idle", report.gpu_ms)
                log.info("chunk", window="idle", session=report.session_id, position=report.position,
                         backlog=report.backlog, gpu_ms=round(report.gpu_ms, 3))
                await self._answer_router(report.session_id)
        finally:
            self.board.engine.release()
        if chunks:
            self.idle_bursts += 1
        return chunks

    # ---- questions ---------------------------------------------------------------------------
    def render_question(self, question: str) -> list[int]:
        text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        return self.reader.engine.chat.tokenizer.encode(text)

    async def ask(self, session_id: str, question: str, choices: list[str], upto: int | None = None) -> AskResult:
        if self.reader is None:
            raise ShadowError("the shadow reader is off in this profile")
        self.reader.get(session_id)
        ids = self.render_question(question)
        limit = SETTINGS.get("QSE_MAX_QUESTION_TOKENS")
        if len(ids) > limit:
            raise ShadowError(f"the question has {len(ids)} tokens, over the limit of {limit} (QSE_MAX_QUESTION_TOKENS)")
        async with self.board.engine.hold(RANK_NARRATOR):
            result = await self.reader_exec.run(self.reader.ask, session_id, ids, choices, upto)
        self.ledger.add("reader_ask", result.gpu_ms)
        return result

    async def summarize(self, session_id: str, prompt: str, max_tokens: int):
        if self.reader is None:
            raise ShadowError("the shadow reader is off in this profile")
        self.reader.get(session_id)
        ids = self.render_question(prompt)
        stop = (self.reader.engine.chat.tokenizer.im_end_id,)
        async with self.board.engine.hold(RANK_NARRATOR):
            result = await self.reader_exec.run(self.reader.summarize, session_id, ids, max_tokens, stop)
        self.ledger.add("narrator", result.gpu_ms)
        return result

    def _maybe_queue_router(self, session_id: str, req: GenerateRequest) -> None:
        if self.options.router != "shadow" or len(req.prompt_ids) < self.options.router_min_tokens:
            return
        im_end = self.served.chat.turn_end_id
        insertion = max((i + 1 for i, t in enumerate(req.prompt_ids) if t == im_end), default=len(req.prompt_ids))
        session = self.reader.sessions[session_id]
        self._router_pending.setdefault(session_id, []).append({
            "request_id": req.request_id, "position": insertion, "router_label": req.router_label,
            "behind_at_turn_start": session.behind_at_turn_start, "asked_at": self.clock(),
        })

    async def _answer_router(self, session_id: str) -> None:
        """Answer pending router questions the reader has reached (the next chunk would pass them)."""
        pending = self._router_pending.get(session_id)
        if not pending:
            return
        session = self.reader.sessions[session_id]
        ready = [p for p in pending if session.committed <= p["position"] < session.committed + self.reader.grid]
        for item in ready:
            pending.remove(item)
            ids = self.render_question(ROUTER_QUESTION)
            letters = [chr(65 + i) for i in range(len(ROUTER_CLASSES))]
            result = await self.reader_exec.run(self.reader.ask, session_id, ids, letters, item["position"])
            self.ledger.add("reader_ask", result.gpu_ms)
            label = ROUTER_CLASSES[letters.index(result.label)]
            entry = {
                "ts": time.time(), "session": session_id, "request_id": item["request_id"], "label": label,
                "probability": round(result.probability, 6), "router_label": item["router_label"],
                "agree": (label == item["router_label"]) if item["router_label"] else None,
                "behind_at_turn_start": item["behind_at_turn_start"], "lag_s": round(self.clock() - item["asked_at"], 3),
                "position": item["position"],
            }
            await self._journal(entry)

    async def _journal(self, entry: dict[str, Any]) -> None:
        root = self.config.journal_dir
        if root is None:
            return
        async with self._journal_lock:
            Path(root).mkdir(parents=True, exist_ok=True)
            with open(Path(root) / "shadow.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "served_model": self.served.name,
            "shadow": self.options.mode,
            "turns": self.turns,
            "ledger_ms": {k: round(v, 3) for k, v in self.ledger.total_ms.items()},
            "idle_bursts": self.idle_bursts,
        }
        if self.reader is None:
            return out
        r = self.reader
        out.update({
            "slot": {"model": r.engine.name, "grid": r.grid, "device": str(r.engine.device), "dtype": str(r.engine.dtype).replace("torch.", ""),
                     "pool_pages": r.pool.num_pages, "pool_free_pages": r.pool.num_free},
            "sessions": [
                {"session": s.session_id, "position": s.committed, "known": len(s.ids), "backlog": s.backlog,
                 "behind": s.behind, "bytes": s.nbytes, "resident": s.is_resident,
                 "checkpoints": s.checkpoint_positions(), "rollbacks": s.stats.rollbacks,
                 "ids_reread": s.stats.ids_reread, "chunks_read": s.stats.chunks_read}
                for s in r.sessions.values()
            ],
            "backlog": sum(s.backlog for s in r.sessions.values()),
            "resident_bytes": r.resident_nbytes(),
            "last_answers": list(r.stats.last_answers),
            "router_pending": sum(len(v) for v in self._router_pending.values()),
        })
        stats = getattr(r.residency, "stats", None)
        if callable(stats):
            out["store"] = stats()
        return out
