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
    def __init__(self, reasoning, content, tool_calls=()):
        self.reasoning, self.content, self.tool_calls = reasoning, content, list(tool_calls)


def think_parse(text: str) -> Parsed:
    """A toy format: reasoning until </r>, then content; '<call>' at the end of content is a call."""
    if "</r>" not in text:
        return Parsed(text.strip("\n") or None, "")
    reasoning, content = text.split("</r>", 1)
    content = content.lstrip("\n")
    if content.endswith("</call>") and "<call>" in content:
        head, call = content.split("<call>", 1)
        return Parsed(reasoning.strip("\n"), head.rstrip(), [{"id": "c1", "type": "function",
                      "function": {"name": call[:-len("</call>")], "arguments": "{}"}}])
    return Parsed(reasoning.strip("\n"), content)


def stream(text: str, stream_content: bool, step: int = 3):
    sections = Sections(think_parse, stream_content)
    reasoning, content = "", ""
    for end in range(step, len(text) + step, step):
        d = sections.update(text[:end])
        reasoning += d.reasoning
        content += d.content
    final = sections.finish(text)
    return sections, reasoning + final.reasoning, content + final.content, final.tool_calls


def test_sections_stream_equals_one_parse():
    text = "thinking about the problem at length\n</r>\n\nThe answer is forty-two, as always."
    sections, reasoning, content, calls = stream(text, stream_content=True)
    parsed = think_parse(text)
    assert reasoning == parsed.reasoning and content == parsed.content and calls == []


def test_sections_hold_back_a_marker_being_written():
    sections = Sections(think_parse, True)
    first = sections.update("x" * 40 + "</")
    assert first.reasoning == "x" * (42 - HOLD_CHARS)  # "</" is never sent as reasoning
    second = sections.update("x" * 40 + "</r>\nhello")
    assert sections.reasoning == "x" * 40  # once closed, the reasoning goes whole
    assert second.content == ""  # the open content is held back


def test_sections_with_tools_send_content_only_at_the_end():
    text = "plan\n</r>\nLet me call it.<call>read_file</call>"
    sections, reasoning, content, calls = stream(text, stream_content=False)
    assert reasoning == "plan"
    assert content == "Let me call it."
    assert [c["function"]["name"] for c in calls] == ["read_file"]
