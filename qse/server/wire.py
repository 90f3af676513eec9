"""Wire types: what clients send and what the server answers, as msgspec Structs.

Requests of the OpenAI routes ignore fields they do not know (clients send many optional ones),
but every field they do declare is typed and bounded, so a wrong type or value is a 400 naming the
field. The shadow routes are qse's own API and refuse unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from ..core.ids import is_int_list
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
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]  # n turns run one after another: a bound on one request's work
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=1024)]


class JsonSchemaFormat(Struct):
    name: Annotated[str, Meta(min_length=1, max_length=64)] = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(Struct, kw_only=True):
    """The fields chat and completion requests share: the model, streaming, and the sampling knobs."""

    model: str | None = None  # optional when one model is served
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    seed: int | None = None
    max_tokens: PositiveInt | None = None
    stop: Stop | None = None
    n: NumChoices | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None


class PredictionPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class Prediction(Struct, forbid_unknown_fields=True):
    """OpenAI's predicted output: text the answer is expected to repeat (a file it will rewrite). qse drafts
    from it where speculative decoding is on (QSE_SPECULATE); the answer is the model's either way."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    """Every field of OpenAI's chat request, plus the vLLM-style knobs qse honours (top_k, min_p,
    repetition_penalty, chat_template_kwargs). Fields typed `Any` are refused by name unless empty
    (REFUSED_CHAT); a field outside this list is ignored with a warning (unknown_fields)."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prediction: Prediction | None = None
    # refused unless empty (REFUSED_CHAT says why)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: str | Annotated[list[str | int], Meta(min_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None  # OpenAI's legacy bound
    best_of: NumChoices | None = None
    suffix: str | None = None


# field -> why it is refused when set (to anything but null or its empty value)
REFUSED_CHAT: dict[str, str] = {
    "audio": "audio output is not supported (text only)",
    "functions": "the legacy 'functions' are not supported; send them as 'tools'",
    "function_call": "the legacy 'function_call' is not supported; use 'tool_choice'",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
}
SERVICE_TIERS = ("auto", "default")


