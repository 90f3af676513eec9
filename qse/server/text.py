"""From token ids to what a client reads: text, stop strings, and reasoning / content / tool calls.

    ids --OutputText--> text (stop strings cut it; a suffix a stop string may still claim is held)
        --Sections-->   reasoning deltas, content deltas, then tool calls at the end

Nothing here knows a model's markup: the chat format's own `parse` splits a text into reasoning,
content and tool calls, and `Sections` re-parses the growing text and sends only what extends what
it already sent, holding back a few characters of the open section because a marker being written
(`</thi...`) is still part of it until it completes.
"""

from __future__ import annotations

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
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class Sections:
    """Reasoning and content deltas of a growing text, through the chat format's parse.

    parse(text) -> object with .reasoning (str | None), .content (str), .tool_calls (list of dicts).
    With tools offered, content waits for the end: a tool call cuts the content before it, and the
    call's opening is not known here, so content sent early might have to be taken back.
    """

    def __init__(self, parse: Callable[[str], Any], stream_content: bool = True):
        self._parse = parse
        self.stream_content = stream_content
        self.reasoning = ""  # sent so far
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.parsed: Any = None

    def update(self, text: str) -> Deltas:
        parsed = self._parse(text)
        reasoning, content = parsed.reasoning or "", parsed.content
        if content:  # the reasoning closed: it is final
            out = Deltas(reasoning=_extension(self.reasoning, reasoning))
            if self.stream_content:
                out.content = _extension(self.content, content[:-HOLD_CHARS])
        else:
            out = Deltas(reasoning=_extension(self.reasoning, reasoning[:-HOLD_CHARS]))
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self, text: str) -> Deltas:
        parsed = self._parse(text)
        self.parsed = parsed
        out = Deltas(reasoning=_extension(self.reasoning, parsed.reasoning or ""),
                     content=_extension(self.content, parsed.content), tool_calls=list(parsed.tool_calls))
        self.reasoning += out.reasoning
        self.content += out.content
        self.tool_calls = out.tool_calls
        return out


def _extension(sent: str, now: str) -> str:
    """What `now` adds to `sent`; nothing if it does not extend it (never take back what was sent)."""
    return now[len(sent):] if len(now) > len(sent) and now.startswith(sent) else ""
