"""Fixtures of the runtime tests (the rig itself is in runtime_rig.py)."""

from __future__ import annotations

from typing import Callable

import pytest
from runtime_rig import GRID, Probe, Rig, ScriptedClock

from qse.engine.engine import Engine
from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions, TurnRecord, served_sessions
from qse.shadow.reader import ShadowReader


@pytest.fixture
def make_rig(tiny_engine, tmp_path):
    """Build a conductor: shared=True puts the reader on the served engine (one executor thread)."""
    made: list[Conductor] = []

    def make(*, clock: Callable[[], float] | None = None, script_ms: dict[str, float] | None = None,
             shared: bool = False, options: ShadowOptions | None = None, residency=None, reader_graphs=None,
             served_residency=None, reader_pool_bytes: int = 8 << 20, engine: Engine | None = None, **config) -> Rig:
        clock = clock or ScriptedClock()
        model = (engine or tiny_engine).resolved
        served = Engine(model)  # a fresh wrapper over the one tiny model (or the engine's)
        reader_engine = served if shared else Engine(model)
        reader = ShadowReader(reader_engine, grid=GRID, pool_bytes=reader_pool_bytes, residency=residency, graphs=reader_graphs)
        probe = Probe(clock, script_ms)
        probe.attach(served)
        probe.attach(reader_engine)
        records: list[TurnRecord] = []
        config.setdefault("journal_dir", tmp_path / "shadow")
        policy = Policy(**config)
        # served_residency: the served sessions' store (None: the conductor's own sessions, without tiers)
        serving = served_sessions(served, policy, served_residency) if served_residency is not None else None
        conductor = Conductor(served, reader, options or ShadowOptions(), policy,
                              on_turn=records.append, clock=clock, serving=serving)
        probe.attach_rounds(conductor.serving)
        made.append(conductor)
        return Rig(conductor, reader, probe, records, clock)

    yield make
    for c in made:  # a test that did not stop its conductor leaves no threads behind
        c.served_exec.shutdown()
        c.reader_exec.shutdown()
