"""The checkpoint book: which grid lines a session keeps its GDN state at, in rows (integers only).

One copy of the rules, three users: the reader's sessions and the served model's (qse/sessions/grid.py,
which holds the states themselves and does what a decision says), and the replay simulator (which models
both with the same book, so the two cannot drift apart).

    rows   0 ----- g ----- 2g ----- 3g ----- ... ----- committed
    lines        the prompt ends' lines (`lines`) and the newest re-render places' (`divergence_lines`):
                 a chunk that ends on one takes a checkpoint there
    held         {row: kinds}, each held row a grid line with a state; row 0 (the zero state) is always
                 an implicit checkpoint and never held

Kinds, each with its own cap (the lowest rows of a kind past its cap lose that kind; a row with no kind
left is dropped):
    prompt      the last grid line at or below a turn's prompt end
    recent      the newest grid lines read (one a launch's end)
    divergence  the line at or below one of the newest places where a prompt re-rendered
    first       (`pin_first`, the replay's switch) the lowest prompt checkpoint the prompt cap dropped
    ladder      the lines at `ladder_from` times a power of two (8k, 16k, 32k, ... rows): a prompt that
                re-renders below every prompt and recent checkpoint (a coding agent's context rewritten past
                its system prompt) goes back at worst to half of what it keeps, not to row 0. No cap: a
                session of n rows holds log2(n / ladder_from) + 1 of them

Every change returns a `Change`: the row whose state the caller must copy now (`take`, None if none) and
the rows whose states it must free (`dropped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from qse.core.plan import group_size

PROMPT, RECENT, DIVERGENCE, FIRST, LADDER = "prompt", "recent", "divergence", "first", "ladder"
KINDS = frozenset((PROMPT, RECENT, DIVERGENCE, FIRST, LADDER))


@dataclass(frozen=True)
class CheckpointRules:
    """How many checkpoints of each kind a session keeps, on which grid. Who reads them: the book."""

    grid: int
    prompt: int = 6  # prompt-end checkpoints (max_checkpoints)
    recent: int = 0  # the newest grid lines read
    divergence: int = 0  # the lines of the newest re-render places
    at_line: bool = True  # a prompt end's line is taken at once when the state already stands on it
    pin_first: bool = False  # the lowest prompt checkpoint the prompt cap drops is kept (once) as `first`
    ladder_from: int = 0  # the ladder's lowest line, rows (a multiple of the grid); 0: no ladder

    def __post_init__(self) -> None:
        if not isinstance(self.grid, int) or self.grid < 1:
            raise ValueError(f"grid must be a positive number of rows, got {self.grid!r}")
        for name in ("prompt", "recent", "divergence"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} checkpoints must be a whole number >= 0, got {value!r}")
        if not isinstance(self.ladder_from, int) or self.ladder_from < 0 or self.ladder_from % self.grid:
            raise ValueError(f"the checkpoint ladder's first line (QSE_SERVED_CHECKPOINT_LADDER) must be 0 or a "
                             f"multiple of the grid ({self.grid}) in rows, got {self.ladder_from!r}")

    @classmethod
    def counted(cls, grid: int, max_checkpoints: int = 6, recent_checkpoints: int = 0, divergence_checkpoints: int = 0,
                ladder_from: int = 0, **switches: bool) -> "CheckpointRules":
        """The rules from the counts as GridSessions and the policy name them (`Policy.reader_checkpoints()`,
        `Policy.served_checkpoints()`)."""
        return cls(grid, max_checkpoints, recent_checkpoints, divergence_checkpoints, ladder_from=ladder_from,
                   **switches)

    @property
    def max_held(self) -> int:
        """The most rows a session may hold at once beside its ladder's (`ladder_lines`: one a power of two)."""
        return self.prompt + self.recent + self.divergence + (1 if self.pin_first else 0)

    def is_ladder_line(self, row: int) -> bool:
        """Whether `row` is a line of the ladder: ladder_from times a power of two."""
        if not self.ladder_from or row < self.ladder_from or row % self.ladder_from:
            return False
        times = row // self.ladder_from
        return times & (times - 1) == 0

    def ladder_lines(self, upto: int) -> list[int]:
        """The ladder's lines at or below `upto`, lowest first."""
        lines, row = [], self.ladder_from
        while self.ladder_from and row <= upto:
            lines.append(row)
            row *= 2
        return lines

    def line_of(self, row: int) -> int:
        """The grid line at or below `row`."""
        return (row // self.grid) * self.grid


class Change(NamedTuple):
    take: int | None = None  # copy the state at this row now (a row newly held)
    dropped: tuple[int, ...] = ()  # free the states at these rows (no longer held)
    added: tuple[str, ...] = ()  # the kinds the row at hand gained (taken, then maybe trimmed at once)


class Rollback(NamedTuple):
    row: int  # the row gone back to: the newest held row at or below the first differing id, else 0
    dropped: tuple[int, ...]  # held rows above it, and divergence rows no longer among the lines


class CheckpointBook:
    """One session's checkpoint lines and held rows. Pure: the caller owns the states and applies each Change."""

    def __init__(self, rules: CheckpointRules):
        self.rules = rules
        self.lines: set[int] = set()  # prompt ends' grid lines, kept while the session holds that many ids
        self.divergence_lines: list[int] = []  # the newest re-render places' lines, oldest first
        self._held: dict[int, set[str]] = {}

    # ---- questions ---------------------------------------------------------------------------
    def positions(self, kind: str | None = PROMPT) -> list[int]:
        """Held rows of one kind (None: of every kind), lowest first."""
        return sorted(p for p, kinds in self._held.items() if kind is None or kind in kinds)

    def kinds_at(self, row: int) -> frozenset[str]:
        return frozenset(self._held.get(row, ()))

    def __len__(self) -> int:
        return len(self._held)

    def rollback_row(self, first_diff: int) -> int:
        """The row a session goes back to when what it read departs at `first_diff`: the newest held row at or
        below it (of any kind), else 0."""
        return max((p for p in self._held if p <= first_diff), default=0)

    def group_chunks(self, first_row: int, wanted: int) -> int:
        """Chunks one launch from `first_row` reads (a power of two up to `wanted`, ending at the first prompt or
        divergence line inside): the line's checkpoint then falls on the launch's end."""
        rules = self.rules
        ladder = rules.ladder_lines(first_row + wanted * rules.grid)
        return group_size(first_row, wanted, rules.grid, self.lines, self.divergence_lines, ladder)

    def may_take_at(self, end: int) -> bool:
        """Whether a chunk ending at `end` may take a checkpoint (what a byte cap must leave room for)."""
        return (end in self.lines or end in self.divergence_lines or self.rules.recent > 0
                or self.rules.is_ladder_line(end))

    # ---- changes -----------------------------------------------------------------------------
    def feed(self, known: int, prompt_end: int | None = None, standing: int | None = None) -> Change:
        """The session now holds `known` ids; `prompt_end`: a new prompt ends there (its line joins the lines);
        `standing`: the row the session's state stands on (None: no state held). Lines above `known` go. With
        `at_line`, a prompt end whose line is where the state stands takes its checkpoint now (the reader read
        into the output last turn and the prompt re-rendered at or above the line)."""
        line = None
        if prompt_end is not None:
            line = self.rules.line_of(prompt_end)
            if line > 0:
                self.lines.add(line)
        self.lines = {p for p in self.lines if p <= known}
        if (self.rules.at_line and line is not None and standing is not None and 0 < standing == line
                and PROMPT not in self._held.get(line, ())):
            return self._take(line, (PROMPT,))
        return Change()

    def after_chunk(self, end: int, launch_end: bool = True) -> Change:
        """A chunk read up to row `end`: a prompt line, a new divergence line or a ladder line there takes a
        checkpoint, and a launch's end takes a recent one."""
        kinds = []
        if end in self.lines:
            kinds.append(PROMPT)
        if self.rules.is_ladder_line(end) and LADDER not in self._held.get(end, ()):
            kinds.append(LADDER)
        if end in self.divergence_lines and DIVERGENCE not in self._held.get(end, ()):
            kinds.append(DIVERGENCE)
        if self.rules.recent and launch_end:
            kinds.append(RECENT)
        return self._take(end, tuple(kinds)) if kinds else Change()

    def roll_back(self, first_diff: int) -> Rollback:
        """What was read departs at `first_diff`: go back to `rollback_row`; rows above it go; with divergence
        checkpoints, the line at or below `first_diff` becomes one of the newest re-render lines (the next
        re-render there finds the state)."""
        row = self.rollback_row(first_diff)
        dropped = [p for p in self._held if p > row]
        for p in dropped:
            del self._held[p]
        cap, line = self.rules.divergence, self.rules.line_of(first_diff)
        if cap and line > 0:
            self.divergence_lines = ([p for p in self.divergence_lines if p != line] + [line])[-cap:]
            dropped += self._trim(DIVERGENCE, keep=set(self.divergence_lines))
        return Rollback(row, tuple(sorted(dropped)))

    def clear(self) -> tuple[int, ...]:
        """The session's state is gone (dropped, or parked elsewhere): no row is held; the lines stay."""
        dropped = tuple(sorted(self._held))
        self._held.clear()
        return dropped

    def load(self, held: dict[int, set[str]], divergence_lines: list[int] | None = None) -> None:
        """Rows held as a parked session's record had them (the store bringing it back)."""
        for row, kinds in held.items():
            if not kinds or not set(kinds) <= KINDS:
                raise ValueError(f"checkpoint at row {row} has kinds {sorted(kinds)!r}, expected some of {sorted(KINDS)}")
        self._held = {row: set(kinds) for row, kinds in held.items()}
        if divergence_lines is not None:
            self.divergence_lines = list(divergence_lines)

    def _take(self, row: int, kinds: tuple[str, ...]) -> Change:
        was_held = row in self._held
        self._held.setdefault(row, set()).update(kinds)
        dropped: list[int] = []
        for kind in kinds:
            if kind == LADDER:  # (no cap: one a power of two)
                continue
            cap = getattr(self.rules, kind)
            rows = self.positions(kind)
            if len(rows) <= cap:  # none over the cap: nothing to pin or trim (most chunks' ends)
                continue
            over = rows[: len(rows) - cap]  # the lowest go
            if kind == PROMPT and self.rules.pin_first and not self.positions(FIRST):
                self._held[over[0]].add(FIRST)
            dropped += self._drop_kind(kind, over)
        take = row if row in self._held and not was_held else None
        return Change(take, tuple(sorted(p for p in dropped if p != row or was_held)), kinds)

    def _trim(self, kind: str, keep: set[int]) -> list[int]:
        """`kind` taken from held rows outside `keep`; returns the rows left with no kind (dropped)."""
        return self._drop_kind(kind, [p for p, kinds in self._held.items() if kind in kinds and p not in keep])

    def _drop_kind(self, kind: str, rows: list[int]) -> list[int]:
        """`kind` taken from `rows` (each holds it); returns those left with no kind (dropped)."""
        dropped = []
        for row in rows:
            kinds = self._held[row]
            kinds.discard(kind)
            if not kinds:
                del self._held[row]
                dropped.append(row)
        return dropped


__all__ = ["DIVERGENCE", "FIRST", "KINDS", "LADDER", "PROMPT", "RECENT", "Change", "CheckpointBook", "CheckpointRules",
           "Rollback"]
