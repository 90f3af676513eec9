"""What the routes ask of the server: turn a request into a turn of the conductor and the turn into answers.

    request --prepare (render + encode on a worker thread, limits, session)--> TurnPlan
    TurnPlan --drive (conductor.generate: the engine lock, the reader follows the turn)--> token ids
    ids --OutputText / Sections--> chunks or one answer;  on_turn --> usage ledger + metrics
    narrator on --> the conductor's live narrator summarises the thought during the turn (an SSE chunk with
    `qse_narrator` where the profile's ui.narrator asks, and the status); a turn with reasoning it did not
    summarise --> conductor.summarize after it, in the background

The service reaches the model only through the conductor and the chat format it was given.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import msgspec
import structlog

from ..core.ids import first_outside
from ..engine.grammar import ANY_JSON_OBJECT, Grammar, GrammarError, json_rule
from ..engine.sampling import SampleRecord, SamplingParams
from ..replay.usage import UsageRecord, append_usage
from ..runtime.conductor import Conductor, ConductorStopped, GenerateRequest, TurnRecord
from ..runtime.narrator import NARRATOR_QUESTION
from ..runtime.narrator import Narration as LiveNarration
from ..settings import SETTINGS, EngineSettings
from ..shadow.reader import SessionTooLong, ShadowError, UnknownSession
from . import wire
from .errors import ApiError, bad_request
from .metrics import ServerMetrics
from .profiles import Profile, effective_generation
from .admission import ABORT, SHUTDOWN, Admission, Ticket
from .tenants import LONE, Tenant
from .text import Deltas, OutputText, Sections

log = structlog.get_logger("qse.server")

SUMMARY_PROMPT = "Summarize this session so far in a few sentences."


@dataclass
class TurnPlan:
    """One request as the conductor will run it; `finish_reason` and `output_tokens` are set by drive()."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    session_id: str
    request_id: str
    router_label: str | None = None
    prompt_text: str = ""
    finish_reason: str = "length"
    output_tokens: int = 0
    n: int = 1  # choices, run one after another in the session (the later ones re-read only the tail)
    tools: list[dict[str, Any]] | None = None  # offered: the parser types each call's arguments by them
    echo: bool = False  # completions: the prompt's text before the answer's
    ticket: Ticket | None = None  # its place in admission (Service.admit); shared by the choices
    cached_tokens: int = 0  # prompt ids whose served state was reused (usage's prompt_tokens_details)
    parent: "TurnPlan | None" = None  # the request's plan, for a choice's plan (usage is the request's)
    narrations: list[LiveNarration] = field(default_factory=list)  # the live narrator's, not yet streamed
    narrated: bool = False  # the live narrator summarised this turn's thought
    prediction_ids: list[int] | None = None  # the request's predicted output, as ids (drafts), if it sent one
    draft_tokens: int = 0  # ids drafted for the turn (the conductor's count at its end)
    accepted_draft_tokens: int = 0

    def choice(self, index: int) -> "TurnPlan":
        """The plan of choice `index`: its own seed (seed + index) and its own record of logprobs."""
        seed = self.sampling.seed
        sampling = replace(self.sampling, seed=None if seed is None else seed + index, record=SampleRecord())
        return replace(self, sampling=sampling, finish_reason="length", output_tokens=0, n=1, parent=self,
                       narrations=[], narrated=False)


@dataclass
class Narration:
    session: str
    text: str
    tokens: int
    position: int
    gpu_ms: float
    at_s: float = field(default_factory=time.time)


def is_engine_failure(exc: BaseException) -> bool:
    """Errors after which the engine cannot serve again: its executor is gone, or the device's context is lost."""
    text = str(exc)
    return ("cannot schedule new futures" in text or type(exc).__name__ == "AcceleratorError"
            or text.startswith("CUDA error") or "illegal memory access" in text)


