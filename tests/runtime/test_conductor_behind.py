"""A question on a session the reader is behind on, through the conductor: the chunks read for it are charged to
the asker (READER_ASK, the narrator's for a summary) and kept for the session; "answer_now" reads nothing; a
router question waiting inside the backlog is still answered at its own position."""

import json

from runtime_rig import GRID, prompt_ids

from qse.core.ledger import Role, ms_to_us
from qse.runtime.conductor import ShadowOptions
from qse.runtime.router import PendingQuestion


async def test_the_backlog_read_for_a_question_is_the_askers_and_is_kept(make_rig):
    rig = make_rig(script_ms={"chunk": 10.0, "fork": 5.0})
    c, reader = rig.conductor, rig.reader
    reader.feed("x", prompt_ids(4 * GRID + 7))
    now = await c.ask("x", "Is this a test?", ["A", "B"], behind="answer_now")
    assert reader.get("x").committed == 0 and now.read_tokens == 0 and now.behind == 4 * GRID + 7
    assert c.ledger.balance().gpu_us[Role.READER_ASK] == ms_to_us(5.0)

    answer = await c.ask("x", "Is this a test?", ["A", "B"])
    assert reader.get("x").committed == 4 * GRID and answer.read_tokens == 4 * GRID and answer.behind == 0
    assert answer.gpu_ms == 4 * 10.0 + 5.0 and answer.read_ms == 4 * 10.0
    total = c.ledger.balance()
    assert total.gpu_us[Role.READER_ASK] == ms_to_us(5.0) + ms_to_us(45.0)
    assert total.gpu_us.get(Role.READER_IDLE, 0) == 0  # nothing was left for the idle window
    assert await c.idle_once() == 0

    reader.feed("x", prompt_ids(6 * GRID + 3))  # two chunks more: the narrator's summary reads them
    summary = await c.summarize("x", "Summarize.", 2)
    assert reader.get("x").committed == 6 * GRID and summary.read_tokens == 2 * GRID
    assert c.ledger.balance().gpu_us[Role.NARRATOR] == ms_to_us(summary.gpu_ms)


async def test_a_question_stops_at_a_waiting_router_question(make_rig, tmp_path):
    rig = make_rig(options=ShadowOptions(router="shadow", router_min_tokens=1))
    c, reader = rig.conductor, rig.reader
    reader.feed("r", prompt_ids(5 * GRID + 9))
    position = 2 * GRID + 5  # where a turn inserted its router question
    c.router.pending["r"] = [PendingQuestion("q1", position, None, 0, c.clock())]
    answer = await c.ask("r", "Yes or no?", ["A", "B"])
    assert reader.get("r").committed == 5 * GRID and answer.read_tokens == 5 * GRID
    assert not c.router.pending.get("r") and c.router.counts.answered == 1
    journal = (tmp_path / "shadow" / "shadow.jsonl").read_text().splitlines()
    assert len(journal) == 1 and json.loads(journal[0])["position"] == position
