"""The runtime tests' rig: the real conductor over the tiny embedded model on CPU.

Every device call of the served engine and the reader is logged in order by a `Probe`, which can also
script what a call measured (and move a scripted clock by as much) and hold a call on its thread until
the test lets it go. Tasks are ordered by futures and events, never by sleeping.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

from qse.engine.engine import Engine
from qse.engine.kv import PagedKV
from qse.runtime.conductor import Conductor, GenerateRequest, TurnRecord
from qse.shadow.reader import ShadowReader

GRID = 32


class ScriptedClock:
    """Time moves only when a scripted device call (or the test) moves it."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Call:
    kind: str  # prefill | decode (served) | chunk | fork (reader: a question or a summary)
    num_ids: int
    ms: float  # what the call reported as measured
    t0: float  # the clock when it began


@dataclass
class _Hold:
    kind: str
    nth: int  # 1-based
    loop: asyncio.AbstractEventLoop
    entered: asyncio.Future
    release: threading.Event = field(default_factory=threading.Event)


class Probe:
    """Wraps `forward` of the engines it is attached to; tells served calls from reader calls by the cache
    (the reader's caches hold paged KV)."""

    def __init__(self, clock: Callable[[], float] | None = None, script_ms: dict[str, float] | None = None):
        self.clock = clock
        self.script_ms = script_ms or {}
        self.calls: list[Call] = []
        self.served_pool = None  # the served sessions' KV pool: its calls are the served model's
        self.holds: list[_Hold] = []
        self._lock = threading.Lock()

    def attach(self, engine: Engine) -> None:
        if getattr(engine.forward, "probe", None) is self:
            return
        real = engine.forward

        def forward(cache, ids, logits="last", logit_row=None, **taps):
            pool = getattr(cache.kv, "pool", None)
            if pool is not None and pool is self.served_pool:  # the served session's grid chunks, tail, decode
                kind = "prefill" if (logits == "none" or ids.numel() > 1) else "decode"
            elif isinstance(cache.kv, PagedKV):
                kind = "chunk" if logits == "none" else "fork"
            else:
                kind = "prefill" if cache.length == 0 else "decode"
            t0 = self.clock() if self.clock is not None else 0.0
            with self._lock:
                nth = sum(1 for c in self.calls if c.kind == kind) + 1
                hold = next((h for h in self.holds if h.kind == kind and h.nth == nth), None)
            if hold is not None:
                hold.loop.call_soon_threadsafe(hold.entered.set_result, None)
                assert hold.release.wait(30), "the test never let the held call go"
            out, ms = real(cache, ids, logits, logit_row, **taps)
            if kind in self.script_ms:
                ms = self.script_ms[kind]
                if isinstance(self.clock, ScriptedClock):
                    self.clock.t += ms / 1000
            with self._lock:
                self.calls.append(Call(kind, int(ids.numel()), ms, t0))
            return out, ms

        forward.probe = self  # type: ignore[attr-defined]
        engine.forward = forward  # type: ignore[method-assign]

    def attach_rounds(self, serving) -> None:
        """The served decode rounds (they run the model's batched step, not engine.forward): each round is one
        "decode" call of as many ids as turns in it, waited for (decode_round) or launched ahead (launch_round:
        on CPU it has run by the time it returns)."""
        self.served_pool = serving.book.pool
        real, real_launch = serving.decode_round, serving.launch_round

        def enter() -> float:
            t0 = self.clock() if self.clock is not None else 0.0
            with self._lock:
                nth = sum(1 for c in self.calls if c.kind == "decode") + 1
                hold = next((h for h in self.holds if h.kind == "decode" and h.nth == nth), None)
            if hold is not None:
                hold.loop.call_soon_threadsafe(hold.entered.set_result, None)
                assert hold.release.wait(30), "the test never let the held call go"
            return t0

        def leave(t0: float, num_rows: int, ms: float) -> float:
            if "decode" in self.script_ms:
                ms = self.script_ms["decode"]
                if isinstance(self.clock, ScriptedClock):
                    self.clock.t += ms / 1000
            with self._lock:
                self.calls.append(Call("decode", num_rows, ms, t0))
            return ms

        def decode_round(turns, tokens, *rest):
            t0 = enter()
            out, ms = real(turns, tokens, *rest)
            return out, leave(t0, len(turns), ms)

        def launch_round(turns, tokens, *rest, **kwargs):
            t0 = enter()
            launched = real_launch(turns, tokens, *rest, **kwargs)
            _, ms = launched.finish()
            launched.gpu_ms = leave(t0, len(turns), ms)
            return launched

        serving.decode_round = decode_round
        serving.launch_round = launch_round

    def hold(self, kind: str, nth: int) -> _Hold:
        """Hold the nth call of `kind` on its thread: await `.entered`, then `.release.set()`."""
        loop = asyncio.get_running_loop()
        h = _Hold(kind, nth, loop, loop.create_future())
        self.holds.append(h)
        return h

    def of(self, kind: str, since: int = 0) -> list[Call]:
        return [c for c in self.calls[since:] if c.kind == kind]

    def kinds(self) -> list[str]:
        return [c.kind for c in self.calls]


@dataclass
class Rig:
    conductor: Conductor
    reader: ShadowReader
    probe: Probe
    records: list[TurnRecord]
    clock: Callable[[], float]

    async def turn(self, prompt: list[int], max_tokens: int, session: str | None = None,
                   request_id: str | None = None) -> list[int]:
        req = GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, session_id=session)
        if request_id is not None:
            req.request_id = request_id
        return await self.turn_request(req)

    async def turn_request(self, req: GenerateRequest) -> list[int]:
        return [t async for t in self.conductor.generate(req)]


def prompt_ids(n: int, start: int = 1000) -> list[int]:
    """n ids of the real vocabulary, none of them a stop or end-of-turn id."""
    return [start + (i * 7919) % 50_000 for i in range(n)]
