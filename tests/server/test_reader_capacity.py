"""A session longer than the reader's KV pool, over HTTP: asking on it is a 400 that names the session, the rows
and the switch that sizes the pool (not a 500, not a reset), and the reader is not left retrying it."""

from __future__ import annotations

from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions
from qse.server.profiles import Profile, ShadowBlock
from qse.server.service import Service
from qse.shadow.reader import ShadowReader

from test_app import serving, settings_for

GRID = 64


def _small_reader_service(engine, tmp_path, pages: int) -> Service:
    page_nbytes = ShadowReader(engine, grid=GRID, pool_bytes=1 << 20).pool.page_nbytes
    reader = ShadowReader(engine, grid=GRID, pool_bytes=pages * page_nbytes)
    conductor = Conductor(engine, reader, ShadowOptions("on"), Policy(idle_poll_s=3600.0, journal_dir=tmp_path / "shadow"))
    return Service(conductor, engine.chat, engine.name, Profile(shadow=ShadowBlock()), settings_for(tmp_path),
                   max_context_tokens=engine.cfg.max_position_embeddings)


async def test_asking_on_a_session_longer_than_the_reader_pool_is_a_400_naming_it(tiny_engine, tmp_path):
    service = _small_reader_service(tiny_engine, tmp_path, pages=4)
    max_rows = service.conductor.reader.max_rows
    words = " ".join(f"word{i}" for i in range(2 * max_rows))
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", headers={"x-session-id": "big"},
                              json={"model": tiny_engine.name, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": words}]})
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert prompt_tokens > max_rows
        r = await client.post("/v1/conductor/shadow/ask",
                              json={"session": "big", "question": "Which?", "choices": ["A", "B"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("session_too_long", "session")
        assert "'big'" in err["message"] and str(max_rows) in err["message"] and "QSE_SHADOW_GB" in err["message"]
        r = await client.post("/v1/conductor/shadow/summarize", json={"session": "big"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "session_too_long"
        status = (await client.get("/v1/conductor/shadow/status")).json()
        big = next(s for s in status["sessions"] if s["session"] == "big")
        assert big["too_long"] and big["backlog"] == 0
        assert not service.conductor._idle_has_work()  # nothing for the idle window to try again
