"""The real server process (`python -m qse.server --profile coding`) driven by the official openai client and
by raw HTTP: streaming with tools, an agent loop whose prompts extend each other, a new user turn that makes the
template drop reasoning, the shadow's routes, bad input, proxy headers, the ledger and the metrics."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from qse.replay.usage import read_usage

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "repository path"}},
                   "required": ["path"]}}}]


def sse(raw: bytes) -> list:
    """A raw SSE parser: frames split on blank lines, `data: ` lines, [DONE] last (keep-alive comments, which
    an idle stream gets on a loaded machine, skipped as a client skips them)."""
    frames = [f for f in raw.decode().split("\n\n") if f and f != ": keep-alive"]
    assert frames[-1] == "data: [DONE]", frames[-1]
    events = []
    for f in frames[:-1]:
        lines = f.split("\n")
        assert all(line.startswith("data: ") for line in lines)
        events.append(json.loads("".join(line[6:] for line in lines)))
    return events


def records_of(server, session: str) -> list[dict]:
    return [r for r in server.ledger() if r["session"] == session]


def check_followed(http, server, session: str) -> dict:
    """The reader knows exactly the last turn's prompt and output, and has read every whole chunk of it."""
    last = records_of(server, session)[-1]
    state = server.caught_up(http, [session])[session]
    assert state["known"] == last["prompt_tokens"] + last["output_tokens"]
    assert state["position"] == (state["known"] // server.grid) * server.grid
    return state


def test_agent_loop_with_tools_follows_every_turn(server, oai, http):
    model = server.model
    messages = [{"role": "system", "content": "You are a careful coding agent working in a Python repository."},
                {"role": "user", "content": "The parser test fails on empty input. Find out why and fix it."}]
    session = None
    for k in range(3):
        if k == 0:  # streaming with tools, through the official client
            raw = oai.chat.completions.with_raw_response.create(
                model=model, messages=messages, tools=TOOLS, stream=True, max_tokens=12, temperature=0,
                stream_options={"include_usage": True})
            session = raw.headers["x-session-id"]
            reasoning, content, usage, finish = "", "", None, None
            for chunk in raw.parse():
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            assert usage is not None and usage.completion_tokens == 12 and finish == "length"
        else:
            raw = oai.chat.completions.with_raw_response.create(model=model, messages=messages, tools=TOOLS,
                                                                max_tokens=12, temperature=0)
            assert raw.headers["x-session-id"] == session  # mapped by the longest common prefix
            message = raw.parse().choices[0].message
            reasoning, content = getattr(message, "reasoning_content", None) or "", message.content or ""
        assert reasoning  # the generation prompt opens the reasoning: the random model's text is all reasoning
        check_followed(http, server, session)
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning,
                         "tool_calls": [{"id": call_id, "type": "function", "function": {
                             "name": "read_file", "arguments": json.dumps({"path": f"src/parser_{k}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"def parse_{k}(s):\n    return s\n"})

    # one more tool turn, then the agent answers and the user speaks: the template drops the reasoning
    r = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    reasoning = r.choices[0].message.reasoning_content
    messages.append({"role": "assistant", "content": "Fixed.", "reasoning_content": reasoning})
    before = check_followed(http, server, session)
    messages.append({"role": "user", "content": "Thanks. Now explain the fix in one sentence."})
    r = oai.chat.completions.with_raw_response.create(model=model, messages=messages, tools=TOOLS, max_tokens=8,
                                                      temperature=0)
    assert r.headers["x-session-id"] == session
    after = check_followed(http, server, session)
    assert after["rollbacks"] > before["rollbacks"]  # went back to a prompt-end checkpoint, and read again
    assert after["checkpoints"]

    turns = records_of(server, session)
    assert len(turns) == 5
    for prev, cur in zip(turns[:3], turns[1:4]):  # tool turns: each prompt extends the one before
        assert cur["shared_prefix_tokens"] == prev["prompt_tokens"]
    assert turns[4]["shared_prefix_tokens"] < turns[3]["prompt_tokens"]  # the reasoning went away
    read_usage(server.ledger_path)  # every record is consistent


def test_stream_and_answer_agree_and_stop_strings_cut_both(server, http):
    base = {"model": server.model, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
    whole = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = next(whole[i:i + 3] for i in range(4, len(whole) - 3) if whole.find(whole[i:i + 3]) == i
                and whole[i:i + 3].strip())
    cut = whole[: whole.find(stop)]
    r = http.post("/v1/completions", json={**base, "stop": [stop]})
    assert r.json()["choices"][0] == {"index": 0, "text": cut, "finish_reason": "stop", "logprobs": None}
    with http.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        events = sse(r.read())
    assert "".join(c["text"] for e in events for c in e["choices"]) == cut
    assert events[-1]["usage"]["completion_tokens"] <= 16
    with http.stream("POST", "/v1/completions", json={**base, "stream": True}) as r:
        assert "".join(c["text"] for e in sse(r.read()) for c in e["choices"]) == whole


def test_raw_sse_chat_stream(server, http):
    payload = {"model": server.model, "messages": [{"role": "user", "content": "Write a haiku about rivers."}],
               "stream": True, "max_completion_tokens": 10, "stream_options": {"include_usage": True}, "seed": 3,
               "temperature": 0.8, "top_p": 0.9}
    with http.stream("POST", "/v1/chat/completions", json=payload, headers={"X-Request-Id": "raw-sse-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "raw-sse-1"
        events = sse(r.read())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"] == {"prompt_tokens": events[-1]["usage"]["prompt_tokens"], "completion_tokens": 10,
                                   "total_tokens": events[-1]["usage"]["prompt_tokens"] + 10,
                                   "prompt_tokens_details": {"cached_tokens": 0}}  # a first turn: nothing reused
    again = sse(http.post("/v1/chat/completions", json=payload).content)

    def reasoning(evs: list) -> str:
        return "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in evs if e["choices"])

    assert reasoning(again) == reasoning(events)  # the seed fixes the sampled turn


def test_shadow_ask_summarize_and_status(server, http):
    r = http.post("/v1/chat/completions", headers={"X-Session-Id": "ask-me"}, json={
        "model": server.model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "List three uses of a binary heap in schedulers. " * 4}]})
    assert r.status_code == 200 and r.headers["x-session-id"] == "ask-me"
    server.caught_up(http, ["ask-me"])
    r = http.post("/v1/conductor/shadow/ask", json={"session": "ask-me", "question": "Is this about data structures?"
                                                    " A) yes B) no", "choices": ["A", "B"]})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert set(answer["distribution"]) == {"A", "B"} and abs(sum(answer["distribution"].values()) - 1) < 1e-5
    assert answer["label"] in ("A", "B") and answer["probability"] == max(answer["distribution"].values())
    assert answer["latency_ms"] > 0 and answer["position"] > answer["committed"]
    at = answer["committed"]
    r = http.post("/v1/conductor/shadow/ask", json={"session": "ask-me", "question": "A or B?", "choices": ["A", "B"],
                                                    "at": at})
    assert r.status_code == 200 and r.json()["committed"] == at
    r = http.post("/v1/conductor/shadow/summarize", json={"session": "ask-me", "max_tokens": 4})
    assert r.status_code == 200 and 1 <= r.json()["tokens"] <= 4
    status = http.get("/v1/conductor/shadow/status").json()
    assert status["profile"] == "coding" and status["slot"]["grid"] == server.grid
    # a CPU server: the torch twins, eager reads and an eager served decode
    assert (status["slot"]["kernels"], status["slot"]["mode"], status["served_mode"]) == ("naive", "eager", "eager")
    assert {"served_prefill", "served_decode", "reader_idle", "reader_ask", "narrator"} <= set(status["ledger_ms"])
    assert status["ledger_ms"]["reader_ask"] > 0 and "store" in status and "parked" in status
    assert any(a["session"] == "ask-me" for a in status["last_answers"])


BAD = [
    ("POST", "/v1/chat/completions", b"{\"model\": ", 400, "invalid_json"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": "hello"}, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": "ten"}, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 65}, 400, "max_tokens_exceeded"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": []}, 400, "invalid_type"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{not json"}}]}]}, 400, "invalid_messages"),
    ("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
     404, "model_not_found"),
    ("POST", "/v1/completions", {"model": "M", "prompt": [1, 2, 999999999]}, 400, "invalid_value"),
    ("POST", "/v1/conductor/shadow/ask", {"session": "never-seen", "question": "q", "choices": ["A", "B"]},
     404, "session_not_found"),
    ("POST", "/v1/conductor/shadow/ask", {"session": "ask-me", "question": "q", "choices": []}, 400, "invalid_type"),
    ("POST", "/v1/conductor/shadow/ask", {"session": "ask-me", "question": "q", "choices": ["A", "A"]},
     400, "duplicate_choice"),
    ("POST", "/v1/conductor/shadow/ask", {"session": "ask-me", "question": "q", "choices": ["A", "B"], "when": 1},
     400, "invalid_type"),
    ("POST", "/v1/conductor/shadow/ask", {"session": "ask-me", "question": "why " * 300, "choices": ["A", "B"]},
     400, "question_too_long"),
    ("POST", "/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x" * 300_000}]},
     413, "request_too_large"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("DELETE", "/v1/models", None, 405, "method_not_allowed"),
]


