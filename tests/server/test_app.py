"""The app in process (httpx.ASGITransport): SSE framing, tool-call deltas, stop strings, the router's header,
the narrator, metrics, the API key, the root path, the ledger. A scripted conductor stands in for the model
where a test needs a known output (the embedded model's weights are random)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from qse.replay.usage import read_usage
from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions, TurnRecord
from qse.server.app import create_app
from qse.server.profiles import Profile, ShadowBlock, UiBlock
from qse.server.service import Service
from qse.settings import EngineSettings
from qse.shadow.reader import ShadowReader

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
SCRIPT = ("The user wants the file read first.\n</think>\n\nI will read it.\n\n<tool_call>\n<function=read_file>\n"
          "<parameter=path>\nsrc/main.py\n</parameter>\n</function>\n</tool_call>")


class ScriptedConductor:
    """The conductor's public surface, answering a fixed text (one id at a time)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.clock = time.monotonic
        self.on_turn = None
        self.reader = None
        self.turns = 0

    async def start(self):
        pass

    async def stop(self):
        pass

    def map_session(self, prompt_ids, explicit, namespace="", head_tokens=0):
        return explicit

    def served_session_rows(self):
        return None  # no KV pool: the window alone bounds a turn

    async def generate(self, req):
        arrival = self.clock()
        n = 0
        try:
            for token in self.ids[: req.max_tokens]:
                n += 1
                await asyncio.sleep(0)
                yield token
        finally:
            self.turns += 1
            now = self.clock()
            self.on_turn(TurnRecord(req.request_id, req.session_id, arrival, arrival, now, len(req.prompt_ids), 0, n,
                                    "scripted", 0.0, 1.0, 0.0, "length", float(n), 0.0))

    def status(self):
        return {"served_model": "scripted", "shadow": "off", "turns": self.turns, "ledger_ms": {}, "idle_bursts": 0}


def settings_for(tmp_path: Path, **env: str) -> EngineSettings:
    return EngineSettings({"QSE_CACHE_DIR": str(tmp_path), "QSE_LEDGER": str(tmp_path / "usage.jsonl"), **env})


def real_service(engine, tmp_path: Path, profile: Profile | None = None, **env: str) -> Service:
    profile = profile or Profile(shadow=ShadowBlock())  # a shadow block: the reader on
    s = profile.shadow
    reader = ShadowReader(engine, grid=64, pool_bytes=16 << 20) if s.mode == "on" else None
    conductor = Conductor(engine, reader, ShadowOptions(s.mode, s.narrator, s.router, s.router_min_tokens),
                          Policy(idle_poll_s=0.05, journal_dir=tmp_path / "shadow"))
    return Service(conductor, engine.chat, engine.name, profile, settings_for(tmp_path, **env),
                   max_context_tokens=engine.cfg.max_position_embeddings)


def scripted_service(engine, tmp_path: Path, text: str = SCRIPT, **env: str) -> Service:
    ids = engine.chat.tokenizer.encode(text)
    return Service(ScriptedConductor(ids), engine.chat, "scripted", Profile(shadow=ShadowBlock(mode="off")),
                   settings_for(tmp_path, **env))


@asynccontextmanager
async def serving(service: Service, headers: dict | None = None, root_path: str | None = None):
    await service.start()
    app = create_app(service, root_path=root_path)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=headers or {}, timeout=60) as client:
            yield client
    finally:
        await service.stop()


