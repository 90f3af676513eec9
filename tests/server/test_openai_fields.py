"""Nothing is silently ignored: every field of the OpenAI chat and completions request schemas (as the installed
openai client declares them) is honoured or refused with a 400 naming it; a field outside the schema is ignored
with one warning in the server's log. A new field in the client's schema fails this test until it is decided."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

OK, REFUSED = "honoured", "refused"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "string"}}, "required": ["x"]}}}

# field -> (a value that is not the default, honoured or refused)
CHAT_FIELDS = {
    "messages": ([{"role": "user", "content": "hi"}], OK),
    "model": (None, OK),  # filled in by the test with the served name
    "stream": (False, OK),
    "stream_options": ({"include_usage": True}, OK),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED),
    "frequency_penalty": (0.5, OK),
    "function_call": ("auto", REFUSED),
    "functions": ([{"name": "f"}], REFUSED),
    "logit_bias": ({"15": 5.0}, OK),
    "logprobs": (True, OK),
    "max_completion_tokens": (2, OK),
    "max_tokens": (2, OK),
    "metadata": ({"team": "a"}, OK),
    "modalities": (["audio"], REFUSED),
    "moderation": ({"input": {"mode": "score"}}, REFUSED),
    "n": (2, OK),
    "parallel_tool_calls": (False, OK),
    "prediction": ({"type": "content", "content": "x"}, OK),
    "presence_penalty": (0.5, OK),
    "prompt_cache_key": ("cache-key-1", OK),
    "prompt_cache_options": ({"ttl": "24h"}, OK),
    "prompt_cache_retention": ("24h", OK),
    "reasoning_effort": ("none", OK),
    "response_format": ({"type": "json_object"}, OK),
    "safety_identifier": ("user-1", OK),
    "seed": (3, OK),
    "service_tier": ("flex", REFUSED),
    "stop": (["\n\n"], OK),
    "store": (True, REFUSED),
    "temperature": (0.5, OK),
    "tool_choice": ("required", OK),
    "tools": ([TOOL], OK),
    "top_logprobs": (2, OK),
    "top_p": (0.5, OK),
    "user": ("user-1", OK),
    "verbosity": ("low", REFUSED),
    "web_search_options": ({}, OK),  # empty: nothing asked
}
COMPLETION_FIELDS = {
    "model": (None, OK),
    "prompt": ("hi", OK),
    "stream": (False, OK),
    "stream_options": ({"include_usage": True}, OK),
    "best_of": (3, REFUSED),  # best_of above n
    "echo": (True, OK),
    "frequency_penalty": (0.5, OK),
    "logit_bias": ({"15": 5.0}, OK),
    "logprobs": (2, OK),
    "max_tokens": (2, OK),
    "n": (2, OK),
    "presence_penalty": (0.5, OK),
    "seed": (3, OK),
    "stop": ("\n", OK),
    "suffix": ("tail", REFUSED),
    "temperature": (0.5, OK),
    "top_p": (0.5, OK),
    "user": ("user-1", OK),
}


def schema_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_the_tables_cover_the_clients_schemas():
    assert set(CHAT_FIELDS) == schema_fields(chat_params)
    assert set(COMPLETION_FIELDS) == schema_fields(completion_params)


def body_with(field: str, table: dict, base: dict, server) -> dict:
    value, _ = table[field]
    body = dict(base)
    body[field] = server.model if field == "model" else value
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "tool_choice":
        body["tools"] = [TOOL]
    if field == "stream_options":
        body["stream"] = True
    return body


def check(http, server, path: str, field: str, table: dict, base: dict) -> None:
    body = body_with(field, table, base, server)
    r = http.post(path, json=body)
    if table[field][1] == OK:
        assert r.status_code == 200, (field, r.text)
    else:
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_chat_fields_are_honoured_or_refused_by_name(server, http, field):
    check(http, server, "/v1/chat/completions", field, CHAT_FIELDS,
          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_completion_fields_are_honoured_or_refused_by_name(server, http, field):
    check(http, server, "/v1/completions", field, COMPLETION_FIELDS, {"prompt": "hi", "max_tokens": 2})


def test_a_field_outside_the_schema_is_ignored_with_one_warning(server, http):
    r = http.post("/v1/chat/completions", headers={"x-request-id": "outside-the-schema"},
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "a_field_nobody_declares": 1})
    assert r.status_code == 200
    warnings = [e for e in server.log_events() if e.get("event") == "request_fields_ignored"
                and e.get("request_id") == "outside-the-schema"]
    assert len(warnings) == 1 and warnings[0]["fields"] == ["a_field_nobody_declares"]
