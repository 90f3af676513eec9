"""No 500 on any input: hypothesis sends request-shaped JSON (each wire type's fields, plausible values mixed with
any JSON: huge integers, deep nesting, wrong types, unknown fields) and raw bytes to every POST route, with
random session and request ids. Every answer is a 2xx, or a 4xx whose body has OpenAI's error shape, and the
server answers a plain request afterwards.

In process (Starlette's TestClient) over the embedded model with the reader on; bounded in time by small
max_examples and an output limit of a few tokens."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions
from qse.server import wire
from qse.server.app import create_app
from qse.server.profiles import Profile
from qse.server.service import Service
from qse.settings import EngineSettings
from qse.shadow.reader import ShadowReader

ROUTES = {"/v1/chat/completions": wire.ChatCompletionRequest, "/v1/completions": wire.CompletionRequest,
          "/v1/conductor/shadow/ask": wire.AskRequest, "/v1/conductor/shadow/summarize": wire.SummarizeRequest}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def client(tiny_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    reader = ShadowReader(tiny_engine, grid=64, pool_bytes=16 << 20)
    conductor = Conductor(tiny_engine, reader, ShadowOptions(), Policy(idle_poll_s=0.05, journal_dir=None))
    env = {"QSE_CACHE_DIR": str(work), "QSE_LEDGER": str(work / "usage.jsonl"), "QSE_MAX_OUTPUT_TOKENS": "4",
           "QSE_MAX_QUESTION_TOKENS": "64", "QSE_MAX_PROMPT_TOKENS": "2048"}
    service = Service(conductor, tiny_engine.chat, tiny_engine.name, Profile(), EngineSettings(env),
                      max_context_tokens=tiny_engine.cfg.max_position_embeddings)
    with TestClient(create_app(service), raise_server_exceptions=False) as c:
        # one known session, so that ask and summarize get past "unknown session" sometimes
        assert c.post("/v1/completions", headers={"X-Session-Id": "known"},
                      json={"model": tiny_engine.name, "prompt": "hello there", "max_tokens": 1}).status_code == 200
        yield c


scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**70)
           | st.integers(min_value=-(2**70), max_value=-(2**63) + 2) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=24))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)


def deep(depth: int, leaf: object = 1) -> object:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"a": leaf}
    return leaf


nested = st.integers(min_value=1, max_value=300).map(deep)  # deeper: raw bytes (the encoder has a stack too)
texts = st.text(max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "other"]) | json_values},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                                optional={"text": texts}), max_size=3) | json_values,
              "reasoning_content": texts, "name": texts, "tool_call_id": texts,
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": texts}, optional={"arguments": texts | json_values | nested})}), max_size=2)})
tool = st.fixed_dictionaries({"type": st.just("function") | texts, "function": st.fixed_dictionaries(
    {"name": texts}, optional={"description": texts, "parameters": json_values | nested})})


def plausible(name: str, model: str):
    """A value a client might send for the field `name`, or any JSON."""
    known = {
        "model": st.just(model) | texts,
        "messages": st.lists(message, max_size=4),
        "prompt": (texts | st.lists(st.integers(min_value=-2, max_value=300_000), max_size=6)
                   | st.lists(texts, max_size=2)),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
        "max_tokens": st.integers(min_value=-2, max_value=6) | st.integers(),
        "max_completion_tokens": st.integers(min_value=-2, max_value=6),
        "seed": st.integers() | st.integers(min_value=2**63, max_value=2**66),
        "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False),
        "top_p": st.floats(min_value=-1, max_value=2, allow_nan=False),
        "stop": texts | st.lists(texts, max_size=3),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_values | nested),
        "session": st.just("known") | texts,
        "question": texts,
        "choices": st.lists(st.text(min_size=1, max_size=2), max_size=4),
        "at": st.integers(),
    }
    if name not in known:
        return json_values
    return st.one_of(known[name], known[name], known[name], json_values)


def valid_bodies(model: str) -> dict[str, dict]:
    return {"/v1/chat/completions": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"model": model, "max_tokens": 2, "prompt": "hi"},
            "/v1/conductor/shadow/ask": {"session": "known", "question": "A or B?", "choices": ["A", "B"]},
            "/v1/conductor/shadow/summarize": {"session": "known", "max_tokens": 2}}


@st.composite
def wire_requests(draw, model: str):
    """A valid body with a few fields changed, or any subset of the fields; sometimes unknown fields too."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    names = [f.encode_name for f in msgspec.structs.fields(ROUTES[path])]
    if draw(st.booleans()):
        body = dict(valid_bodies(model)[path])
        for n in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
            body[n] = draw(plausible(n, model))
    else:
        body = {n: draw(plausible(n, model)) for n in names if draw(st.booleans())}
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
    return path, body