class TokenizeRequest(Struct, forbid_unknown_fields=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered as the chat route renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # accepted for vLLM's clients; the chat format adds no BOS either way
    return_token_strs: bool = False


class DetokenizeRequest(Struct, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class TokenizeResponse(Struct, omit_defaults=True):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


# ---- requests: the shadow ---------------------------------------------------------------------
SESSION_ID_MAX_CHARS = 256
# the one rule for a client's session id, in X-Session-Id and in the shadow routes' bodies
SessionId = Annotated[str, Meta(min_length=1, max_length=SESSION_ID_MAX_CHARS)]


# A question about a session the reader is behind on by whole chunks: "read" them first (kept for the session,
# the question pays for them), or "answer_now" over what the reader has read (the answer says how far behind).
Behind = Literal["read", "answer_now"]


class AskRequest(Struct, forbid_unknown_fields=True):
    session: SessionId
    question: Annotated[str, Meta(min_length=1)]
    choices: Annotated[list[Annotated[str, Meta(min_length=1, max_length=32)]], Meta(min_length=1, max_length=64)]
    at: Annotated[int, Meta(ge=0)] | None = None
    behind: Behind = "read"


class ReaderAction(Struct, forbid_unknown_fields=True):
    """POST /v1/conductor/shadow/reader: load or release the reader (the admin's)."""

    action: Literal["load", "release"]


class SummarizeRequest(Struct, forbid_unknown_fields=True):
    session: SessionId
    prompt: Annotated[str, Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=1024)] = 64
    behind: Behind = "read"


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens whose state the served session reused (OpenAI's and vLLM's field)


class CompletionTokensDetails(Struct):
    """OpenAI's counts of a predicted output's ids: those the answer took from it (verified drafts) and those
    it did not (drafted and refused), where the request sent a prediction."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    type: str
    function: FunctionCallOut


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed piece of a tool call: the first carries id, type and function.name; later ones only
    function.arguments, to be appended (OpenAI's stream)."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class ChatMessageOut(Struct, omit_defaults=True):
    role: str
    content: str | None  # no default: always written, null beside tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprobOut] | None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


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
    logprobs: ChoiceLogprobs | None = None


class NarratorEvent(Struct):
    """The live narrator's summary of the turn's thought (qse's extension of a chunk)."""

    text: str
    tokens: int
    position: int  # the summary read the session up to this row
    gpu_ms: float


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage
    # an extension field, on a chunk of its own whose one choice has an empty delta: OpenAI clients keep unknown
    # fields (openai-python: chunk.model_extra["qse_narrator"]) and see an empty delta, as on the first chunk
    qse_narrator: NarratorEvent | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None = None  # the served model's own name, beside an alias
    max_model_len: int | None = None  # the context window, in tokens (vLLM's name)


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
    gpu_ms: float  # the fork's and the chunks read for it
    read_tokens: int = 0  # ids read on the grid for this question and kept for the session
    behind: int = 0  # ids of the session the answer did not see (behind="answer_now")


class SummaryResponse(Struct):
    session: str
    text: str
    tokens: int
    position: int
    gpu_ms: float
    ms_per_token: float
    read_tokens: int = 0
    behind: int = 0


# ---- decoding and checks ----------------------------------------------------------------------
_ENCODER = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


MAX_JSON_DEPTH = 64  # arrays and objects inside one another: far above any request, far below Python's stack
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # every integer fits an int64 or a uint64 (a seed, an id, a count)


def decode(body: bytes, kind: type[T]) -> T:
    """The body as `kind`, or a 400 naming what is wrong; nothing below receives a deeper or a larger value
    than the bounds above (JSON's floats are finite already: msgspec refuses 1e999)."""
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_msgspec(exc) from None
    except RecursionError:  # nested deeper than msgspec's own stack allows
        raise _too_deep() from None
    check_bounds(value)
    return value


def _too_deep() -> ApiError:
    return ApiError(400, f"the request nests arrays and objects more than {MAX_JSON_DEPTH} deep", code="too_deep")


def check_bounds(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and integers outside [INT_MIN, INT_MAX], anywhere in a decoded
    request (free-form fields such as a tool's parameters included); the error names the field. Iterative: no
    recursion to overflow."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        obj, depth, path = stack.pop()
        if isinstance(obj, (str, bool, float)) or obj is None:
            continue
        if isinstance(obj, int):
            if not INT_MIN <= obj <= INT_MAX:
                text = str(obj) if obj.bit_length() < 256 else f"an integer of {obj.bit_length()} bits"
                raise bad_request(f"{path or 'a number'}: {text} is out of range: integers must lie in "
                                  "[-2**63, 2**64 - 1]", path or None, "number_out_of_range")
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(obj, Struct):
            stack.extend((getattr(obj, f), depth + 1, f"{path}.{f}" if path else f) for f in obj.__struct_fields__)
        elif isinstance(obj, dict):
            stack.extend((v, depth + 1, f"{path}.{k}") for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            if is_int_list(obj) and INT_MIN <= min(obj) and max(obj) <= INT_MAX:
                continue  # a list of token ids in bounds, checked in C (id by id costs ~1 us an id on the loop)
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj))


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


def unknown_fields(body: bytes, kind: type) -> list[str]:
    """The top-level keys of a JSON object body that `kind` does not declare (ignored, with a warning)."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []
    return sorted(set(keys) - set(kind.__struct_fields__))


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value is False


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not an id of the vocabulary is a 400."""
    out = []
    for key, value in (bias or {}).items():
        if not (key.isdigit() and int(key) < vocab_size):
            raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    """What the chat and completion routes share: refuse what qse cannot do, by name, rather than ignore it."""
    if req.top_k is not None and req.top_k == 0:
        raise bad_request("top_k=0 keeps no token; use -1 (or leave it out) for every token, or k >= 1", "top_k")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    for name, why in REFUSED_CHAT.items():
        if not _empty(getattr(req, name)):
            raise bad_request(f"{name}: {why}", name, "unsupported_value")
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request(f"modalities {req.modalities!r} is not supported: qse answers in text only (['text'])",
                          "modalities", "unsupported_value")
    if req.store:
        raise bad_request("store=true is not supported: qse does not keep completions for later retrieval",
                          "store", "unsupported_value")
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise bad_request(f"service_tier {req.service_tier!r} is not offered: qse has one tier ('auto' or "
                          "'default')", "service_tier", "unsupported_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    check_tool_choice(req)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
    extra = set(req.chat_template_kwargs or {}) - {"enable_thinking"}
    if extra:
        raise bad_request(f"chat_template_kwargs {sorted(extra)} are not supported (only enable_thinking)",
                          "chat_template_kwargs", "unsupported_value")
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request(f"chat_template_kwargs.enable_thinking must be a boolean, got {thinking!r}",
                          "chat_template_kwargs.enable_thinking", "invalid_type")
    effort = req.reasoning_effort
    if thinking is not None and effort is not None and thinking != (effort != "none"):
        raise bad_request(f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking={thinking}",
                          "reasoning_effort")


def enable_thinking(req: ChatCompletionRequest) -> bool | None:
    """The template's switch: chat_template_kwargs.enable_thinking, else reasoning_effort ('none' is off)."""
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is None and req.reasoning_effort is not None:
        return req.reasoning_effort != "none"
    return thinking


def forced_tools(req: ChatCompletionRequest) -> list[str] | None:
    """The names a call must use: all offered ('required'), one (a named function), or None (not forced)."""
    choice = req.tool_choice
    if choice == "required":
        return [t.function.name for t in req.tools or ()]
    if isinstance(choice, dict):
        return [choice["function"]["name"]]
    return None


def check_tool_choice(req: ChatCompletionRequest) -> None:
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or ()]
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names {fn['name']!r}, which is not among the tools {names}",
                              "tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                          "tool_choice")
    elif choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    if forced_tools(req) is not None and req.response_format is not None and req.response_format.type != "text":
        raise bad_request("a forced tool call and a JSON response_format exclude each other", "response_format")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix:
        raise bad_request("suffix (insertion) is not supported", "suffix", "unsupported_value")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs would need the prompt's logprobs, which qse does not compute",
                          "echo", "unsupported_value")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request(f"best_of={req.best_of} with n={req.n or 1}: qse returns every choice it runs, so "
                          "best_of must equal n", "best_of", "unsupported_value")
    if isinstance(req.prompt, list):
        kinds = set(map(type, req.prompt))
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
