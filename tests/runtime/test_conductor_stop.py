"""A planned stop: the idle burst stops before its next chunk, the request in flight finishes, then every
resident session is parked; requests after the stop are refused."""

import asyncio

import pytest
from runtime_rig import GRID, prompt_ids

from qse.runtime.conductor import ConductorStopped
from qse.shadow.reader import DropLRU


class ParkingResidency(DropLRU):
    def __init__(self, events: list[str]):
        self.events = events

    def park_all(self, reader) -> dict:
        self.events.append(f"park_all:{sorted(reader.sessions)}")
        return {"parked": len(reader.sessions)}


async def test_stop_waits_for_the_turn_in_flight_then_parks(make_rig):
    events: list[str] = []
    rig = make_rig(residency=ParkingResidency(events), idle_poll_s=3600.0)
    c, probe = rig.conductor, rig.probe
    c.on_turn = lambda record: events.append(f"turn:{record.request_id}")
    await c.start()
    second_decode = probe.hold("decode", 2)
    turn = asyncio.create_task(rig.turn(prompt_ids(GRID + 3), 5, session="s", request_id="inflight"))
    await second_decode.entered
    stopping = asyncio.create_task(c.stop())
    await c.board.engine.wait_for_waiters(1)  # the stop waits for the engine, behind the turn
    assert not stopping.done() and events == []
    second_decode.release.set()
    assert len(await turn) == 5
    await stopping
    assert events == ["turn:inflight", "park_all:['s']"]
    with pytest.raises(ConductorStopped, match="stopped"):
        await rig.turn(prompt_ids(4), 2, session="late")
    await c.stop()  # a second stop does nothing
    assert events == ["turn:inflight", "park_all:['s']"]


async def test_stop_ends_an_idle_burst_before_its_next_chunk(make_rig):
    events: list[str] = []
    rig = make_rig(residency=ParkingResidency(events))
    c, reader, probe = rig.conductor, rig.reader, rig.probe
    reader.feed("old", prompt_ids(8 * GRID))
    first_chunk = probe.hold("chunk", 1)
    burst = asyncio.create_task(c.idle_once())
    await first_chunk.entered
    stopping = asyncio.create_task(c.stop())
    await c.board.engine.wait_for_waiters(1)  # stop() is stopping and waits for the burst's engine lock
    first_chunk.release.set()
    assert await burst == 1
    await stopping
    assert reader.sessions["old"].committed == GRID
    assert events == ["park_all:['old']"]


async def test_stop_with_nowhere_to_park_still_stops(make_rig):
    rig = make_rig()  # the default residency (drop LRU) has no disk tier: nothing to park, no store to report
    assert rig.reader.residency.park_all(rig.reader) == {} and rig.reader.residency.stats() == {}
    await rig.turn(prompt_ids(3), 2, session="s")
    await rig.conductor.stop()
    status = rig.conductor.status()
    assert status["turns"] == 1 and "store" not in status and "store" not in status["served_cache"]
