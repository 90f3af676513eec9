"""Wire types: decoding, the 400s they produce (naming the field), messages into the chat format's shape."""

from __future__ import annotations

import json

import pytest

from qse.core.ids import first_outside, is_int_list
from qse.server import wire
from qse.server.errors import ApiError


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def decode_error(body: bytes, kind=wire.ChatCompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        wire.decode(body, kind)
    err = info.value
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_a_full_request_decodes():
    req = wire.decode(chat(stream=True, stream_options={"include_usage": True}, temperature=0.2, top_p=0.9, seed=7,
                           max_completion_tokens=12, stop=["\n\n"], tools=[{"type": "function", "function": {
                               "name": "read_file", "parameters": {"type": "object"}}}],
                           unknown_client_field={"ignored": True}), wire.ChatCompletionRequest)
    assert req.stream and req.stream_options.include_usage and req.max_completion_tokens == 12
    assert wire.template_tools(req.tools) == [{"type": "function", "function": {"name": "read_file",
                                                                                "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("body, param, code", [
    (b"{not json", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[]", None, "invalid_type"),
    (chat(messages="hi"), "messages", "invalid_type"),
    (chat(messages=[]), "messages", "invalid_type"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "invalid_type"),
    (chat(max_tokens="ten"), "max_tokens", "invalid_type"),
    (chat(max_tokens=0), "max_tokens", "invalid_type"),
    (chat(temperature=3.0), "temperature", "invalid_type"),
    (chat(top_p=0), "top_p", "invalid_type"),
    (chat(stop=[""]), "stop", "invalid_type"),
    (chat(n=17), "n", "invalid_type"),
    (chat(top_logprobs=21), "top_logprobs", "invalid_type"),
    (chat(logit_bias={"5": 101}), "logit_bias", "invalid_type"),
    (chat(presence_penalty=2.5), "presence_penalty", "invalid_type"),
    (chat(response_format={"type": "yaml"}), "response_format", "invalid_type"),
], ids=["malformed", "empty-body", "array", "messages-string", "messages-empty", "bad-role", "max-tokens-string",
        "max-tokens-zero", "temperature-high", "top-p-zero", "empty-stop", "n-over", "top-logprobs-over",
        "logit-bias-over", "penalty-over", "format-unknown"])
def test_bad_requests_name_the_field(body, param, code):
    err = decode_error(body)
    assert err.code == code
    if param is not None:
        assert err.param is not None and err.param.startswith(param.split("[")[0])
    assert err.message


def test_model_may_be_left_out():
    assert wire.decode(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                       wire.ChatCompletionRequest).model is None


def test_fields_outside_the_schema_are_listed():
    assert wire.unknown_fields(chat(bogus=1, other=None, n=2), wire.ChatCompletionRequest) == ["bogus", "other"]


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),  # not among the tools
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"top_k": 0}, "top_k"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ({"chat_template_kwargs": {"add_vision_id": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
])
def test_unsupported_values_are_refused_not_ignored(fields, param):
    req = wire.decode(chat(**fields), wire.ChatCompletionRequest)
    with pytest.raises(ApiError) as info:
        wire.check_chat(req)
    assert info.value.status == 400 and info.value.param == param


def test_messages_take_the_chat_formats_shape():
    req = wire.decode(chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "read "}, {"type": "text", "text": "it"}]},
        {"role": "assistant", "content": None, "reasoning_content": "need the file",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"p\": 1}"}}],
         "refusal": None},
        {"role": "tool", "tool_call_id": "c1", "content": "data"},
        {"role": "assistant", "content": "done", "reasoning": "other clients' name"},
    ]), wire.ChatCompletionRequest)
    msgs = wire.template_messages(req.messages)
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == "read it"
    assert msgs[2]["reasoning_content"] == "need the file"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "read", "arguments": "{\"p\": 1}"}
    assert msgs[3] == {"role": "tool", "content": "data", "tool_call_id": "c1"}
    assert msgs[4]["reasoning_content"] == "other clients' name"


def test_image_parts_and_duplicate_tools_are_refused():
    req = wire.decode(chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                      wire.ChatCompletionRequest)
    with pytest.raises(ApiError, match="image_url") as info:
        wire.template_messages(req.messages)
    assert info.value.param == "messages[0].content[0]"
    tool = {"type": "function", "function": {"name": "t"}}
    req = wire.decode(chat(tools=[tool, tool]), wire.ChatCompletionRequest)
    with pytest.raises(ApiError, match="twice"):
        wire.template_tools(req.tools)


def test_shadow_requests_refuse_unknown_fields():
    err = decode_error(json.dumps({"session": "s", "question": "q", "choices": ["A"], "bogus": 1}).encode(),
                       wire.AskRequest)
    assert "bogus" in err.message
    assert decode_error(json.dumps({"session": "s", "question": "q", "choices": []}).encode(),
                        wire.AskRequest).param == "choices"
    assert decode_error(json.dumps({"session": "s", "question": "", "choices": ["A"]}).encode(),
                        wire.AskRequest).param == "question"


def test_completion_prompts():
    ok = [{"prompt": "text"}, {"prompt": ["text"]}, {"prompt": [1, 2, 3]}]
    for fields in ok:
        wire.check_completion(wire.decode(json.dumps({"model": "m", **fields}).encode(), wire.CompletionRequest))
    for fields in [{"prompt": ["a", "b"]}, {"prompt": ["a", 1]}, {"prompt": "x", "echo": True, "logprobs": 1},
                   {"prompt": "x", "best_of": 2}, {"prompt": "x", "suffix": "y"}]:
        with pytest.raises(ApiError):
            wire.check_completion(wire.decode(json.dumps({"model": "m", **fields}).encode(), wire.CompletionRequest))


def test_responses_encode_as_openai_does():
    msg = wire.ChatMessageOut(role="assistant", content=None, tool_calls=[
        wire.ToolCallOut(id="c", type="function", function=wire.FunctionCallOut(name="f", arguments="{}"))])
    out = json.loads(wire.encode(msg))
    assert out["content"] is None and "reasoning_content" not in out
    chunk = wire.ChatCompletionChunk(id="x", object="chat.completion.chunk", created=1, model="m",
                                     choices=[wire.ChunkChoice(0, wire.Delta(reasoning_content="r"))])
    out = json.loads(wire.encode(chunk))
    assert "usage" not in out and out["choices"][0] == {"index": 0, "delta": {"reasoning_content": "r"},
                                                        "finish_reason": None, "logprobs": None}


def test_a_token_id_list_is_bounded_in_one_pass_and_a_bad_id_is_still_named():
    """A prompt of token ids takes the C path (min and max); one out-of-range id anywhere, a bool or a float
    among them, takes the id-by-id path, which names its index."""
    ids = list(range(50_000))
    wire.check_bounds(wire.CompletionRequest(prompt=ids))  # in bounds: no error
    for at in (0, 31_337, len(ids) - 1):
        bad = ids.copy()
        bad[at] = 2**64
        with pytest.raises(ApiError) as err:
            wire.check_bounds(wire.CompletionRequest(prompt=bad))
        assert err.value.param == f"prompt[{at}]" and str(2**64) in err.value.message
    assert not is_int_list([1, True]) and not is_int_list([1, 2.0]) and not is_int_list([])
    assert is_int_list([0, 7])


def test_first_outside_names_the_first_id_out_of_the_vocabulary():
    assert first_outside(list(range(1000)), 1000) is None
    assert first_outside([], 10) is None
    assert first_outside([3, 10, -1], 10) == 10 and first_outside([3, -1, 10], 10) == -1
