"""Structured outputs, forced tool calls, logprobs and n against the real server (`python -m qse.server`, the
embedded random-weight model) through the official openai client: whatever the weights, a grammar-held answer
parses and validates, or says it was cut (finish_reason "length")."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0, "maximum": 1000},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"},
                                         "mode": {"enum": ["text", "bytes"]}},
        "required": ["path", "lines"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search.", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "flags": {"type": "array",
                                                                                    "items": {"type": "string"}}},
        "required": ["pattern"]}}},
]
USER = [{"role": "user", "content": "Report the build in JSON."}]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_json_schema_answers_validate(server, oai, seed, thinking):
    r = oai.chat.completions.create(
        model=server.model, messages=USER, temperature=1.0, seed=seed, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "build", "schema": SCHEMA, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("seed", [4, 5])
def test_json_object_answers_parse(server, oai, seed):
    r = oai.chat.completions.create(model=server.model, messages=USER, temperature=0.9, seed=seed, max_tokens=64,
                                    response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_budget_too_small_is_reported_as_cut(server, oai):
    r = oai.chat.completions.create(
        model=server.model, messages=USER, temperature=1.0, seed=1, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "build", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "length"


def _check_calls(calls, names):
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_choice_gives_valid_calls(server, oai, seed):
    r = oai.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="required",
                                    temperature=1.0, seed=seed, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls, {"read_file", "grep"})


@pytest.mark.parametrize("seed", [1, 2])
def test_a_named_function_is_called(server, oai, seed):
    r = oai.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, temperature=1.0, seed=seed,
                                    tool_choice={"type": "function", "function": {"name": "grep"}}, max_tokens=64,
                                    parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_calls(calls, {"grep"})


def test_a_forced_call_streams_as_tool_call_deltas(server, oai):
    stream = oai.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=7, max_tokens=64, stream=True)
    pieces, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                pieces.setdefault(delta.index, []).append(delta)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and pieces
    for index, deltas in pieces.items():
        head = deltas[0]  # OpenAI's shape: the first names the call, the rest append to its arguments
        assert head.id.startswith("call_") and head.type == "function" and head.function.name
        assert len(deltas) >= 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == head.function.name)
        jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), schema)


def test_content_streams_live_with_tools_offered(server, oai):
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, temperature=1.0, seed=11, max_tokens=48,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = oai.chat.completions.create(**kwargs).choices[0]
    pieces = [c.choices[0].delta.content for c in oai.chat.completions.create(stream=True, **kwargs)
              if c.choices and c.choices[0].delta.content]
    assert whole.message.content and "".join(pieces) == whole.message.content
    assert len(pieces) > 3  # sent as the tokens came, not in one piece at the end


def test_logprobs_and_n(server, oai):
    r = oai.chat.completions.create(model=server.model, messages=USER, temperature=1.0, seed=11, max_tokens=6, n=2,
                                    logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        for entry in content:
            assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
    texts = [c.message.reasoning_content for c in r.choices]  # seeds seed and seed + 1: two draws
    assert texts[0] != texts[1]


def test_streamed_n_names_each_choice(server, oai):
    stream = oai.chat.completions.create(model=server.model, messages=USER, temperature=1.0, seed=3, max_tokens=5,
                                         n=2, stream=True, stream_options={"include_usage": True})
    finishes, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and usage.completion_tokens == 10


def test_seeded_sampling_repeats(server, oai):
    def once():
        return oai.completions.create(model=server.model, prompt="count:", max_tokens=8, temperature=0.8, seed=5,
                                      presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"15": -100},
                                      extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.3}
                                      ).choices[0].text

    first = once()
    assert first == once()
