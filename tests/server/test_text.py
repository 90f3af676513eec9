"""OutputText (ids -> text, stop strings) and Sections (reasoning / content / tool-call deltas)."""

from __future__ import annotations

import pytest

from qse.server.text import HOLD_CHARS, OutputText, Sections

# a byte-level vocabulary: some ids end inside a UTF-8 character
TABLE = {0: b"Hel", 1: b"lo ", 2: "wo".encode(), 3: b"rld", 4: "é".encode()[:1], 5: "é".encode()[1:], 6: b"!",
         7: b"\n", 8: "\u4f60".encode()[:2], 9: "\u4f60".encode()[2:], 10: b"\xff"}


def decode(ids: list[int]) -> str:
    return b"".join(TABLE[i] for i in ids).decode("utf-8", errors="replace")


def run(ids: list[int], stops: list[str]) -> tuple[OutputText, list[str]]:
    out = OutputText(decode, stops)
    seen = []
    for i in ids:
        out.push(i)
        seen.append(out.visible)
        if out.is_stopped:
            break
    out.finish()
    return out, seen


def test_output_text_joins_split_characters():
    out, seen = run([0, 1, 4, 5, 8, 9, 6], [])
    assert out.text == "Hello \u00e9\u4f60!"
    assert "\ufffd" not in "".join(seen)


def test_output_text_writes_invalid_bytes_after_a_bound():
    out, _ = run([10, 10, 10, 10, 10, 6], [])
    assert out.text.endswith("!") and out.text.count("\ufffd") == 5


@pytest.mark.parametrize("stop, text, n_ids", [
    ("wor", "Hello ", 4),  # stop string split across two ids
    ("lo", "Hel", 2),
    ("!", "Hello world", 5),
    ("absent", "Hello world!", 5),
], ids=["across-ids", "inside-an-id", "last-char", "absent"])
def test_output_text_stops_at_the_first_stop_string(stop, text, n_ids):
    out, _ = run([0, 1, 2, 3, 6], [stop])
    assert out.text == text
    assert out.is_stopped == (stop != "absent")
    assert out.num_ids == n_ids


def test_visible_never_shows_what_a_stop_string_may_claim():
    out, seen = run([0, 1, 2, 3, 6], ["world!"])
    assert out.text == "Hello "
    for before, after in zip(seen, seen[1:]):
        assert after.startswith(before)  # only grows
    assert all("wo" not in s for s in seen)


class Parsed:
    def __init__(self, reasoning, content, tool_calls=(), is_call_cut=False):
        self.reasoning, self.content, self.tool_calls = reasoning, content, list(tool_calls)
        self.is_call_cut = is_call_cut


def toy_parse(text: str, is_final: bool) -> Parsed:
    """A toy format: reasoning until </r>, then content; then '<call>NAME|ARGUMENTS</call>', the arguments
    growing as they are written; a head without its '|' yet holds the content (or is content, once final)."""
    if "</r>" not in text:
        return Parsed(text.strip("\n") or None, "")
    reasoning, content = text.split("</r>", 1)
    reasoning, content = reasoning.strip("\n"), content.lstrip("\n")
    if "<call>" not in content:
        return Parsed(reasoning, content)
    head, call = content.split("<call>", 1)
    if "|" not in call:
        return Parsed(reasoning, content if is_final else head.rstrip())
    name, args = call.split("|", 1)
    is_closed = args.endswith("</call>")
    args = args[:-len("</call>")] if is_closed else args.split("<")[0]  # a "</call>" being written is held
    return Parsed(reasoning, head.rstrip(), [{"type": "function", "function": {"name": name, "arguments": args}}],
                  not is_closed)


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


def stream(text: str, step: int = 3):
    """Feed `text` in pieces of `step` characters; what the deltas join to and the deltas themselves."""
    sections = Sections(toy_parse, ids())
    reasoning, content, deltas = "", "", []
    for end in range(step, len(text) + step, step):
        d = sections.update(text[:end])
        reasoning += d.reasoning
        content += d.content
        deltas.append(d)
    final = sections.finish(text)
    deltas.append(final)
    return sections, reasoning + final.reasoning, content + final.content, deltas


def test_sections_stream_equals_one_parse():
    text = "thinking about the problem at length\n</r>\n\nThe answer is forty-two, as always."
    sections, reasoning, content, deltas = stream(text)
    parsed = toy_parse(text, True)
    assert reasoning == parsed.reasoning and content == parsed.content and sections.tool_calls == []


def test_sections_hold_back_a_marker_being_written():
    sections = Sections(toy_parse)
    first = sections.update("x" * 40 + "</")
    assert first.reasoning == "x" * (42 - HOLD_CHARS)  # "</" is never sent as reasoning
    second = sections.update("x" * 40 + "</r>\nhello")
    assert sections.reasoning == "x" * 40  # once closed, the reasoning goes whole
    assert second.content == ""  # the open content is held back


def test_sections_stream_content_before_a_call_and_the_call_as_it_forms():
    text = "plan\n</r>\nLet me call the tool that reads files now.\n\n<call>read_file|{\"path\": \"a.py\"}</call>"
    sections, reasoning, content, deltas = stream(text, step=2)
    assert reasoning == "plan" and content == "Let me call the tool that reads files now."
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "Let me call" in "".join(d.content for d in deltas[:first_call])  # content went before the call
    pieces = [c for d in deltas for c in d.tool_calls]
    head, rest = pieces[0], pieces[1:]
    assert head == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "read_file",
                                                                                   "arguments": ""}}
    assert len(rest) > 3 and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
                                 for p in rest)
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"path": "a.py"}'
    assert sections.tool_calls == [{"id": "call_0", "type": "function",
                                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]
    assert not sections.is_call_cut
    assert all("<call" not in d.content and "<" not in d.content for d in deltas)


def test_sections_report_a_cut_call():
    sections, _, content, deltas = stream("p</r>Calling.<call>grep|{\"pattern\": \"fo", step=4)
    assert content == "Calling." and sections.is_call_cut
    assert sections.tool_calls[0]["function"] == {"name": "grep", "arguments": '{"pattern": "fo'}


def test_sections_a_head_that_never_named_a_call_is_content():
    text = "p</r>Look: <call>"
    sections, _, content, deltas = stream(text, step=1)
    assert content == "Look: <call>" and sections.tool_calls == [] and not sections.is_call_cut
    assert "<call>" in deltas[-1].content  # held while it might have become a call, sent at the end