headers = st.fixed_dictionaries({}, optional={
    "X-Session-Id": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300),
    "X-Request-Id": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    "X-Router-Class": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)})


def check_answer(r) -> None:
    """A 2xx, or a 4xx in OpenAI's error shape; a stream's events are JSON and none is a server error."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        frames = [f for f in r.text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        for f in frames[:-1]:
            event = json.loads(f[len("data: "):])
            assert "error" not in event or event["error"]["type"] != "server_error", event
    else:
        r.json()


def still_serving(client, model: str) -> None:
    assert client.get("/v1/models").status_code == 200
    r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200, r.text


def test_wire_shaped_requests_never_get_a_500(client, tiny_engine):
    @FUZZ
    @given(request=wire_requests(tiny_engine.name), extra=headers)
    def run(request, extra):
        path, body = request
        check_answer(client.post(path, content=msgspec.json.encode(body), headers=extra))

    run()
    still_serving(client, tiny_engine.name)


def test_raw_bytes_never_get_a_500(client, tiny_engine):
    valid = msgspec.json.encode({"model": tiny_engine.name, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]})

    @st.composite
    def bodies(draw):
        kind = draw(st.sampled_from(["bytes", "mutated", "nested", "number"]))
        if kind == "bytes":
            return draw(st.binary(max_size=256))
        if kind == "mutated":
            at = draw(st.integers(min_value=0, max_value=len(valid)))
            cut = draw(st.integers(min_value=0, max_value=8))
            return valid[:at] + draw(st.binary(max_size=8)) + valid[at + cut:]
        if kind == "nested":
            depth = draw(st.integers(min_value=1, max_value=100_000))
            return valid[:-1] + b', "chat_template_kwargs": {"x": ' + b"[" * depth + b"]" * depth + b"}}"
        digits = draw(st.integers(min_value=18, max_value=6000))
        return valid[:-1] + b', "seed": ' + b"9" * digits + b"}"

    @FUZZ
    @given(path=st.sampled_from(sorted(ROUTES)), body=bodies())
    def run(path, body):
        check_answer(client.post(path, content=body, headers={"content-type": "application/json"}))

    run()
    still_serving(client, tiny_engine.name)


def test_deep_nesting_and_huge_numbers_name_the_problem(client, tiny_engine):
    base = {"model": tiny_engine.name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json={**base, "seed": 2**64})
    assert r.status_code == 400 and r.json()["error"]["code"] == "number_out_of_range"
    assert r.json()["error"]["param"] == "seed" and str(2**64) in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json={**base, "seed": 2**64 - 1}).status_code == 200
    r = client.post("/v1/chat/completions", json={**base, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"x": deep(wire.MAX_JSON_DEPTH - 10)}}}]})
    assert r.status_code == 200, r.text
    for depth in (wire.MAX_JSON_DEPTH, 5000):
        nest = b"[" * depth + b"]" * depth
        body = msgspec.json.encode(base)[:-1] + b', "chat_template_kwargs": {"x": ' + nest + b"}}"
        r = client.post("/v1/chat/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_deep", r.text
