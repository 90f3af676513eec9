"""The reader's read rate for the replay: ms per grid chunk as a function of context.

File format (a benchmark result, or a file written by hand); other top-level keys are ignored:

    {"read_model": {"grid": 512, "points": [[0, 44.5], [32768, 52.0], [100000, 75.0]],
                    "source": "free text: device, model, command"}}

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

SEED_MS_PER_1000_TOKENS = 87.0


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

    @classmethod
    def flat(cls, ms_per_1000_tokens: float = SEED_MS_PER_1000_TOKENS, grid: int = 512, source: str = "") -> "ReadModel":
        source = source or f"flat {ms_per_1000_tokens} ms per 1000 tokens (seed 000, GB10, 0.8B, grid 512)"
        return cls(((0, ms_per_1000_tokens * grid / 1000),), grid, source)

    @classmethod
    def from_json(cls, obj: dict, origin: str = "<json>") -> "ReadModel":
        try:
            block = obj["read_model"]
            points = tuple((int(c), float(ms)) for c, ms in block["points"])
            grid = int(block.get("grid", 512))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReadModelError(f"{origin}: expected {{\"read_model\": {{\"points\": [[context_tokens, ms_per_chunk], ...],"
                                 f" \"grid\": 512}}}} ({type(exc).__name__}: {exc})") from None
        return cls(points, grid, str(block.get("source", origin)))

    @classmethod
    def load(cls, path: Path | str) -> "ReadModel":
        path = Path(path)
        try:
            obj = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReadModelError(f"{path}: cannot read a read model ({exc})") from None
        return cls.from_json(obj, str(path))

    def to_json(self) -> dict:
        return {"read_model": {"grid": self.grid, "points": [list(p) for p in self.points], "source": self.source}}

    def ms_per_chunk(self, context_tokens: int, grid: int | None = None) -> float:
        """GPU ms to read one chunk of `grid` rows above `context_tokens` committed rows."""
        cs = [c for c, _ in self.points]
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
