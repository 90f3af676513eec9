"""OpenAI's predicted outputs through a real server with speculative decoding on (QSE_SPECULATE=ngram): the
prediction only drafts, so the answer is the one sent without it, and usage counts the predicted ids the answer
took and refused; a malformed prediction is a 400 naming the field. Without speculation the field is accepted and
changes nothing. float64, so a verify's rows and a plain round's row round alike (tests/runtime/
test_speculative_rounds.py says why)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Rewrite the function name in: def old_name(x): return x + 1"}]


@pytest.fixture(scope="module")
def spec_server(launcher, tmp_path_factory):
    srv = launcher.start(tmp_path_factory.mktemp("spec"), ["--profile", "coding"], QSE_SPECULATE="ngram",
                         QSE_DTYPE="float64", QSE_SHADOW_MODEL="")
    yield srv
    launcher.stop(srv)


def _client(srv):
    # (the server's key from its own record: `from conftest import` resolves another directory's under xdist)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0, timeout=120)


def _chat(client, model, **extra):
    return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **extra)


def test_a_prediction_drafts_and_leaves_the_answer_as_it_was(spec_server):
    with _client(spec_server) as client:
        plain = _chat(client, spec_server.model)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None  # no prediction sent: nothing to count
        edited = text[: len(text) // 2] + "~" + text[len(text) // 2 + 1 :]  # one edit in the middle
        predicted = _chat(client, spec_server.model, prediction={"type": "content", "content": edited})
        assert predicted.choices[0].message.content == text
        details = predicted.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert predicted.usage.completion_tokens == plain.usage.completion_tokens
        metrics = httpx.get(spec_server.url + "/metrics", headers=spec_server.headers).text
        accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("qse_spec_decode_accepted_tokens_total"))
        assert accepted >= details.accepted_prediction_tokens
        parts = _chat(client, spec_server.model, prediction={"type": "content",
                                                            "content": [{"type": "text", "text": text}]})
        assert parts.choices[0].message.content == text


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _streamed(client, model, **extra):
    """A streamed chat with tools offered: every delta's (content, reasoning, tool calls), the finish, usage."""
    chunks = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32, temperature=0, stream=True,
                                            tools=TOOLS, stream_options={"include_usage": True},
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **extra)
    deltas, finish, usage = [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            d = choice.delta
            calls = [c.model_dump() for c in d.tool_calls] if d.tool_calls else None
            if d.content or calls or getattr(d, "reasoning_content", None):
                deltas.append((d.content, getattr(d, "reasoning_content", None), calls))
            finish = choice.finish_reason or finish
    return deltas, finish, usage


def test_a_speculating_stream_with_tools_offered_is_the_plain_stream(spec_server):
    """Deliverable 6 of speculative decoding: with tools offered, a stream whose turn verifies drafts (its
    prediction the answer itself, so most drafts are kept and a verify emits several ids at once) sends what
    the stream without a prediction sends, delta for delta: the parser sees the same ids one at a time."""
    with _client(spec_server) as client:
        plain, plain_finish, _ = _streamed(client, spec_server.model)
        text = "".join(c or "" for c, _, _ in plain)
        assert text and plain_finish in ("length", "stop", "tool_calls")
        got, finish, usage = _streamed(client, spec_server.model, prediction={"type": "content", "content": text})
        assert got == plain and finish == plain_finish
        assert usage.completion_tokens_details.accepted_prediction_tokens > 0  # it did verify, and kept drafts


def test_a_malformed_prediction_is_a_400_naming_it(spec_server):
    with _client(spec_server) as client:
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, spec_server.model, prediction={"type": "file", "content": "x"})
        assert "prediction" in str(err.value)


def test_without_speculation_a_prediction_is_accepted_and_changes_nothing(oai, server):
    plain = _chat(oai, server.model)
    predicted = _chat(oai, server.model, prediction={"type": "content", "content": "anything at all"})
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0