def is_out_of_memory(exc: BaseException) -> bool:
    """The device (or a pool) had no room for this request at this moment: the turn failed, the session's state
    went back to what it held before the failed piece, and the same request may succeed once others finish."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def head_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages up to and including the first user message: what conversations that merely share a system
    prompt (or a first question) have in common."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    return messages[: first_user + 1]


class Service:
    def __init__(self, conductor: Conductor, chat: Any, model_name: str, profile: Profile,
                 settings: EngineSettings = SETTINGS, ledger_path: Path | None = None, store: Any = None,
                 max_context_tokens: int | None = None, served_names: list[str] | tuple[str, ...] = (),
                 served_store: Any = None, planner: Any = None):
        """served_names: the names clients use for the model (--served-model-name); the first is the one
        answers carry. None given: the model's own name. planner: the residency planner (runtime/planner.py)
        that loads and releases the reader; `store` follows the reader it loads."""
        self.conductor = conductor
        self.chat = chat
        self.root_name = model_name
        self.model_names = list(served_names) or [model_name]
        self.model_name = self.model_names[0]
        self.profile = profile
        # a request's values over these: the profile's, else the checkpoint's generation_config.json, else defaults
        self.generation, self.generation_sources = effective_generation(
            profile.generation, getattr(chat, "generation_defaults", {}))
        self.settings = settings
        self.store = store
        self.planner = planner
        self.reader_load = "start"  # or "idle": the planner loads the reader once the service has started
        if planner is not None:
            self.store = planner.reader.residency if planner.reader is not None else store
            planner.on_reader = lambda reader: setattr(self, "store", reader.residency if reader else None)
        self.served_store = served_store  # the served sessions' host and disk tiers
        self.max_context_tokens = max_context_tokens
        self.created_s = int(time.time())
        self.ledger_path = ledger_path or settings.get("QSE_LEDGER") or settings.cache_dir() / "usage.jsonl"
        self.metrics = ServerMetrics(self.status, lambda: (self.admission.num_running, self.admission.num_waiting),
                                     self.model_name)
        self.narrations: dict[str, Narration] = {}
        self._background: set[asyncio.Task] = set()
        # the conductor's clock (monotonic) -> wall seconds, so one ledger file spans restarts
        self._wall_offset_s = time.time() - conductor.clock()
        previous = conductor.on_turn
        if previous is None:
            conductor.on_turn = self._on_turn
        else:
            def both(record: TurnRecord) -> None:
                previous(record)
                self._on_turn(record)

            conductor.on_turn = both
        self.max_prompt_tokens = settings.get("QSE_MAX_PROMPT_TOKENS")
        self.max_output_tokens = settings.get("QSE_MAX_OUTPUT_TOKENS")
        self.max_question_tokens = settings.get("QSE_MAX_QUESTION_TOKENS")
        self.admission = Admission(settings.get("QSE_MAX_RUNNING"), settings.get("QSE_MAX_WAITING"))
        self._ended: dict[str, str] = {}  # request id -> why its turn ended early, for the turn's record
        self.engine_error: str | None = None  # set once a turn failed in a way the engine cannot come back from
        self.is_draining = False

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.conductor.start()
        if self.planner is not None and self.reader_load == "idle":
            self.planner.start_when_idle(self.settings.get("QSE_SHADOW_IDLE_POLL_S"))
        status = self.conductor.status()
        slot = status.get("slot") or {}
        log.info("server_ready", model=self.model_name, profile=self.profile.name, shadow=self.profile.shadow.mode,
                 ledger=str(self.ledger_path), served_mode=status.get("served_mode"), reader_model=slot.get("model"),
                 reader_device=slot.get("device"), reader_kernels=slot.get("kernels"), reader_mode=slot.get("mode"),
                 reader_pool_pages=slot.get("pool_pages"), chat=getattr(self.chat, "sources", None),
                 generation=msgspec.structs.asdict(self.generation), generation_sources=self.generation_sources)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.planner is not None:
            await self.planner.stop()
        await self.conductor.stop()

    async def drain(self, grace_s: float) -> None:
        """A planned stop's first part: refuse new turns (503), let the admitted ones run for up to `grace_s`,
        then end them at their next decode step (a stream gets an error event and [DONE], an answer a 503)."""
        self.is_draining = True
        self.admission.refusal = ApiError(503, "the server is stopping; send the request again after the restart",
                                          code="server_stopping")
        if not await self.admission.wait_idle(grace_s):
            self.admission.end_all(SHUTDOWN)
            await self.admission.wait_idle(None)
        log.info("server_drained", grace_s=grace_s)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status, body) of /health: 200 ok, or 503 while stopping or once the engine failed."""
        if self.engine_error is not None:
            return 503, {"status": "error", "error": self.engine_error, "model": self.model_name}
        if self.is_draining:
            return 503, {"status": "stopping", "model": self.model_name}
        return 200, {"status": "ok", "model": self.model_name}

    @property
    def shadow_on(self) -> bool:
        return self.conductor.reader is not None

    # ---- requests into plans -------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """`model` may be left out (one model is served) or name the model or one of its aliases."""
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"the model {name!r} is not served here; GET /v1/models lists {self.model_names}",
                           param="model", code="model_not_found")

    def _max_tokens(self, asked: int | None) -> int:
        if asked is not None and asked > self.max_output_tokens:
            raise bad_request(f"max_tokens {asked} is over the limit of {self.max_output_tokens} "
                              "(QSE_MAX_OUTPUT_TOKENS)", "max_tokens", "max_tokens_exceeded")
        return asked if asked is not None else min(self.profile.generation.max_tokens, self.max_output_tokens)

    def _sampling(self, req: wire.ChatCompletionRequest | wire.CompletionRequest, prompt_ids: list[int],
                  top_logprobs: int | None, grammar: Grammar | None = None) -> SamplingParams:
        """The request's knobs over the profile's defaults; a knob left out is off (or the profile's)."""
        g = self.generation

        def pick(asked, default):
            return default if asked is None else asked

        repetition = pick(req.repetition_penalty, g.repetition_penalty)
        try:
            return SamplingParams(
                temperature=pick(req.temperature, g.temperature), top_p=pick(req.top_p, g.top_p), seed=req.seed,
                top_k=max(0, pick(req.top_k, g.top_k)), min_p=pick(req.min_p, g.min_p), repetition_penalty=repetition,
                presence_penalty=pick(req.presence_penalty, g.presence_penalty),
                frequency_penalty=pick(req.frequency_penalty, g.frequency_penalty),
                logit_bias=wire.check_logit_bias(req.logit_bias, self.chat.tokenizer.vocab_size),
                top_logprobs=top_logprobs, prompt_ids=tuple(prompt_ids) if repetition != 1.0 else (),
                grammar=grammar, record=SampleRecord())
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def _grammar(self, req: wire.ChatCompletionRequest, prompt: str, max_tokens: int,
                 tools: list[dict[str, Any]] | None) -> Grammar | None:
        """The grammar that holds the answer to response_format or a forced tool call; None for neither.
        Runs on a worker thread (the first call builds the vocabulary's token trie)."""
        forced = wire.forced_tools(req)
        fmt = req.response_format
        if forced is None and (fmt is None or fmt.type == "text"):
            return None
        if forced is not None:
            chosen = [t for t in tools or () if t["function"]["name"] in forced]
            rules, param = self.chat.tool_calls_rules(chosen, json_rule, req.parallel_tool_calls is not False), "tools"
        else:
            schema = ANY_JSON_OBJECT if fmt.type == "json_object" else fmt.json_schema.schema
            rules, param = "answer: " + json_rule(schema) + "\n", "response_format.json_schema.schema"
        closing = min(32, max_tokens // 2)
        # the reasoning may take half of what the answer's closing steps leave; the answer the rest
        lark = self.chat.answer_grammar(prompt, rules, max(0, (max_tokens - closing) // 2))
        try:
            return Grammar.compile(lark, self.chat.tokenizer.grammar_tokenizer(), max_tokens, closing)
        except GrammarError as exc:
            raise bad_request(f"the grammar of this request does not compile: {exc}", param, "invalid_schema") from None

    def _check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param, "empty_prompt")
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(f"the prompt has {len(ids)} tokens, over the limit of {self.max_prompt_tokens} "
                              "(QSE_MAX_PROMPT_TOKENS)", param, "context_length_exceeded")
        takes, why = self.turn_capacity()
        if takes is not None and len(ids) + max_tokens > takes:
            raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) is over the {takes} "
                              f"tokens a turn can hold on this server ({why}): send a prompt of at most "
                              f"{max(0, takes - max_tokens)} tokens, or a smaller max_tokens", param,
                              "context_length_exceeded")

    def turn_capacity(self) -> tuple[int | None, str]:
        """The most rows (prompt plus output) one turn can hold here, and what sets it: the model's window or
        the served model's KV pool (a turn past it could not be read, so it is refused up front)."""
        window = self.max_context_tokens
        pool = self.conductor.served_session_rows()
        if pool is not None and (window is None or pool < window):
            return pool, "the served model's KV pool, QSE_SERVED_KV_GB"
        return window, "the model's window"

    async def session_for(self, prompt_ids: list[int], explicit: str | None, tenant: Tenant,
                          head_tokens: int) -> str:
        """The conductor's id of the turn's session: the tenant's X-Session-Id, else the tenant's session this
        prompt continues past its first `head_tokens` (Conductor.map_session), else a new one of the tenant.
        The prefix search walks every session's ids: off the event loop."""
        if explicit:
            return tenant.key(explicit)
        mapped = await asyncio.to_thread(self.conductor.map_session, prompt_ids, None, tenant.namespace, head_tokens)
        return mapped or f"{tenant.namespace}s-{uuid.uuid4().hex[:16]}"

    async def prepare_chat(self, req: wire.ChatCompletionRequest, request_id: str, session: str | None,
                           router_label: str | None, tenant: Tenant = LONE) -> TurnPlan:
        self.check_model(req.model)
        wire.check_chat(req)
        messages = wire.template_messages(req.messages)
        tools = None if req.tool_choice == "none" else wire.template_tools(req.tools)
        thinking = wire.enable_thinking(req)
        max_tokens = self._max_tokens(req.max_completion_tokens or req.max_tokens)
        session = session or req.prompt_cache_key  # OpenAI's cache key names the session when no header does

        def render() -> tuple[str, list[int], int, list[int] | None]:
            text = self.chat.render(messages, tools, True, thinking)
            # the head two conversations may share (system prompt, first user turn): mapping by prefix needs more
            head = 0 if session else len(self.chat.tokenizer.encode(
                self.chat.render(head_messages(messages), tools, False, thinking)))
            predicted = self.chat.tokenizer.encode(req.prediction.text) if req.prediction is not None else None
            return text, self.chat.tokenizer.encode(text), head, predicted

        try:
            text, ids, head_tokens, predicted = await asyncio.to_thread(render)
        except ValueError as exc:  # the chat format refuses the messages (roles, order, arguments)
            raise bad_request(str(exc), "messages", "invalid_messages") from None
        self._check_prompt(ids, max_tokens, "messages")
        grammar = await asyncio.to_thread(self._grammar, req, text, max_tokens, tools)
        top = (req.top_logprobs or 0) if req.logprobs else None
        return TurnPlan(ids, max_tokens, self._sampling(req, ids, top, grammar), wire.stop_list(req.stop),
                        await self.session_for(ids, session, tenant, head_tokens), request_id, router_label, text,
                        n=req.n or 1, tools=tools, prediction_ids=predicted)

    async def prepare_completion(self, req: wire.CompletionRequest, request_id: str, session: str | None,
                                 router_label: str | None, tenant: Tenant = LONE) -> TurnPlan:
        self.check_model(req.model)
        wire.check_completion(req)
        max_tokens = self._max_tokens(req.max_tokens if req.max_tokens is not None else 16)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.chat.tokenizer.vocab_size
            bad = first_outside(prompt, vocab)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            ids, text = list(prompt), ""
        else:
            text = prompt[0] if isinstance(prompt, list) else prompt
            ids = await asyncio.to_thread(self.chat.tokenizer.encode, text)
        self._check_prompt(ids, max_tokens, "prompt")
        if req.echo and not text:
            text = await asyncio.to_thread(self.chat.tokenizer.decode, ids)
        # a raw prompt has no turns to tell a shared head from a continued conversation: its whole length is the
        # head, so it joins a session only by X-Session-Id
        return TurnPlan(ids, max_tokens, self._sampling(req, ids, req.logprobs), wire.stop_list(req.stop),
                        await self.session_for(ids, session, tenant, len(ids)), request_id, router_label, text,
                        n=req.n or 1, echo=req.echo)

    async def tokenize(self, req: wire.TokenizeRequest) -> wire.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", "prompt")
        tok = self.chat.tokenizer

        def run() -> list[int]:
            if req.prompt is not None:
                return tok.encode(req.prompt)
            text = self.chat.render(wire.template_messages(req.messages), None, req.add_generation_prompt)
            return tok.encode(text)

        try:
            ids = await asyncio.to_thread(run)
        except ValueError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from None
        strs = [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids] if req.return_token_strs else None
        return wire.TokenizeResponse(len(ids), self.max_context_tokens, ids, strs)

    async def detokenize(self, req: wire.DetokenizeRequest) -> wire.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.chat.tokenizer.vocab_size
        bad = first_outside(req.tokens, vocab)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return wire.DetokenizeResponse(await asyncio.to_thread(self.chat.tokenizer.decode, req.tokens))

    # ---- the turn ------------------------------------------------------------------------------
    async def drive(self, plan: TurnPlan, out: OutputText) -> AsyncIterator[int]:
        """Run the turn on the conductor; push each id into `out`, yield the count; stop at a stop string.
        With a ticket: wait for a running slot first, and end at the next decode step once the ticket has ended
        (a client that left: finish_reason "abort"; a planned stop: "shutdown", then a 503)."""
        req = GenerateRequest(prompt_ids=plan.prompt_ids, max_tokens=plan.max_tokens, sampling=plan.sampling,
                              stop_ids=tuple(self.chat.stop_ids), session_id=plan.session_id,
                              request_id=plan.request_id, router_label=plan.router_label,
                              narrate=self._narrated(plan) if self.profile.shadow.narrator == "on" else None,
                              prediction_ids=tuple(plan.prediction_ids or ()))
        ticket = plan.ticket
        if ticket is not None:  # a client that leaves before its first token ends the turn at the next round
            req.ended = lambda: ticket.ended
        plan.finish_reason = ABORT  # stays so if the consumer closes this before the end (a client that left)
        if ticket is not None:
            await self.admission.start(ticket)
        if ticket is None or not ticket.ended:
            try:
                async with aclosing(self.conductor.generate(req)) as tokens:
                    last_s = None  # when the previous id came: the gaps are the inter-token latencies
                    try:
                        async for token in tokens:
                            now_s = time.monotonic()
                            if last_s is not None:
                                self.metrics.itl_seconds.observe(now_s - last_s)
                            last_s = now_s
                            plan.cached_tokens = req.cached_tokens or 0
                            drafted = req.draft_tokens - plan.draft_tokens
                            kept = req.accepted_draft_tokens - plan.accepted_draft_tokens
                            plan.draft_tokens, plan.accepted_draft_tokens = req.draft_tokens, req.accepted_draft_tokens
                            if plan.parent is not None:
                                plan.parent.cached_tokens = max(plan.parent.cached_tokens, plan.cached_tokens)
                                plan.parent.draft_tokens += drafted  # (usage is the request's: its choices' sum)
                                plan.parent.accepted_draft_tokens += kept
                            out.push(token)
                            plan.output_tokens = out.num_ids
                            yield out.num_ids
                            if out.is_stopped or (ticket is not None and ticket.ended):
                                if not out.is_stopped:
                                    plan.finish_reason = self._ended[plan.request_id] = ticket.ended
                                break
                    except GeneratorExit:  # the consumer closed the turn: the client left (noted before the record)
                        self._ended[plan.request_id] = ABORT
                        raise
            except ShadowError as exc:
                raise bad_request(str(exc), None, "invalid_turn") from None
            except ConductorStopped:
                raise ApiError(503, "the server is stopping; send the request again after the restart",
                               code="server_stopping") from None
            except Exception as exc:
                if is_engine_failure(exc):
                    self._engine_failed(exc)
                elif is_out_of_memory(exc):
                    log.warning("turn_out_of_memory", request_id=plan.request_id, session=plan.session_id,
                                error=repr(exc))
                    raise ApiError(503, "the device had no memory left for this request; the session keeps what it "
                                   "held before it: send the request again", code="out_of_memory",
                                   headers={"Retry-After": "1"}) from None
                raise
        if ticket is not None and ticket.ended:
            plan.finish_reason = ticket.ended
            if ticket.ended == SHUTDOWN:
                raise ApiError(503, "the server stopped this turn at the end of its grace period "
                               "(QSE_STOP_GRACE_S); send the request again after the restart", code="server_stopping")
            return
        out.finish()
        record = plan.sampling.record
        if plan.sampling.grammar is not None and not out.is_stopped:
            # held to a grammar, the answer is complete only if the grammar ended it
            plan.finish_reason = "stop" if record is not None and record.grammar_done else "length"
        else:
            plan.finish_reason = "stop" if out.is_stopped or out.num_ids < plan.max_tokens else "length"

    def _narrated(self, plan: TurnPlan) -> Callable[[LiveNarration], None]:
        """The live narrator's delivery for this turn: the status keeps it; the stream sends it (ui.narrator)."""
        def deliver(n: LiveNarration) -> None:
            plan.narrated = True
            if self.profile.ui.narrator == "on":
                plan.narrations.append(n)
            self._keep_narration(n.session_id, n.text, n.tokens, n.position, n.gpu_ms)
        return deliver

    def _keep_narration(self, session_id: str, text: str, tokens: int, position: int, gpu_ms: float) -> None:
        self.narrations[session_id] = Narration(session_id, text, tokens, position, round(gpu_ms, 3))
        self.metrics.narrations.inc()

    def _engine_failed(self, exc: BaseException) -> None:
        self.engine_error = f"the engine failed ({type(exc).__name__}); restart the server"
        self.admission.refusal = ApiError(503, self.engine_error, code="engine_failed")
        log.error("engine_failed", error=repr(exc))

    def _usage(self, plan: TurnPlan, output_tokens: int | None = None) -> wire.Usage:
        n = len(plan.prompt_ids)
        out = plan.output_tokens if output_tokens is None else output_tokens
        details = None
        if plan.prediction_ids is not None:  # (drafts from the prompt count too: what the prediction offered)
            details = wire.CompletionTokensDetails(accepted_prediction_tokens=plan.accepted_draft_tokens,
                                                   rejected_prediction_tokens=plan.draft_tokens - plan.accepted_draft_tokens)
        return wire.Usage(prompt_tokens=n, completion_tokens=out, total_tokens=n + out,
                          prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=plan.cached_tokens),
                          completion_tokens_details=details)

    def _sections(self, plan: TurnPlan) -> Sections:
        prompt, tools = plan.prompt_text, plan.tools
        return Sections(lambda text, is_final: self.chat.parse(text, prompt, tools, is_final))

    @staticmethod
    def _chat_finish(plan: TurnPlan, sections: Sections) -> str:
        """"tool_calls" when the turn ended on whole calls; a call cut off (the budget, a stop) keeps the
        turn's own reason, and its arguments stay the unclosed JSON they were (as OpenAI's do)."""
        if sections.is_call_cut:
            log.warning("tool_call_cut", request=plan.request_id, finish_reason=plan.finish_reason,
                        function=sections.tool_calls[-1]["function"]["name"])
            return plan.finish_reason
        return "tool_calls" if sections.tool_calls and plan.finish_reason != "length" else plan.finish_reason

    # ---- log-probabilities -------------------------------------------------------------------------
    def _token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.chat.tokenizer.decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, plan: TurnPlan, start: int, end: int) -> wire.ChoiceLogprobs | None:
        """OpenAI's chat logprobs of the output's ids [start, end)."""
        record = plan.sampling.record
        if plan.sampling.top_logprobs is None or record is None:
            return None
        content = []
        for entry in record.logprobs[start:end]:
            text, raw = self._token_text(entry.token)
            top = []
            for tid, lp in entry.top:
                t, b = self._token_text(tid)
                top.append(wire.TopLogprob(t, lp, b))
            content.append(wire.TokenLogprobOut(text, entry.logprob, raw, top))
        return wire.ChoiceLogprobs(content)

    def _completion_logprobs(self, plan: TurnPlan, start: int, end: int, offset: int) -> wire.CompletionLogprobs | None:
        """The legacy completions' logprobs of the output's ids [start, end); offset: the first one's character."""
        record = plan.sampling.record
        if plan.sampling.top_logprobs is None or record is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for entry in record.logprobs[start:end]:
            text = self._token_text(entry.token)[0]
            tokens.append(text)
            values.append(entry.logprob)
            tops.append({self._token_text(t)[0]: lp for t, lp in entry.top})
            offsets.append(offset)
            offset += len(text)
        return wire.CompletionLogprobs(tokens, values, tops if plan.sampling.top_logprobs else None, offsets)

    # ---- chat ------------------------------------------------------------------------------------
    async def chat_chunks(self, plan: TurnPlan, include_usage: bool) -> AsyncIterator[wire.ChatCompletionChunk]:
        """The n choices' chunks, one choice after another, each chunk naming its choice by index."""
        cid, created = f"chatcmpl-{plan.request_id}", int(time.time())
        total = 0
        for index in range(plan.n):
            choice = plan.choice(index)
            async for chunk in self._choice_chunks(choice, index, cid, created):
                yield chunk
            total += choice.output_tokens
            plan.output_tokens, plan.finish_reason = total, choice.finish_reason
        if include_usage:
            yield wire.ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created,
                                           model=self.model_name, choices=[], usage=self._usage(plan, total))

    async def _choice_chunks(self, plan: TurnPlan, index: int, cid: str,
                             created: int) -> AsyncIterator[wire.ChatCompletionChunk]:
        def chunk(delta: wire.Delta, finish: str | None = None, logprobs=None) -> wire.ChatCompletionChunk:
            return wire.ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created,
                                            model=self.model_name,
                                            choices=[wire.ChunkChoice(index, delta, finish, logprobs)])

        yield chunk(wire.Delta(role="assistant", content=""))
        out = OutputText(self.chat.tokenizer.decode, plan.stops)
        sections = self._sections(plan)
        sent_ids = 0  # output ids whose logprobs went out
        def narrator_chunks():
            while plan.narrations:  # delivered between two decode rounds: goes out before the next token's text
                n = plan.narrations.pop(0)
                yield wire.ChatCompletionChunk(
                    id=cid, object="chat.completion.chunk", created=created, model=self.model_name,
                    choices=[wire.ChunkChoice(index, wire.Delta(), None)],
                    qse_narrator=wire.NarratorEvent(n.text, n.tokens, n.position, n.gpu_ms))

        async for _ in self.drive(plan, out):
            for c in narrator_chunks():
                yield c
            d = sections.update(out.visible)
            if d:
                lp = self._chat_logprobs(plan, sent_ids, out.num_ids)
                sent_ids = out.num_ids
                yield chunk(self._delta(d), None, lp)
        for c in narrator_chunks():
            yield c
        d = sections.finish(out.text)
        lp = self._chat_logprobs(plan, sent_ids, out.num_ids)
        if d or (lp is not None and lp.content):
            yield chunk(self._delta(d), None, lp)
        yield chunk(wire.Delta(), self._chat_finish(plan, sections))
        self.after_chat(plan, sections.reasoning)

    @staticmethod
    def _delta(d: Deltas) -> wire.Delta:
        calls = [wire.ToolCallDelta(c["index"], wire.FunctionCallDelta(**c["function"]), c.get("id"), c.get("type"))
                 for c in d.tool_calls]
        return wire.Delta(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)

    async def _run_whole(self, choice: TurnPlan) -> OutputText:
        """One choice of a non-streamed answer, run to its end: its text as the stops left it."""
        out = OutputText(self.chat.tokenizer.decode, choice.stops)
        async for _ in self.drive(choice, out):
            pass
        return out

    async def chat_answer(self, plan: TurnPlan) -> wire.ChatCompletion:
        choices, total = [], 0
        for index in range(plan.n):
            choice = plan.choice(index)
            out = await self._run_whole(choice)
            sections = self._sections(choice)
            sections.finish(out.text)
            calls = [wire.ToolCallOut(id=c["id"], type=c["type"], function=wire.FunctionCallOut(**c["function"]))
                     for c in sections.tool_calls]
            content = sections.content if (sections.content or not calls) else None  # null beside tool calls
            message = wire.ChatMessageOut(role="assistant", content=content,
                                          reasoning_content=sections.reasoning or None, tool_calls=calls or None)
            self.after_chat(choice, sections.reasoning)
            finish = self._chat_finish(choice, sections)
            choices.append(wire.ChatChoice(index, message, finish, self._chat_logprobs(choice, 0, out.num_ids)))
            total += choice.output_tokens
            plan.output_tokens, plan.finish_reason = total, finish
        return wire.ChatCompletion(id=f"chatcmpl-{plan.request_id}", object="chat.completion", created=int(time.time()),
                                   model=self.model_name, choices=choices, usage=self._usage(plan, total))

    # ---- completions -----------------------------------------------------------------------------
    async def completion_chunks(self, plan: TurnPlan, include_usage: bool) -> AsyncIterator[wire.Completion]:
        cid, created = f"cmpl-{plan.request_id}", int(time.time())
        total = 0
        for index in range(plan.n):
            choice = plan.choice(index)

            def chunk(text: str, finish: str | None = None, logprobs=None) -> wire.Completion:
                return wire.Completion(id=cid, object="text_completion", created=created, model=self.model_name,
                                       choices=[wire.CompletionChoice(index, text, finish, logprobs)])

            if choice.echo:
                yield chunk(choice.prompt_text)
            out = OutputText(self.chat.tokenizer.decode, choice.stops)
            sent = sent_ids = 0
            async for _ in self.drive(choice, out):
                visible = out.visible
                if len(visible) > sent:
                    yield chunk(visible[sent:], None, self._completion_logprobs(choice, sent_ids, out.num_ids, sent))
                    sent, sent_ids = len(visible), out.num_ids
            yield chunk(out.text[sent:], choice.finish_reason,
                        self._completion_logprobs(choice, sent_ids, out.num_ids, sent))
            total += choice.output_tokens
            plan.output_tokens, plan.finish_reason = total, choice.finish_reason
        if include_usage:
            yield wire.Completion(id=cid, object="text_completion", created=created, model=self.model_name,
                                  choices=[], usage=self._usage(plan, total))

    async def completion_answer(self, plan: TurnPlan) -> wire.Completion:
        choices, total = [], 0
        for index in range(plan.n):
            choice = plan.choice(index)
            out = await self._run_whole(choice)
            head = choice.prompt_text if choice.echo else ""
            choices.append(wire.CompletionChoice(index, head + out.text, choice.finish_reason,
                                                 self._completion_logprobs(choice, 0, out.num_ids, len(head))))
            total += choice.output_tokens
            plan.output_tokens, plan.finish_reason = total, choice.finish_reason
        return wire.Completion(id=f"cmpl-{plan.request_id}", object="text_completion", created=int(time.time()),
                               model=self.model_name, choices=choices, usage=self._usage(plan, total))

    # ---- after a turn --------------------------------------------------------------------------
    def _on_turn(self, record: TurnRecord) -> None:
        """Every finished turn: one usage-ledger line and the turn's metrics."""
        m = self.metrics
        m.prompt_tokens.inc(record.prompt_tokens)
        m.prefix_cache_queries.inc(record.prompt_tokens)
        m.prefix_cache_hits.inc(record.cached_tokens)
        if record.cache_tier is not None:
            m.note_cache_hit(record.cache_tier)
        m.output_tokens.inc(record.output_tokens)
        m.spec_draft_tokens.inc(record.draft_tokens)
        m.spec_accepted_tokens.inc(record.accepted_draft_tokens)
        finish = self._ended.pop(record.request_id, record.finish_reason)  # the conductor counts a cut turn as length
        m.note_finished(finish)
        self.admission.note_turn(record.end_s - (record.start_s if record.start_s is not None else record.arrival_s))
        if record.first_token_s is not None:
            m.ttft_seconds.observe(max(0.0, record.first_token_s - record.arrival_s))
            m.decode_seconds.inc(max(0.0, record.end_s - record.first_token_s))
            m.reader_ration_wall_seconds.inc(record.reader_ration_wall_ms / 1e3)
        if record.reader_behind_tokens is not None and self.conductor.reader is not None:
            m.note_turn_start(record.reader_behind_tokens, self.conductor.reader.grid)
        if record.decode_tokens_per_s > 0:
            m.decode_tokens_per_second.observe(record.decode_tokens_per_s)
            m.reader_share.observe(record.reader_share)
        wall = self._wall_offset_s
        first = record.first_token_s if record.first_token_s is not None else record.end_s
        usage = UsageRecord(session=record.session_id or "", arrival_s=round(record.arrival_s + wall, 6),
                            first_token_s=round(first + wall, 6), end_s=round(record.end_s + wall, 6),
                            prompt_tokens=record.prompt_tokens, shared_prefix_tokens=record.shared_prefix_tokens,
                            output_tokens=record.output_tokens, model=record.model,
                            cached_tokens=record.cached_tokens)
        try:
            Path(self.ledger_path).parent.mkdir(parents=True, exist_ok=True)
            append_usage(self.ledger_path, usage)
        except OSError as exc:  # the ledger must never fail a request
            log.error("ledger_write_failed", path=str(self.ledger_path), error=repr(exc))

    def after_chat(self, plan: TurnPlan, reasoning: str | None) -> None:
        shadow = self.profile.shadow
        if reasoning and shadow.narrator == "on" and self.shadow_on and not plan.narrated:
            self._spawn(self._narrate(plan.session_id), f"qse-narrator-{plan.session_id}")

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _narrate(self, session_id: str) -> None:
        try:
            result = await self.conductor.summarize(session_id, NARRATOR_QUESTION,
                                                    self.profile.shadow.narrator_max_tokens)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the narrator must never take the server down
            log.error("narration_failed", session=session_id, error=repr(exc))
            return
        self._keep_narration(session_id, result.text, len(result.token_ids), result.position, result.gpu_ms)
        log.info("narration", session=session_id, text=result.text, tokens=len(result.token_ids),
                 position=result.position, gpu_ms=round(result.gpu_ms, 3))

    async def wait_background(self) -> None:
        """Wait for the narrator tasks in flight (tests, and a stop)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ---- the shadow ----------------------------------------------------------------------------
    def _need_shadow(self) -> None:
        if self.shadow_on:
            return
        state = self.planner.book.state("reader").value if self.planner is not None else "off"
        if state == "off":
            raise ApiError(409, f"the shadow reader is off in profile {self.profile.name!r}", code="shadow_off")
        raise ApiError(409, f"the shadow reader is {state}, not loaded; GET /v1/conductor/shadow/status shows "
                       "its role, POST /v1/conductor/shadow/reader {\"action\": \"load\"} loads it",
                       code="shadow_not_loaded")

    async def reader_action(self, action: str, tenant: Tenant = LONE) -> dict[str, Any]:
        """Load or release the reader (the residency planner): the admin's (or the lone tenant's) only."""
        from ..runtime.planner import ResidencyError

        if not tenant.sees_all:
            raise ApiError(403, "loading and releasing the reader is for the admin tenant", code="forbidden")
        if self.planner is None:
            raise ApiError(409, "this server has no residency planner", code="shadow_off")
        try:
            if action == "load":
                verdict = await self.planner.load_reader()
                out = {"role": "reader", "state": "loaded", "verdict": verdict.message}
            else:
                out = await self.planner.release_reader()
        except ResidencyError as exc:
            raise ApiError(409, str(exc), code=exc.code) from None
        out["residency"] = self.planner.status()
        return out

    @staticmethod
    def _reader_full(session: str, exc: BaseException) -> ApiError:
        """A question the reader's KV pool cannot hold: for good (the session is longer than the whole pool, a
        400: asking again cannot help), or for now (the room is held by others, a 503 to send again)."""
        if isinstance(exc, SessionTooLong):
            return ApiError(400, f"session {session!r} is too long for the reader: answering on it needs {exc.rows} "
                            f"rows, and the reader's KV pool holds {exc.max_rows} (QSE_SHADOW_GB sizes it)",
                            param="session", code="session_too_long")
        log.warning("ask_out_of_memory", session=session, error=str(exc))
        return ApiError(503, f"the reader has no room for a question on session {session!r} now; send it again",
                        code="reader_busy", headers={"Retry-After": "1"})

    @staticmethod
    def _unknown(session: str) -> ApiError:
        return ApiError(404, f"unknown session {session!r}; GET /v1/conductor/shadow/status lists yours",
                        param="session", code="session_not_found")

    async def ask(self, req: wire.AskRequest, tenant: Tenant = LONE) -> wire.AskResponse:
        self._need_shadow()
        dup = next((c for c in req.choices if req.choices.count(c) > 1), None)
        if dup is not None:
            raise bad_request(f"choice {dup!r} appears twice; choices must differ", "choices", "duplicate_choice")
        key = tenant.key(req.session)
        try:
            session = self.conductor.reader.get(key)
        except UnknownSession:
            raise self._unknown(req.session) from None
        if req.at is not None and not session.committed <= req.at <= len(session.ids):
            raise bad_request(f"at={req.at} is outside [{session.committed}, {len(session.ids)}]: the reader can "
                              "answer between its committed rows and the last id it knows", "at")
        n = len(await asyncio.to_thread(self.chat.tokenizer.encode, req.question))
        if n > self.max_question_tokens:
            raise bad_request(f"the question has {n} tokens, over the limit of {self.max_question_tokens} "
                              "(QSE_MAX_QUESTION_TOKENS)", "question", "question_too_long")
        try:
            result = await self.conductor.ask(key, req.question, list(req.choices), req.at, req.behind)
        except UnknownSession:
            raise self._unknown(req.session) from None
        except SessionTooLong as exc:
            raise self._reader_full(req.session, exc) from None
        except ShadowError as exc:
            raise bad_request(str(exc), None, "invalid_question") from None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise self._reader_full(req.session, exc) from None
        self.metrics.asks.inc()
        return wire.AskResponse(session=tenant.shown(result.session_id), distribution=result.distribution,
                                label=result.label, probability=result.probability, position=result.position,
                                committed=result.committed,
                                latency_ms=round(result.latency_ms, 3), gpu_ms=round(result.gpu_ms, 3),
                                read_tokens=result.read_tokens, behind=result.behind)

    async def summarize(self, req: wire.SummarizeRequest, tenant: Tenant = LONE) -> wire.SummaryResponse:
        self._need_shadow()
        prompt = req.prompt or SUMMARY_PROMPT
        n = len(await asyncio.to_thread(self.chat.tokenizer.encode, prompt))
        if n > self.max_question_tokens:
            raise bad_request(f"the prompt has {n} tokens, over the limit of {self.max_question_tokens} "
                              "(QSE_MAX_QUESTION_TOKENS)", "prompt", "question_too_long")
        try:
            result = await self.conductor.summarize(tenant.key(req.session), prompt, req.max_tokens, req.behind)
        except UnknownSession:
            raise self._unknown(req.session) from None
        except SessionTooLong as exc:
            raise self._reader_full(req.session, exc) from None
        except ShadowError as exc:
            raise bad_request(str(exc), None, "invalid_question") from None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise self._reader_full(req.session, exc) from None
        return wire.SummaryResponse(session=tenant.shown(result.session_id), text=result.text,
                                    tokens=len(result.token_ids), position=result.position,
                                    gpu_ms=round(result.gpu_ms, 3),
                                    ms_per_token=round(result.ms_per_token, 3),
                                    read_tokens=result.read_tokens, behind=result.behind)

    def status(self, tenant: Tenant | None = None) -> dict[str, Any]:
        """The conductor's status, the parked sessions and the narrations; with `tenant`, only what it owns,
        under the ids it uses (None: everything, for /metrics). No absolute paths."""
        out = self.conductor.status()  # built from snapshots the owning threads publish
        out["profile"] = self.profile.name
        out["queue"] = {"running": self.admission.num_running, "waiting": self.admission.num_waiting}
        if self.store is not None:
            parked = list(self.store.parked.values())  # one C-level copy: never iterated as it changes
            out["parked"] = [{"session": p.session_id, "bytes": p.nbytes, "written_s": p.written_s,
                              "committed": p.committed} for p in parked]
        for store in (out.get("store"), (out.get("served_cache") or {}).get("store")):
            if isinstance(store, dict) and "disk_dir" in store:
                store["disk"] = store.pop("disk_dir") is not None  # where it is is the operator's business
        out["narrations"] = {sid: {"text": n.text, "tokens": n.tokens, "position": n.position, "at_s": n.at_s}
                             for sid, n in list(self.narrations.items())[-32:]}
        if self.planner is not None:
            out["residency"] = self.planner.status()  # the roles, their claims, what is loaded
        return out if tenant is None else tenant_view(out, tenant)


def tenant_view(status: dict[str, Any], tenant: Tenant) -> dict[str, Any]:
    """`status` as `tenant` may see it: its own sessions under its own ids; no other tenant's request ids."""
    if tenant.sees_all and not tenant.name:
        return status
    out = dict(status)

    def own(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "session": tenant.shown(r["session"])} for r in rows if tenant.owns(r["session"])]

    for name in ("sessions", "last_answers", "parked"):
        if isinstance(out.get(name), list):
            out[name] = own(out[name])
    if "sessions" in out and "backlog" in out:
        out["backlog"] = sum(s["backlog"] for s in out["sessions"])
    out["narrations"] = {tenant.shown(sid): n for sid, n in out.get("narrations", {}).items() if tenant.owns(sid)}
    narrator = out.get("narrator")
    if isinstance(narrator, dict) and isinstance(narrator.get("recent"), list):  # (session, request id, text)
        out["narrator"] = {**narrator, "recent": [{**n, "session_id": tenant.shown(n["session_id"])}
                                                  for n in narrator["recent"] if tenant.owns(n["session_id"])]}
    if not tenant.sees_all:
        out["running"] = bool(out.get("running"))  # whether a request runs, not whose
    return out
