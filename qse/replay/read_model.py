"""The reader's read rate for the replay: ms per grid chunk as a function of context.

File format (a benchmark result, or a file written by hand); other top-level keys are ignored:

    {"read_model": {"grid": 512, "points": [[0, 44.5], [32768, 52.0], [100000, 75.0]],
                    "source": "free text: device, model, command"}}

A `benchmarks/shadow_measure.py` result (no "read_model" block) is read as it is: its "qse" list has
one row per preset and ops, each with "ms_per_chunk_by_context" ({context: median ms per chunk}) and
"grid"; the points are that row's pairs. The row is chosen by `preset` (default: the 0.8B preset,
qse's default reader) and `ops` (default: the only one measured for that preset); a row that failed
("error") is never used. The source names the file, the row, the device, the date and the command.

`points` are [context_tokens, ms_per_chunk] pairs: the measured GPU time of one grid chunk whose
first row sits after `context_tokens` committed rows. Between points the cost is interpolated
linearly; below the first point it is the first point's; past the last it follows the last
segment's slope (never falling). For another grid the cost scales with the chunk's rows (ms per
token kept), which is only a first approximation. The default is the seed's GB10 figure, 87 ms per
1,000 tokens at grid 512 (0.8B, the served process's flags), flat in context.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from qse.core.plan import check_group

SEED_MS_PER_1000_TOKENS = 87.0
DEFAULT_PRESET = "qwen3.5-0.8b"  # the reader qse runs by default


class ReadModelError(ValueError):
    """A read-model file that cannot be used."""


@dataclass(frozen=True)
class ReadModel:
    points: tuple[tuple[int, float], ...]
    grid: int = 512
    source: str = ""

    def __post_init__(self) -> None:
        if not self.points:
            raise ReadModelError("read model has no points; give at least one [context_tokens, ms_per_chunk]")
        contexts = [c for c, _ in self.points]
        if contexts != sorted(contexts) or len(set(contexts)) != len(contexts):
            raise ReadModelError(f"read model contexts must increase strictly, got {contexts}")
        for c, ms in self.points:
            if c < 0 or not (math.isfinite(ms) and ms > 0):
                raise ReadModelError(f"read model point [{c}, {ms}] must have context >= 0 and ms > 0")
        if self.grid <= 0:
            raise ReadModelError(f"read model grid must be positive, got {self.grid}")
        # derived, not fields: the contexts for the lookup, and per grid the running sums of whole chunks from
        # row 0 (a replay asks for millions of chunks and of spans)
        object.__setattr__(self, "_contexts", tuple(contexts))
        object.__setattr__(self, "_sums", {})

    @classmethod
    def flat(cls, ms_per_1000_tokens: float = SEED_MS_PER_1000_TOKENS, grid: int = 512, source: str = "") -> "ReadModel":
        if not source:
            source = f"flat {ms_per_1000_tokens:g} ms per 1000 tokens at grid {grid}"
            if ms_per_1000_tokens == SEED_MS_PER_1000_TOKENS:
                source += " (seed 000: GB10, 0.8B, the served process's flags)"
        return cls(((0, ms_per_1000_tokens * grid / 1000),), grid, source)

    @classmethod
    def from_json(cls, obj: dict, origin: str = "<json>", preset: str | None = None,
                  ops: str | None = None) -> "ReadModel":
        """A read model from a `{"read_model": ...}` object or a shadow_measure result (see the module)."""
        if isinstance(obj, dict) and "read_model" not in obj and isinstance(obj.get("qse"), list):
            return cls.from_shadow_measure(obj, origin, preset, ops)
        if preset is not None or ops is not None:
            raise ReadModelError(f"{origin}: a preset or ops can only be chosen in a shadow_measure result "
                                 "(a file with a \"qse\" list); this file has a \"read_model\" block")
        try:
            block = obj["read_model"]
            points = tuple((int(c), float(ms)) for c, ms in block["points"])
            grid = int(block.get("grid", 512))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReadModelError(f"{origin}: expected {{\"read_model\": {{\"points\": [[context_tokens, ms_per_chunk], ...],"
                                 f" \"grid\": 512}}}} or a shadow_measure result ({type(exc).__name__}: {exc})") from None
        return cls(points, grid, str(block.get("source", origin)))

    @classmethod
    def from_shadow_measure(cls, obj: dict, origin: str = "<json>", preset: str | None = None,
                            ops: str | None = None) -> "ReadModel":
        """The measured per-context chunk times of one row of a benchmarks/shadow_measure.py result."""
        rows = [r for r in obj["qse"] if isinstance(r, dict)]
        measured = [r for r in rows if "error" not in r and isinstance(r.get("ms_per_chunk_by_context"), dict)
                    and r["ms_per_chunk_by_context"]]
        have = sorted({f"{r.get('preset')}/{r.get('ops')}" for r in measured})
        want = DEFAULT_PRESET if preset is None else preset
        picked = [r for r in measured if r.get("preset") == want and (ops is None or r.get("ops") == ops)]
        if not picked:
            failed = [f"{r.get('preset')}/{r.get('ops')}" for r in rows if "error" in r]
            raise ReadModelError(f"{origin}: no measured row for preset {want!r}" + (f" and ops {ops!r}" if ops else "")
                                 + f"; measured: {have or 'none'}" + (f"; failed: {failed}" if failed else ""))
        if len(picked) > 1:
            raise ReadModelError(f"{origin}: preset {want!r} was measured with several ops "
                                 f"({sorted(str(r.get('ops')) for r in picked)}); choose one (--read-model-ops)")
        row = picked[0]
        try:
            points = tuple(sorted((int(c), float(ms)) for c, ms in row["ms_per_chunk_by_context"].items()))
            grid = int(row.get("grid", 512))
        except (TypeError, ValueError) as exc:
            raise ReadModelError(f"{origin}: row {want}/{row.get('ops')}: ms_per_chunk_by_context is not "
                                 f"{{context: ms}} ({exc})") from None
        parts = [f"{origin}: shadow_measure row preset={row.get('preset')} ops={row.get('ops')} grid={grid}",
                 "median ms per chunk by context"]
        for key in ("device", "date", "command"):
            if obj.get(key):
                parts.append(f"{key} {obj[key]}")
        return cls(points, grid, "; ".join(parts))

    @classmethod
    def load(cls, path: Path | str, preset: str | None = None, ops: str | None = None) -> "ReadModel":
        path = Path(path)
        try:
            obj = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReadModelError(f"{path}: cannot read a read model ({exc})") from None
        if not isinstance(obj, dict):
            raise ReadModelError(f"{path}: expected a JSON object, got {type(obj).__name__}")
        return cls.from_json(obj, str(path), preset, ops)

    def to_json(self) -> dict:
        return {"read_model": {"grid": self.grid, "points": [list(p) for p in self.points], "source": self.source}}

    def ms_per_chunk(self, context_tokens: int, grid: int | None = None) -> float:
        """GPU ms to read one chunk of `grid` rows above `context_tokens` committed rows."""
        cs = self._contexts
        i = bisect.bisect_right(cs, context_tokens)
        if i == 0:
            ms = self.points[0][1]
        elif i == len(cs):
            if len(cs) == 1:
                ms = self.points[0][1]
            else:
                (c0, m0), (c1, m1) = self.points[-2], self.points[-1]
                ms = m1 + max(0.0, (m1 - m0) / (c1 - c0)) * (context_tokens - c1)
        else:
            (c0, m0), (c1, m1) = self.points[i - 1], self.points[i]
            ms = m0 + (m1 - m0) * (context_tokens - c0) / (c1 - c0)
        if grid is not None and grid != self.grid:
            ms *= grid / self.grid
        return ms

    def chunks_ms(self, start_row: int, end_row: int, grid: int) -> float:
        """GPU ms of the whole chunks of `grid` rows from `start_row` up to `end_row` (both on grid lines):
        the sum of ms_per_chunk over them, from running sums kept per grid."""
        if start_row % grid or end_row % grid:
            raise ValueError(f"rows {start_row} and {end_row} must be on {grid}-row grid lines")
        if end_row <= start_row:
            return 0.0
        sums = self._sums.setdefault(grid, [0.0])  # sums[k]: the chunks below row k * grid
        while len(sums) <= end_row // grid:
            sums.append(sums[-1] + self.ms_per_chunk((len(sums) - 1) * grid, grid))
        return sums[end_row // grid] - sums[start_row // grid]


# A grid chunk's device time inside a chunk group of k chunks, against alone: a + b / k (the fill and drain of
# a group's skew spread over its chunks), fitted to the H200's 0.8B 64k reads at 4 layer ranges
# (chunk_groups-sweep3/4-*, one chunk a launch 9.54 ms per 1000 tokens: groups of 4 8.28, of 8 8.10, of 16
# 8.01; a + b/8 = 0.850 was the check). Groups of 2 were not measured: 0.906 by the fit.
GROUP_SHARE_FLOOR = 0.831
GROUP_SHARE_SLOPE = 0.149


def group_share(chunks: int) -> float:
    """The share of its time alone a chunk takes inside a group of `chunks` (1: alone)."""
    check_group(chunks, "a group")
    return 1.0 if chunks == 1 else GROUP_SHARE_FLOOR + GROUP_SHARE_SLOPE / chunks
