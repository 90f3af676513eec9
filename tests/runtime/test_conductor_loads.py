"""A state that is still loading is simply not read yet: a turn whose served session is parked on disk waits,
unadmitted, while its file loads beside the rounds (another session's turn runs and ends meanwhile), then opens
from the loaded copy with the tokens of a cold prefill; the idle window reads other sessions while a parked
one loads, and reads that one once its load has landed, bit for bit."""

from __future__ import annotations

import asyncio

from runtime_rig import GRID, prompt_ids

from qse.shadow.reader import ShadowReader
from qse.store import ShadowStore


async def test_a_turn_on_a_parked_session_waits_for_its_load_while_other_turns_run(make_rig, tmp_path, held_loads):
    store = ShadowStore(1 << 40, tmp_path / "served")
    rig = make_rig(served_residency=store, served_grid=GRID, max_running=2)
    c = rig.conductor
    book = c.serving.book
    first = prompt_ids(3 * GRID + 5, start=3000)
    await rig.turn(first, 2, session="a")
    assert await c.served_exec.run(store.park, book, book.get("a"))
    nxt = first + prompt_ids(9, start=20000)

    parked_turn = asyncio.create_task(rig.turn(nxt, 3, session="a"))
    assert await asyncio.to_thread(held_loads["started"].wait, 60)  # a's file is being read, held
    other = await rig.turn(prompt_ids(GRID + 3, start=9000), 4, session="b")  # served while a's load waits
    assert len(other) == 4 and not parked_turn.done()
    assert "a" in store.loading and not book.get("a").is_resident and store.stats()["restores"] == 0
    assert [r.session_id for r in rig.records] == ["a", "b"]

    held_loads["release"].set()
    out = await parked_turn
    record = rig.records[-1]
    assert (record.session_id, record.cache_tier, record.cached_tokens) == ("a", "disk", 3 * GRID)
    stats = store.stats()
    assert (stats["restores"], stats["prefetches"]) == (1, 1) and stats["last_restore_ms"]["prefetch_ms"] > 0
    assert held_loads["calls"] == 1
    cold = make_rig(served_grid=GRID)
    assert out == await cold.turn(nxt, 3, session="a")


async def test_the_idle_window_reads_around_a_loading_session_and_reads_it_once_loaded(make_rig, tmp_path,
                                                                                      held_loads):
    store = ShadowStore(1 << 40, tmp_path / "reader")
    rig = make_rig(residency=store)
    c, reader = rig.conductor, rig.reader
    a_ids = prompt_ids(3 * GRID, start=3000)
    reader.feed("a", a_ids)
    reader.read_all("a")
    assert store.park(reader, reader.get("a"))
    a_ids += prompt_ids(2 * GRID, start=30000)
    reader.feed("a", a_ids)  # two more chunks to read, its state on disk
    reader.feed("b", prompt_ids(2 * GRID, start=9000))

    assert await c.idle_once() == 2  # b's chunks; a's file started loading, not read on the reader's thread
    assert await asyncio.to_thread(held_loads["started"].wait, 60) and "a" in store.loading
    assert not reader.get("a").is_resident and store.stats()["restores"] == 0
    assert await c.idle_once() == 0  # nothing else is ready: the window reads nothing
    load = store.loading["a"].future
    held_loads["release"].set()
    await asyncio.wrap_future(load)

    assert await c.idle_once() == 2  # landed at the window's safe point: a comes back from host memory
    stats = store.stats()
    assert (stats["restores"], stats["prefetches"]) == (1, 1) and stats["last_restore_ms"]["prefetch_ms"] > 0
    ref = ShadowReader(reader.engine, grid=GRID, pool_bytes=8 << 20)
    fresh = ref.fresh_prefill(a_ids)
    assert ref.state_equal(reader.get("a"), fresh) == {"committed": True, "kv": True, "recurrent": True, "conv": True}
