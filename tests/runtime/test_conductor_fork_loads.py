"""A question or a summary on a session whose reader state is parked on disk never holds the engine while its
file is read: the load runs on the store's loader thread while the asker holds nothing (another session's turn
runs to its end meanwhile), the engine is taken once the load has landed, and the answer is that of a fresh
reader fed the same ids. A torn file under a question is a miss: the session is read from row 0 and answered
right."""

from __future__ import annotations

import asyncio

import pytest
from runtime_rig import GRID, prompt_ids

from qse.shadow.reader import ShadowReader
from qse.store import ShadowStore, disk

QUESTION, CHOICES = "Is this a test?", ["A", "B"]


@pytest.fixture
def owner_reads(monkeypatch):
    """The store's file reads on the owner's (the reader's) thread, recorded: a read ahead never goes there."""
    import qse.store.store as store_mod

    reads: list[str] = []
    real = store_mod.ShadowStore._load

    def load(self, reader, path, session_id):
        reads.append(session_id)
        return real(self, reader, path, session_id)

    monkeypatch.setattr(store_mod.ShadowStore, "_load", load)
    return reads


def parked_session(rig, store, ids: list[int]) -> None:
    reader = rig.reader
    reader.feed("q", ids)
    reader.read_all("q")
    assert store.park(reader, reader.get("q"))
    assert store.tier_of("q") == "disk" and not store.ready("q")


def fresh_reader(rig) -> ShadowReader:
    return ShadowReader(rig.reader.engine, grid=GRID, pool_bytes=8 << 20)


@pytest.mark.parametrize("verb", ["ask", "summarize"])
async def test_a_question_waits_for_its_load_holding_nothing_while_a_turn_runs(make_rig, tmp_path, held_loads,
                                                                               owner_reads, verb):
    store = ShadowStore(1 << 40, tmp_path / "reader")
    rig = make_rig(residency=store)
    c = rig.conductor
    ids = prompt_ids(3 * GRID + 5, start=3000)
    parked_session(rig, store, ids)

    if verb == "ask":
        question = asyncio.create_task(c.ask("q", QUESTION, CHOICES))
    else:
        question = asyncio.create_task(c.summarize("q", "Summarize.", 3))
    assert await asyncio.to_thread(held_loads["started"].wait, 60)  # q's file is being read, held
    other = await rig.turn(prompt_ids(GRID + 3, start=9000), 4, session="b")  # served to its end meanwhile
    assert len(other) == 4 and [r.session_id for r in rig.records] == ["b"]
    assert not question.done() and "q" in store.loading
    assert c.board.engine.num_waiting == 0 and not c.board.engine.locked  # the question holds nothing
    assert not rig.reader.get("q").is_resident and store.stats()["restores"] == 0

    held_loads["release"].set()
    result = await question
    stats = store.stats()
    assert (stats["restores"], stats["prefetches"]) == (1, 1) and stats["last_restore_ms"]["prefetch_ms"] > 0
    assert owner_reads == [] and held_loads["calls"] == 1  # the file was read on the loader's thread only

    ref = fresh_reader(rig)
    ref.feed("q", ids)
    if verb == "ask":
        expected = ref.ask("q", c.render_question(QUESTION), CHOICES)
        assert result.distribution == expected.distribution and result.position == expected.position
    else:
        expected = ref.summarize("q", c.render_question("Summarize."), 3, (ref.engine.chat.turn_end_id,))
        assert result.token_ids == expected.token_ids and result.position == expected.position
    assert result.read_tokens == 0  # the state came back at its committed rows: nothing was read again


async def test_a_torn_file_under_a_question_is_a_miss_and_a_read_from_row_0(make_rig, tmp_path, owner_reads):
    store = ShadowStore(1 << 40, tmp_path / "reader")
    rig = make_rig(residency=store)
    c = rig.conductor
    ids = prompt_ids(3 * GRID + 5, start=3000)
    parked_session(rig, store, ids)
    path = tmp_path / "reader" / disk.file_name("q")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    answer = await c.ask("q", QUESTION, CHOICES)
    stats = store.stats()
    assert stats["misses"] == {"truncated": 1} and stats["restores"] == 0 and owner_reads == []
    assert not path.exists()
    assert answer.read_tokens == 3 * GRID and rig.reader.get("q").committed == 3 * GRID  # from row 0

    ref = fresh_reader(rig)
    ref.feed("q", ids)
    expected = ref.ask("q", c.render_question(QUESTION), CHOICES)
    assert answer.distribution == expected.distribution and answer.position == expected.position
    assert ref.state_equal(rig.reader.get("q"), ref.get("q")) == {"committed": True, "kv": True, "recurrent": True,
                                                                   "conv": True}
