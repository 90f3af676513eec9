"""The live narrator: a turn's thought summarised on the reader while the answer streams.

    a narrated turn's output           between two decode rounds, in the narrator's share (TurnRation.narrator:
    ------------------------           QSE_NARRATOR_SHARE of the served model's time since its first token)
    thought ...                        read whole chunks of the session up to what is known of the thought
    ... (its end marker)               the thought's end is known: read whole chunks up to it, then
    answer ... (streaming)             with less than a chunk left: the summary, greedy on a fork above the
                                       session's ids (the whole session), delivered at once to the turn's
                                       `narrate` callback (the server's SSE event, and its status)

The conductor carries it out (its reads and the summary run on the reader's executor and are charged to the
turn under Role.NARRATOR); this module keeps who is followed, where each thought ends, and the typed record.
A turn whose thought does not end before the turn does is not summarised here (the server may ask after it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import msgspec

NARRATOR_QUESTION = ("In one or two sentences, summarize what the assistant is thinking about and planning "
                     "in its latest turn.")


class Narration(msgspec.Struct, frozen=True):
    """A summary of a turn's thought, as delivered."""

    session_id: str
    request_id: str
    text: str
    tokens: int
    position: int  # the fork's base: the summary read the session's ids up to here
    gpu_ms: float
    live: bool  # delivered while the turn ran (False: after it)


@dataclass
class Followed:
    """A turn the narrator follows."""

    request_id: str
    session_id: str
    prompt_tokens: int
    deliver: Callable[[Narration], None]
    thought_end: int | None = None  # known ids through the thought's end marker, once it is out
    scanned: int = 0  # output ids already looked at for the marker
    done: bool = False


class Narrator:
    """Who the narrator follows, where their thoughts end, and the last summaries (for the status)."""

    def __init__(self, thought_end_id: int | None, max_tokens: int, summary_prior_ms: float):
        self.thought_end_id = thought_end_id
        self.max_tokens = max_tokens
        self.summary_est_ms = summary_prior_ms  # the next summary's cost: the last one measured
        self.followed: dict[str, Followed] = {}  # by the turn's ledger key
        self.recent: deque[Narration] = deque(maxlen=32)
        self.num_live = 0
        self.num_missed = 0  # followed turns that ended before their summary

    def follow(self, turn_id: str, request_id: str, session_id: str, prompt_tokens: int,
               deliver: Callable[[Narration], None]) -> None:
        if self.thought_end_id is not None:  # a format without a thought marker has nothing to narrate live
            self.followed[turn_id] = Followed(request_id, session_id, prompt_tokens, deliver)

    def thought_end(self, turn_id: str, out_ids: list[int]) -> int | None:
        """Known ids through the thought's end marker (prompt + output), None while the thought goes on."""
        f = self.followed[turn_id]
        if f.thought_end is None:
            for i in range(f.scanned, len(out_ids)):
                if out_ids[i] == self.thought_end_id:
                    f.thought_end = f.prompt_tokens + i + 1
                    break
            f.scanned = len(out_ids)
        return f.thought_end

    def delivered(self, turn_id: str, narration: Narration) -> None:
        f = self.followed[turn_id]
        f.done = True
        self.summary_est_ms = narration.gpu_ms
        self.recent.append(narration)
        self.num_live += int(narration.live)
        f.deliver(narration)

    def unfollow(self, turn_id: str) -> None:
        f = self.followed.pop(turn_id, None)
        if f is not None and not f.done and f.thought_end is not None:
            self.num_missed += 1

    def status(self) -> dict:
        return {"following": sum(1 for f in self.followed.values() if not f.done), "live": self.num_live,
                "missed": self.num_missed, "summary_est_ms": round(self.summary_est_ms, 3),
                "recent": [msgspec.structs.asdict(n) for n in list(self.recent)[-8:]]}