def body(model: str, content: str = "Hello there, how are you today?", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def sse_events(raw: bytes) -> list:
    """A strict SSE parse: every frame one `data: ` line and a blank line; [DONE] last."""
    text = raw.decode()
    assert text.endswith("\n\n")
    frames = [f for f in text[:-2].split("\n\n") if f != ": keep-alive"]  # (a client skips comments)
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


async def test_sse_framing_usage_and_headers(tiny_engine, tmp_path):
    service = real_service(tiny_engine, tmp_path)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", headers={"X-Request-Id": "req-1", "X-Session-Id": "sess-1"},
                              json=body(service.model_name, stream=True, max_tokens=6, temperature=0,
                                        stream_options={"include_usage": True}))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "req-1" and r.headers["x-session-id"] == "sess-1"
        events = sse_events(r.content)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["id"] == "chatcmpl-req-1" and e["object"] == "chat.completion.chunk" for e in events)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
        streamed = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events if e["choices"])

        r = await client.post("/v1/chat/completions", headers={"X-Session-Id": "sess-2"},
                              json=body(service.model_name, max_tokens=6, temperature=0))
        answer = r.json()
        assert answer["choices"][0]["message"]["reasoning_content"] == streamed  # greedy: the same turn
        assert answer["usage"] == {"prompt_tokens": events[-1]["usage"]["prompt_tokens"], "completion_tokens": 6,
                                   "total_tokens": events[-1]["usage"]["total_tokens"],
                                   "prompt_tokens_details": {"cached_tokens": 0}}  # a prompt under one grid chunk
        status = (await client.get("/v1/conductor/shadow/status")).json()
        known = {s["session"]: s["known"] for s in status["sessions"]}
        assert known == {"sess-1": answer["usage"]["total_tokens"], "sess-2": answer["usage"]["total_tokens"]}


async def test_tool_calls_stream_as_they_form(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body("scripted", stream=True, tools=TOOLS, max_tokens=64))
        events = sse_events(r.content)
        deltas = [e["choices"][0]["delta"] for e in events]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert reasoning == "The user wants the file read first."
        assert content == "I will read it."
        # the first piece names the call; the arguments follow in pieces, in later events, as they are written
        assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert calls[0]["function"]["name"] == "read_file"
        assert len(calls) > 2 and all(c == {"index": 0, "function": {"arguments": c["function"]["arguments"]}}
                                      for c in calls[1:])
        assert "".join(c["function"]["arguments"] for c in calls) == json.dumps({"path": "src/main.py"})
        first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert "".join(d.get("content") or "" for d in deltas[:first_call + 1]) == content  # content went first
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # content never carries the call's markup, even part of it
        assert "<" not in content

        r = await client.post("/v1/chat/completions", json=body("scripted", tools=TOOLS, max_tokens=64))
        message = r.json()["choices"][0]["message"]
        assert message["content"] == "I will read it." and message["reasoning_content"] == reasoning
        assert message["tool_calls"][0]["function"]["name"] == "read_file"
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


async def test_content_streams_live_with_tools_offered(tiny_engine, tmp_path):
    text = "plan\n</think>\n\n" + " ".join(f"word{i}" for i in range(40))
    service = scripted_service(tiny_engine, tmp_path, text)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body("scripted", stream=True, tools=TOOLS, max_tokens=200))
        events = sse_events(r.content)
        pieces = [e["choices"][0]["delta"].get("content") for e in events[1:]]
        pieces = [p for p in pieces if p]
        assert "".join(pieces) == text.split("\n\n", 1)[1]
        assert len(pieces) > 10  # sent as it came, not held to the end
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_cut_tool_call_is_reported_as_cut(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path)
    tok = tiny_engine.chat.tokenizer
    budget = len(tok.encode(SCRIPT[:SCRIPT.index("main.py")]))  # the budget ends inside the path
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body("scripted", tools=TOOLS, max_tokens=budget))
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"  # never "tool_calls" for a call that did not close
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "read_file" and call["arguments"].startswith('{"path": "src/')
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["arguments"])
        r = await client.post("/v1/chat/completions", json=body("scripted", tools=TOOLS, max_tokens=budget,
                                                                stream=True))
        events = sse_events(r.content)
        pieces = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert "".join(c["function"]["arguments"] for c in pieces) == call["arguments"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_content_streams_live_without_tools_and_stops_at_a_stop_string(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path, "plan\n</think>\n\nalpha beta gamma delta epsilon zeta eta")
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body("scripted", stream=True, stop=["delta"]))
        events = sse_events(r.content)
        contents = [e["choices"][0]["delta"].get("content") or "" for e in events[1:]]
        assert "".join(contents) == "alpha beta gamma "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        r = await client.post("/v1/completions", json={"model": "scripted", "prompt": "x", "stop": "gamma",
                                                       "max_tokens": 64, "stream": True})
        events = sse_events(r.content)
        assert "".join(e["choices"][0]["text"] for e in events) == "plan\n</think>\n\nalpha beta "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_router_class_header_reaches_the_journal(tiny_engine, tmp_path):
    profile = Profile(name="routed", shadow=ShadowBlock(router="shadow", router_min_tokens=32))
    service = real_service(tiny_engine, tmp_path, profile)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", headers={"X-Router-Class": "code_edit"},
                              json=body(service.model_name, "Please fix the failing test in the parser module. " * 10,
                                        max_tokens=4, temperature=0))
        assert r.status_code == 200
        journal = tmp_path / "shadow" / "shadow.jsonl"
        deadline = time.monotonic() + 20
        while not journal.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        entry = json.loads(journal.read_text().splitlines()[0])
        assert entry["router_label"] == "code_edit" and entry["session"] == r.headers["x-session-id"]
        assert entry["agree"] == (entry["label"] == "code_edit")
        status = (await client.get("/v1/conductor/shadow/status")).json()
        assert status["router"] == {"answered": 1, "compared": 1, "agreed": int(entry["agree"])}
        assert 'qse_router_shadow_answers_total{kind="answered"} 1.0' in (await client.get("/metrics")).text