@pytest.mark.parametrize("method, path, payload, status, code", BAD,
                         ids=["malformed-json", "messages-type", "max-tokens-type", "max-tokens-limit",
                              "no-messages", "tool-arguments", "unknown-model", "token-id", "unknown-session",
                              "empty-choices", "duplicate-choices", "unknown-field", "long-question", "body-size",
                              "unknown-route", "wrong-method"])
def test_bad_input_is_a_4xx_in_openai_shape_and_the_server_keeps_serving(server, http, method, path, payload,
                                                                          status, code):
    if path == "/v1/conductor/shadow/ask" and code != "session_not_found":
        http.post("/v1/chat/completions", headers={"X-Session-Id": "ask-me"}, json={
            "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    if isinstance(payload, dict) and payload.get("model") == "M":
        payload = {**payload, "model": server.model}
    kwargs = {"content": payload} if isinstance(payload, bytes) else ({"json": payload} if payload else {})
    r = http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]
    assert http.get("/v1/models").status_code == 200
    r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200


def test_api_key_is_needed_everywhere_but_healthz(server):
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        for path in ("/v1/models", "/metrics", "/v1/conductor/shadow/status"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": server.model, "messages": []})
    assert r.status_code == 401
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_proxy_headers_root_path_and_request_events(server, http):
    r = http.get("/v1/models", headers={"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https",
                                        "X-Request-Id": "fwd-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "fwd-1"
    assert http.get(server.root_path + "/v1/models").status_code == 200  # a proxy that keeps the prefix
    assert http.get("/v1/models", headers={"X-Request-Id": "bad id with spaces"}).headers["x-request-id"] != \
        "bad id with spaces"
    deadline = time.monotonic() + 5
    while True:
        events = [e for e in server.log_events() if e.get("event") == "request" and e.get("request_id") == "fwd-1"]
        if events or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert events and events[0]["client"] == "203.0.113.9" and events[0]["scheme"] == "https"
    assert events[0]["status"] == 200 and events[0]["level"] == "info" and "timestamp" in events[0]
    kinds = {e.get("event") for e in server.log_events()}
    assert {"request", "turn", "server_ready"} <= kinds


def test_a_client_that_leaves_mid_stream_frees_the_engine(server, http):
    payload = {"model": server.model, "stream": True, "max_tokens": 64, "temperature": 0,
               "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with http.stream("POST", "/v1/chat/completions", json=payload, headers={"X-Session-Id": "leaver"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "reasoning_content" in line:
                break  # leave after the first text
    r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "next"}]})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while not records_of(server, "leaver") and time.monotonic() < deadline:
        time.sleep(0.05)
    record = records_of(server, "leaver")[-1]
    assert record["output_tokens"] < 64
    check_followed(http, server, "leaver")


def test_metrics_and_models(server, oai, http):
    models = oai.models.list()
    assert [m.id for m in models.data] == [server.model]
    text = http.get("/metrics").text
    for name in ("qse_request_seconds_bucket", "qse_ttft_seconds_count", "qse_decode_tokens_per_second_count",
                 'qse_device_ms_total{role="reader_idle"}', "qse_shadow_behind_tokens_sum",
                 "qse_shadow_behind_at_turn_start_tokens_bucket", 'qse_shadow_store{stat="parks"}',
                 'qse_shadow_store{stat="restores"}', "qse_prompt_tokens_total", "qse_itl_seconds_bucket",
                 f'qse_requests_running{{model_name="{server.model}"}}', "qse_requests_waiting"):
        assert name in text, name
    assert "session=" not in text
    assert oai.api_key == server.api_key
