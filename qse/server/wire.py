"""Wire types: what clients send and what the server answers, as msgspec Structs.

Requests of the OpenAI routes ignore fields they do not know (clients send many optional ones),
but every field they do declare is typed and bounded, so a wrong type or value is a 400 naming the
field. The shadow routes are qse's own API and refuse unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from .errors import ApiError, bad_request, from_msgspec

T = TypeVar("T")

# ---- requests: chat ---------------------------------------------------------------------------


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCallIn(Struct):
    name: Annotated[str, Meta(min_length=1)]
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Struct):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class Message(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same thing under the name some clients use


class FunctionDef(Struct, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Struct):
    include_usage: bool = False


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Stop = str | Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)]


class ChatCompletionRequest(Struct):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    stop: Stop | None = None
    n: PositiveInt = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Struct):
    model: str
    prompt: str | Annotated[list[str | int], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    max_tokens: PositiveInt | None = None
    stop: Stop | None = None
    n: PositiveInt = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None


# ---- requests: the shadow ---------------------------------------------------------------------
SESSION_ID_MAX_CHARS = 256
# the one rule for a client's session id, in X-Session-Id and in the shadow routes' bodies
SessionId = Annotated[str, Meta(min_length=1, max_length=SESSION_ID_MAX_CHARS)]


class AskRequest(Struct, forbid_unknown_fields=True):
    session: SessionId
    question: Annotated[str, Meta(min_length=1)]
    choices: Annotated[list[Annotated[str, Meta(min_length=1, max_length=32)]], Meta(min_length=1, max_length=64)]
    at: Annotated[int, Meta(ge=0)] | None = None


class SummarizeRequest(Struct, forbid_unknown_fields=True):
    session: SessionId
    prompt: Annotated[str, Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=1024)] = 64


# ---- responses --------------------------------------------------------------------------------


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    type: str
    function: FunctionCallOut


class ToolCallDelta(Struct):
    index: int
    id: str
    type: str
    function: FunctionCallOut


class ChatMessageOut(Struct, omit_defaults=True):
    role: str
    content: str | None  # no default: always written, null beside tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(Struct):
    object: str
    data: list[ModelCard]


class AskResponse(Struct):
    session: str
    distribution: dict[str, float]
    label: str
    probability: float
    position: int  # the absolute position the answer was read over
    committed: int  # rows the reader had committed when it answered
    latency_ms: float
    gpu_ms: float


class SummaryResponse(Struct):
    session: str
    text: str
    tokens: int
    position: int
    gpu_ms: float
    ms_per_token: float


# ---- decoding and checks ----------------------------------------------------------------------
_ENCODER = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def decode(body: bytes, kind: type[T]) -> T:
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_msgspec(exc) from None


def session_header(value: str | None) -> str | None:
    """X-Session-Id under the same rule as a body's `session` (SessionId); absent or empty: None."""
    if not value:
        return None
    try:
        return msgspec.convert(value, SessionId)
    except msgspec.ValidationError:
        raise bad_request(f"X-Session-Id has {len(value)} characters, over the limit of {SESSION_ID_MAX_CHARS}",
                          "X-Session-Id", "invalid_session_id") from None


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_common(n: int, presence_penalty: float, frequency_penalty: float) -> None:
    """Refuse what the engine cannot do rather than ignore it."""
    if n != 1:
        raise bad_request(f"n={n} is not supported: qse returns one choice per request", "n", "unsupported_value")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value != 0.0:
            raise bad_request(f"{name}={value} is not supported (only 0)", name, "unsupported_value")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req.n, req.presence_penalty, req.frequency_penalty)
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported", "logprobs", "unsupported_value")
    if isinstance(req.tool_choice, dict) or req.tool_choice not in (None, "auto", "none"):
        raise bad_request(f"tool_choice {req.tool_choice!r} is not supported: the model cannot be forced to call a "
                          "tool; use 'auto' or 'none'", "tool_choice", "unsupported_value")
    extra = set(req.chat_template_kwargs or {}) - {"enable_thinking"}
    if extra:
        raise bad_request(f"chat_template_kwargs {sorted(extra)} are not supported (only enable_thinking)",
                          "chat_template_kwargs", "unsupported_value")
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request(f"chat_template_kwargs.enable_thinking must be a boolean, got {thinking!r}",
                          "chat_template_kwargs.enable_thinking", "invalid_type")


def check_completion(req: CompletionRequest) -> None:
    check_common(req.n, req.presence_penalty, req.frequency_penalty)
    if req.echo or req.logprobs or (req.best_of or 1) != 1 or req.suffix:
        raise bad_request("echo, logprobs, best_of and suffix are not supported", None, "unsupported_value")
    if isinstance(req.prompt, list):
        kinds = {type(p) for p in req.prompt}
        if kinds == {str} and len(req.prompt) != 1:
            raise bad_request(f"prompt: one string per request, got {len(req.prompt)}", "prompt", "unsupported_value")
        if len(kinds) > 1:
            raise bad_request("prompt must be a string, one string in a list, or a list of token ids", "prompt",
                              "invalid_type")


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat format renders them (text content, reasoning, tool calls)."""
    out = []
    for i, m in enumerate(messages):
        content: str | None
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part of type {part.type!r} is not supported (text only)",
                                      f"messages[{i}].content[{j}]", "unsupported_value")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        elif m.tool_calls:
            raise bad_request(f"tool_calls on a {m.role!r} message: only assistant messages carry them",
                              f"messages[{i}].tool_calls")
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"tool {dup!r} is defined twice", "tools")
    return [msgspec.to_builtins(t) for t in tools]