async def test_narrator_summarizes_a_turn_with_reasoning(tiny_engine, tmp_path):
    profile = Profile(name="narrated", shadow=ShadowBlock(narrator="on", narrator_max_tokens=4))
    service = real_service(tiny_engine, tmp_path, profile)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body(service.model_name, max_tokens=4, temperature=0))
        assert r.json()["choices"][0]["message"]["reasoning_content"]
        await service.wait_background()
        status = (await client.get("/v1/conductor/shadow/status")).json()
        narration = status["narrations"][r.headers["x-session-id"]]
        assert 1 <= narration["tokens"] <= 4
        assert status["ledger_ms"]["narrator"] > 0
        r = await client.post("/v1/conductor/shadow/summarize", json={"session": r.headers["x-session-id"],
                                                                      "max_tokens": 3})
        assert r.status_code == 200 and 1 <= r.json()["tokens"] <= 3


async def test_api_key_guards_all_but_healthz(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path, QSE_API_KEY="k-123")
    async with serving(service) as client:
        assert (await client.get("/healthz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k-123"}):
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/metrics", "/v1/conductor/shadow/status"):
            assert (await client.get(path)).status_code == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer k-123"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"


async def test_root_path_with_and_without_a_stripping_proxy(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path)
    async with serving(service, root_path="/api/qse") as client:
        assert (await client.get("/api/qse/v1/models")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 200
        r = await client.get("/api/qse/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await client.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


async def test_limits_and_errors_in_openai_shape(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path, QSE_MAX_BODY_BYTES="2000", QSE_MAX_PROMPT_TOKENS="50",
                               QSE_MAX_OUTPUT_TOKENS="32")
    async with serving(service) as client:
        cases = [
            (body("scripted", "x " * 1200), 413, "request_too_large"),
            (body("scripted", "word " * 80), 400, "context_length_exceeded"),
            (body("scripted", max_tokens=33), 400, "max_tokens_exceeded"),
            (body("other-model"), 404, "model_not_found"),
            ({"model": "scripted", "messages": [{"role": "assistant", "content": "no user"}]}, 400, "invalid_messages"),
        ]
        for payload, status, code in cases:
            r = await client.post("/v1/chat/completions", json=payload)
            assert r.status_code == status, r.text
            assert r.json()["error"]["code"] == code and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await client.post("/v1/conductor/shadow/ask", json={"session": "s", "question": "q", "choices": ["A"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "shadow_off"
        assert (await client.post("/v1/chat/completions", json=body("scripted", max_tokens=3))).status_code == 200


async def test_every_turn_is_a_ledger_record_and_metrics_count_it(tiny_engine, tmp_path):
    service = real_service(tiny_engine, tmp_path)
    async with serving(service) as client:
        for i in range(2):
            r = await client.post("/v1/completions", json={"model": service.model_name, "prompt": "count: 1 2 3",
                                                           "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        records = read_usage(tmp_path / "usage.jsonl")  # checks every record's consistency
        assert [r.output_tokens for r in records] == [3, 3]
        assert records[0].model == service.model_name and records[0].arrival_s > 1e9  # wall-clock seconds
        text = (await client.get("/metrics")).text
        for name in ("qse_request_seconds_bucket", "qse_ttft_seconds_count", "qse_decode_tokens_per_second_count",
                     'qse_device_ms_total{role="served_decode"}', "qse_shadow_sessions_caught_up",
                     "qse_shadow_backlog_tokens_sum", f'qse_output_tokens_total{{model_name="{service.model_name}"}} 6.0'):
            assert name in text, name


async def test_metrics_a_dashboard_can_use(tiny_engine, tmp_path):
    parser = pytest.importorskip("prometheus_client.parser")
    service = real_service(tiny_engine, tmp_path)
    model = service.model_name
    async with serving(service) as client:
        gaps = 0
        for session in ("dash-1", "dash-1", "dash-2"):
            r = await client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                                  json=body(model, "Count to ten, slowly. " * 8, max_tokens=4, temperature=0))
            assert r.status_code == 200
            gaps += r.json()["usage"]["completion_tokens"] - 1
        families = {f.name: f for f in parser.text_string_to_metric_families((await client.get("/metrics")).text)}

    def samples(name: str, suffix: str = "") -> dict[tuple, float]:
        return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples if s.name == name + suffix}

    assert not [s for f in families.values() for s in f.samples if "session" in s.labels]  # sessions churn
    assert families["qse_itl_seconds"].type == "histogram"
    assert samples("qse_itl_seconds", "_count") == {(("model_name", model),): gaps}  # one a token after the first
    for name in ("qse_requests_running", "qse_requests_waiting"):
        assert families[name].type == "gauge" and samples(name) == {(("model_name", model),): 0}
    for name in ("qse_ttft_seconds", "qse_request_seconds", "qse_decode_tokens_per_second"):
        assert all(dict(labels)["model_name"] == model for labels in samples(name, "_count")), name
    # the second turn of dash-1 is the only follow-up turn start; the reader had not read its prompt yet
    starts = samples("qse_shadow_turn_starts", "_total")
    assert sum(starts.values()) == 1 and set(starts) == {(("fresh", f), ("model_name", model)) for f in
                                                         ("true", "false")}
    assert samples("qse_shadow_behind_at_turn_start_tokens", "_count") == {(("model_name", model),): 1}
    for name in ("qse_decode_seconds", "qse_reader_ration_wall_seconds"):
        assert families[name].type == "counter" and name + "_total" in {s.name for s in families[name].samples}
    assert samples("qse_shadow_sessions") == {(): 2}
    # every series the Grafana dashboard charts is one this server writes
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/qse.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    written = {s.name for f in families.values() for s in f.samples}
    charted = {name for e in exprs for name in re.findall(r"\bqse_\w+", e)}
    assert len(charted) > 10 and charted <= written, charted - written
    assert {"qse_itl_seconds_bucket", "qse_ttft_seconds_bucket", "qse_reader_ration_wall_seconds_total",
            "qse_shadow_turn_starts_total"} <= charted


async def test_the_openai_client_reads_tool_calls_streamed_and_whole(tiny_engine, tmp_path):
    openai = pytest.importorskip("openai")
    service = scripted_service(tiny_engine, tmp_path)
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            messages = [{"role": "user", "content": "Read src/main.py"}]
            stream = await client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS,
                                                          stream=True, stream_options={"include_usage": True})
            names, arguments, finish, usage = [], "", None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for call in choice.delta.tool_calls or []:
                        if call.function.name:
                            names.append(call.function.name)
                        arguments += call.function.arguments or ""
                    finish = choice.finish_reason or finish
            assert names == ["read_file"] and json.loads(arguments) == {"path": "src/main.py"}
            assert finish == "tool_calls" and usage.completion_tokens == len(tiny_engine.chat.tokenizer.encode(SCRIPT))
            answer = await client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
            call = answer.choices[0].message.tool_calls[0]
            assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "src/main.py"}
            assert answer.choices[0].message.reasoning_content == "The user wants the file read first."
    finally:
        await service.stop()


async def test_the_live_narrator_streams_before_the_answer_ends_and_the_openai_client_reads_on(
        tiny_engine, tmp_path, scripted_sampler):
    openai = pytest.importorskip("openai")
    tok, chat = tiny_engine.chat.tokenizer, tiny_engine.chat
    thought, answer = tok.encode("The user says hello; I will greet them."), tok.encode(" Hello to you too." * 8)
    scripted_sampler.script = thought + [chat.thought_end_id] + tok.encode("\n\n") + answer
    profile = Profile(name="narrated", shadow=ShadowBlock(narrator="on", narrator_max_tokens=3),
                      ui=UiBlock(narrator="on"))
    reader = ShadowReader(tiny_engine, grid=64, pool_bytes=16 << 20)
    # a large share and a small prior: the summary's slice is earned a few ms after the first token
    policy = Policy(idle_poll_s=0.05, journal_dir=None, narrator_share=0.5, chunk_prior_ms=1.0)
    conductor = Conductor(tiny_engine, reader, ShadowOptions(narrator="on", narrator_max_tokens=3), policy)
    service = Service(conductor, chat, tiny_engine.name, profile, settings_for(tmp_path),
                      max_context_tokens=tiny_engine.cfg.max_position_embeddings)
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                     base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            stream = await client.chat.completions.create(
                model=service.model_name, messages=[{"role": "user", "content": "Hello!"}], stream=True,
                max_tokens=len(scripted_sampler.script), extra_headers={"X-Session-Id": "narrated-1"})
            events, content = [], ""
            async for chunk in stream:  # the client takes the narrator's chunk as any other
                narration = (chunk.model_extra or {}).get("qse_narrator")
                if narration is not None:
                    assert chunk.choices[0].delta.content is None  # an empty delta for clients that ignore it
                    events.append(("narrator", narration))
                for choice in chunk.choices:
                    if getattr(choice.delta, "reasoning_content", None):
                        events.append(("thought", choice.delta.reasoning_content))
                    if choice.delta.content:
                        content += choice.delta.content
                        events.append(("content", choice.delta.content))
        assert content == tok.decode(answer)
        kinds = [k for k, _ in events]
        assert kinds.count("narrator") == 1
        # after the thought began (its last text may trail the end marker by a chunk), before the answer's last text
        at = kinds.index("narrator")
        assert kinds[0] == "thought" and kinds[at + 1:].count("content") >= 2 and kinds[-1] == "content"
        narration = dict(events)["narrator"]
        assert 1 <= narration["tokens"] <= 3 and narration["position"] > 0
        status = service.status()
        assert status["narrations"]["narrated-1"]["text"] == narration["text"]
        assert status["narrator"]["live"] == 1
        await service.wait_background()
        assert "qse_narrations_total 1.0" in service.metrics.exposition().decode()  # none again after the turn
    finally:
        await service.stop()


async def test_a_turn_out_of_device_memory_is_a_503_and_the_next_one_is_served(tiny_engine, tmp_path, monkeypatch):
    """The device runs out of memory inside a turn's prompt read: the client gets a 503 in OpenAI's shape with
    Retry-After (not a 500), and the same request sent again is served."""
    service = real_service(tiny_engine, tmp_path, Profile(shadow=ShadowBlock(mode="off")))
    model, real = tiny_engine.model, tiny_engine.model._mlp
    failing = [True]

    def mlp(p, h):
        if failing[0]:
            raise MemoryError("injected: no device memory")
        return real(p, h)

    monkeypatch.setattr(model, "_mlp", mlp)
    payload = body(tiny_engine.name, "word " * 700, max_tokens=3)  # longer than a served grid chunk
    headers = {"X-Session-Id": "oom"}
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=payload, headers=headers)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "out_of_memory" and r.headers["retry-after"] == "1"
        failing[0] = False
        r = await client.post("/v1/chat/completions", json=payload, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


ORIGIN = "https://app.example.com"


def preflight(origin: str = ORIGIN, headers: str = "authorization, content-type, x-session-id") -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers}


async def test_cors_answers_the_allowed_origins_and_a_preflight_needs_no_key(tiny_engine, tmp_path):
    service = scripted_service(tiny_engine, tmp_path, QSE_API_KEY="k-123",
                               QSE_ALLOWED_ORIGINS=f"{ORIGIN}, http://localhost:5173")
    key = {"Authorization": "Bearer k-123"}
    async with serving(service) as client:  # no key but where a request names it
        r = await client.options("/v1/chat/completions", headers=preflight())
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "OPTIONS"}
        allowed = {h.lower() for h in r.headers["access-control-allow-headers"].split(", ")}
        assert {"authorization", "content-type", "x-session-id", "x-request-id", "x-router-class"} <= allowed
        r = await client.post("/v1/chat/completions", headers={**key, "Origin": "http://localhost:5173",
                                                               "X-Session-Id": "page-1"},
                              json=body("scripted", max_tokens=3))
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        exposed = {h.lower() for h in r.headers["access-control-expose-headers"].split(", ")}
        assert exposed == {"x-session-id", "x-request-id"} and r.headers["x-session-id"] == "page-1"
        # a 401 carries the headers too: the page can read why it was refused
        r = await client.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        # an origin not in the list gets none, and its preflight is refused
        r = await client.get("/v1/models", headers={**key, "Origin": "https://elsewhere.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await client.options("/v1/chat/completions", headers=preflight("https://elsewhere.example"))
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


async def test_without_allowed_origins_there_are_no_cors_headers_and_any_origin_with_a_star(tiny_engine, tmp_path):
    async with serving(scripted_service(tiny_engine, tmp_path)) as client:
        r = await client.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and not [h for h in r.headers if h.startswith("access-control-")]
        r = await client.options("/v1/chat/completions", headers=preflight())
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    async with serving(scripted_service(tiny_engine, tmp_path, QSE_ALLOWED_ORIGINS="*")) as client:
        r = await client.get("/v1/models", headers={"Origin": "http://any.example:8080"})
        assert r.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("origins, bad", [("https://app.example.com/", "https://app.example.com/"),
                                          ("https://a.example, app.example.com", "app.example.com")],
                         ids=["trailing-slash", "no-scheme"])
def test_a_bad_origin_is_refused_when_the_app_is_built_naming_it(tiny_engine, tmp_path, origins, bad):
    from qse.settings import SettingError

    service = scripted_service(tiny_engine, tmp_path, QSE_ALLOWED_ORIGINS=origins)
    with pytest.raises(SettingError, match=re.escape(f"{bad!r} is not an origin; expected scheme://host[:port]")):
        create_app(service)


async def test_a_model_card_by_id_and_a_404_naming_the_served_names(tiny_engine, tmp_path):
    ids = tiny_engine.chat.tokenizer.encode("hello")
    service = Service(ScriptedConductor(ids), tiny_engine.chat, "scripted", Profile(shadow=ShadowBlock(mode="off")),
                      settings_for(tmp_path), served_names=["org/model-a", "alias"])
    async with serving(service) as client:
        listed = {card["id"]: card for card in (await client.get("/v1/models")).json()["data"]}
        for name in ("org/model-a", "alias"):  # an id with a "/" is one id
            r = await client.get(f"/v1/models/{name}")
            assert r.status_code == 200 and r.json() == listed[name]
        assert (await client.get("/v1/models/org%2Fmodel-a")).json() == listed["org/model-a"]
        r = await client.get("/v1/models/org/nope")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and set(error) == {"message", "type", "param", "code"}
        assert "'org/nope'" in error["message"] and "['org/model-a', 'alias']" in error["message"]
        # the request metric's route is the template, not each id a client sends
        text = (await client.get("/metrics")).text
        assert 'route="/v1/models/{model_id:path}"' in text and "org/nope" not in text


async def test_an_unexpected_error_in_a_route_is_a_json_500_naming_the_request(tiny_engine, tmp_path, monkeypatch):
    service = scripted_service(tiny_engine, tmp_path)

    async def tokenize(req):
        raise RuntimeError("a bug, with /private/paths in its text")

    monkeypatch.setattr(service, "tokenize", tokenize)
    async with serving(service) as client:
        r = await client.post("/tokenize", headers={"X-Request-Id": "req-500"}, json={"prompt": "hi"})
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        assert "req-500" in error["message"] and "private" not in error["message"]
        assert (await client.get("/v1/models")).status_code == 200  # and the server goes on serving
