"""From token ids to what a client reads: text, stop strings, and reasoning / content / tool calls.

    ids --OutputText--> text (stop strings cut it; a suffix a stop string may still claim is held)
        --Sections-->   reasoning deltas, content deltas, tool-call deltas as each call forms

Nothing here knows a model's markup: the chat format's own `parse` splits a text into reasoning,
content and tool calls, and `Sections` re-parses the growing text and sends only what extends what
it already sent, holding back a few characters of the open section because a marker being written
(`</thi...`, `<tool_c...`) is still part of it until it completes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

# characters of the open section held back until the next piece: longer than any markup tag
HOLD_CHARS = 16
# ids whose bytes end inside a character are held; past this many, they are written as they are
MAX_PENDING_IDS = 4


class OutputText:
    """Decoded text of a growing id list, cut at the first stop string.

    Invariant: `visible` only grows; what it shows is never taken back by a later stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self._decode = decode
        self.stops = [s for s in stops if s]
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self._pending: list[int] = []
        self.text = ""
        self.is_stopped = False
        self.num_ids = 0

    def push(self, token_id: int) -> None:
        if self.is_stopped:
            return
        self.num_ids += 1
        self._pending.append(token_id)
        piece = self._decode(self._pending)
        if piece.endswith("\ufffd") and len(self._pending) < MAX_PENDING_IDS:
            return  # the bytes end inside a character: wait for the next id
        self._pending.clear()
        self._append(piece)

    def finish(self) -> None:
        if self._pending and not self.is_stopped:
            self._append(self._decode(self._pending))
        self._pending.clear()

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.is_stopped = True

    @property
    def visible(self) -> str:
        """The text minus the longest suffix that is a prefix of a stop string."""
        if self.is_stopped or not self.stops:
            return self.text
        for n in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return self.text[:-n]
        return self.text


@dataclass
class Deltas:
    """What one step adds. tool_calls: OpenAI's streamed pieces: a call's first carries index, id, type and
    function.name (and the arguments so far), later ones index and a function.arguments piece."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class Sections:
    """Reasoning, content and tool-call deltas of a growing text, through the chat format's parse.

    parse(text, is_final) -> object with .reasoning (str | None), .content (str, the text before the first
    tool call), .tool_calls (dicts {"type", "function": {"name", "arguments"}}: a call appears once its name
    is written, its arguments a JSON text that only grows) and .is_call_cut (the last call never closed).
    Not final, a call's head being written holds the content before it back; final, a head that never
    named a function is content.

    Invariant: the pieces sent join to what one parse of the whole text gives (the answer without a stream).
    """

    def __init__(self, parse: Callable[[str, bool], Any], new_call_id: Callable[[], str] | None = None):
        self._parse = parse
        self._new_call_id = new_call_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.reasoning = ""  # sent so far
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []  # with their ids and the arguments sent so far
        self.is_call_cut = False  # set by finish

    def update(self, text: str) -> Deltas:
        return self._step(self._parse(text, False), is_final=False)

    def finish(self, text: str) -> Deltas:
        parsed = self._parse(text, True)
        self.is_call_cut = bool(parsed.is_call_cut)
        return self._step(parsed, is_final=True)

    def _step(self, parsed: Any, is_final: bool) -> Deltas:
        reasoning, content, calls = parsed.reasoning or "", parsed.content, parsed.tool_calls
        if is_final:
            out = Deltas(_extension(self.reasoning, reasoning), _extension(self.content, content))
        elif content or calls:  # the reasoning closed: it is final; content before a named call is too
            out = Deltas(_extension(self.reasoning, reasoning),
                         _extension(self.content, content if calls else _held(content)))
        else:
            out = Deltas(_extension(self.reasoning, _held(reasoning)))
        self.reasoning += out.reasoning
        self.content += out.content
        for index, call in enumerate(calls):
            fn = call["function"]
            if index == len(self.tool_calls):
                self.tool_calls.append({"id": self._new_call_id(), "type": call["type"],
                                        "function": {"name": fn["name"], "arguments": fn["arguments"]}})
                out.tool_calls.append({"index": index, **self.tool_calls[index]})
                out.tool_calls[-1]["function"] = dict(self.tool_calls[index]["function"])
                continue
            sent = self.tool_calls[index]["function"]
            piece = _extension(sent["arguments"], fn["arguments"])
            if piece:
                sent["arguments"] += piece
                out.tool_calls.append({"index": index, "function": {"arguments": piece}})
        return out


def _held(text: str) -> str:
    """What of an open section may go now: not its last HOLD_CHARS (a marker may be being written) nor the
    whitespace before them (a section's end drops it)."""
    return text[:-HOLD_CHARS].rstrip()


def _extension(sent: str, now: str) -> str:
    """What `now` adds to `sent`; nothing if it does not extend it (never take back what was sent)."""
    return now[len(sent):] if len(now) > len(sent) and now.startswith(sent) else ""
