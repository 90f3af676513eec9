"""The one object that passes from policy to the executor: what the reader may read next.

A window's decision (`IdleBurst`, `RationSlice`) says whether and how much; `plan_read` turns it into a
`ReaderPlan` the executor carries out with `PlanDriver`. Everything the executor needs is here, so
the executor never calls back into the policy to learn what to do, only whether to go on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from qse.core.ledger import Role


class Window(str, Enum):
    """When the reader reads."""

    IDLE = "idle"  # no request runs or waits
    RATION = "ration"  # between two decode rounds, on the request's executor
    PREFILL = "prefill"  # exploratory: during the served prefill (off by default)
    NARRATOR = "narrator"  # the narrator's share, between two decode rounds


ROLE_OF_WINDOW: dict[Window, Role] = {
    Window.IDLE: Role.READER_IDLE,
    Window.RATION: Role.READER_RATION,
    Window.PREFILL: Role.READER_PREFILL,
    Window.NARRATOR: Role.NARRATOR,
}


class Backlog(str, Enum):
    """Which of the session's unread ids the next chunk comes from: the prompt first, then the output."""

    PROMPT = "prompt"
    OUTPUT = "output"  # any chunk that reaches past the prompt's end


def whole_chunks(committed_rows: int, known_tokens: int, grid: int) -> int:
    """Whole grid chunks between the committed rows and the ids the session holds."""
    return max(0, (known_tokens - committed_rows) // grid)


def is_fresh(behind_tokens: int, grid: int) -> bool:
    """A turn start finds the reader fresh: less than one grid chunk of the session's kept ids unread (the
    server's qse_shadow_turn_starts{fresh}, the replays' freshness)."""
    return behind_tokens < grid


def next_backlog(committed_rows: int, prompt_tokens: int, known_tokens: int, grid: int) -> Backlog | None:
    """Where the next whole chunk lies; None when the session holds no whole chunk past the committed rows."""
    end = committed_rows + grid
    if end > known_tokens:
        return None
    return Backlog.PROMPT if end <= prompt_tokens else Backlog.OUTPUT


@dataclass(frozen=True)
class ReaderPlan:
    """One step of the reader. Each field says who reads it."""

    window: Window  # runtime: the ledger role to charge (ROLE_OF_WINDOW) and the log event's name
    session_id: str  # executor: whose reader state advances
    turn_id: str | None  # ledger: the open turn charged (None in the idle window: totals only)
    backlog: Backlog  # executor and logs: prompt or output ids (the rows follow from start_row)
    start_row: int  # executor: the committed row the first chunk starts at (a multiple of grid)
    max_chunks: int  # executor: whole chunks available; it never reads past start_row + max_chunks * grid
    grid: int  # executor: rows per chunk
    budget_ms: float  # executor: the GPU time this step may spend; a chunk whose estimate exceeds what is left is not started
    first_chunk_est_ms: float  # ledger: the estimate that admitted the first chunk
    stop_when_waiting: bool  # executor: ask before every chunk whether a request waits (idle window)
    sync_first: bool  # executor: synchronise the device before the first chunk, so nothing runs beside the served model
    # executor: chunks it may launch beyond the oldest one not yet read back. 1 hides the host's launch of a
    # chunk behind the device's work on the one before (the device idled ~0.4 ms a chunk while the host
    # launched); 0 reads each chunk back before the next is launched (the replay's model of time)
    lookahead: int = 0
    # executor, with lookahead in a window that asks whether a request waits: a chunk is launched only this
    # long before the one in flight is expected to end, after asking, so an arriving request still waits
    # for at most one chunk (and this lead) rather than two. 0: launch as soon as the decision allows
    launch_lead_ms: float = 0.0
    # executor, idle window only: grid chunks one launch may read (the reader's chunk groups, one chunk's later
    # layers beside the next one's earlier layers: ~15 % less device time a chunk). A group is admitted at
    # the sum of its chunks' estimates and read back before the next launch, so an arriving request waits
    # for at most one group. 1: one chunk a launch
    group: int = 1

    @property
    def role(self) -> Role:
        return ROLE_OF_WINDOW[self.window]

    @property
    def end_row_max(self) -> int:
        return self.start_row + self.max_chunks * self.grid


def check_lookahead(lookahead: int, launch_lead_ms: float, lookahead_name: str = "lookahead",
                    lead_name: str = "launch lead") -> None:
    """A ReaderPlan's lookahead (whole chunks >= 0) and launch lead (finite ms >= 0), or a ValueError that
    names the bad one (a caller that took them from settings passes the settings' names)."""
    if not (isinstance(lookahead, int) and not isinstance(lookahead, bool) and lookahead >= 0):
        raise ValueError(f"{lookahead_name} must be a whole number of chunks >= 0, got {lookahead!r}")
    if not (isinstance(launch_lead_ms, (int, float)) and math.isfinite(launch_lead_ms) and launch_lead_ms >= 0):
        raise ValueError(f"{lead_name} must be a finite number of ms >= 0, got {launch_lead_ms!r}")


def check_group(group: int, name: str = "group") -> None:
    """A ReaderPlan's chunks a launch (a whole number >= 1), or a ValueError naming the bad value."""
    if not (isinstance(group, int) and not isinstance(group, bool) and group >= 1):
        raise ValueError(f"{name} must be a whole number of chunks >= 1, got {group!r}")


def group_size(first_row: int, wanted: int, grid: int, *line_sets) -> int:
    """The chunks a chunk group from `first_row` reads when `wanted` (>= 1) may go: the largest power of two
    up to `wanted` whose chunks hold no row of `line_sets` inside (prompt and divergence lines: a line falls
    on a group's end, where its checkpoint is taken). The reader forms its groups so; the replay models them."""
    count = wanted
    for i in range(1, wanted):
        if any(first_row + i * grid in lines for lines in line_sets):
            count = i
            break
    return 1 << (count.bit_length() - 1)


def plan_read(window: Window, *, session_id: str, turn_id: str | None, committed_rows: int,
              prompt_tokens: int, known_tokens: int, grid: int, budget_ms: float,
              first_chunk_est_ms: float, lookahead: int = 0, launch_lead_ms: float = 0.0,
              group: int = 1) -> ReaderPlan | None:
    """A plan over the session's whole unread chunks; None when there is no whole chunk to read. `group`
    applies to the idle window only (a ration slice reads one chunk a launch)."""
    check_lookahead(lookahead, launch_lead_ms)
    check_group(group)
    backlog = next_backlog(committed_rows, prompt_tokens, known_tokens, grid)
    if backlog is None or committed_rows % grid != 0:
        return None
    return ReaderPlan(
        window=window,
        session_id=session_id,
        turn_id=turn_id,
        backlog=backlog,
        start_row=committed_rows,
        max_chunks=whole_chunks(committed_rows, known_tokens, grid),
        grid=grid,
        budget_ms=budget_ms,
        first_chunk_est_ms=first_chunk_est_ms,
        stop_when_waiting=window is Window.IDLE,
        sync_first=window is not Window.IDLE,
        lookahead=lookahead,
        launch_lead_ms=float(launch_lead_ms) if window is Window.IDLE else 0.0,
        group=group if window is Window.IDLE else 1,
    )
