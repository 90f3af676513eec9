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
