"""A prompt a turn cannot hold is a 400 in the OpenAI shape that says how large a prompt this server takes; a
question's `behind` choice reaches the reader, and a bad one is a 400."""

from __future__ import annotations

from test_app import body, real_service, serving, settings_for

from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions
from qse.server.profiles import Profile, ShadowBlock
from qse.server.service import Service
from qse.shadow.reader import ShadowReader


def small_pool_service(engine, tmp_path, pages: int = 4, grid: int = 64) -> Service:
    """A server whose served KV pool holds `pages` pages of `grid` rows."""
    page_bytes = grid * engine.state_bytes_per_token()
    reader = ShadowReader(engine, grid=grid, pool_bytes=16 << 20)
    conductor = Conductor(engine, reader, ShadowOptions(), Policy(
        idle_poll_s=0.05, journal_dir=tmp_path / "shadow", served_grid=grid, served_kv_gb=pages * page_bytes / (1 << 30)))
    return Service(conductor, engine.chat, engine.name, Profile(shadow=ShadowBlock()), settings_for(tmp_path),
                   max_context_tokens=engine.cfg.max_position_embeddings)


async def test_a_prompt_past_the_kv_pool_is_a_400_naming_what_fits(tiny_engine, tmp_path):
    service = small_pool_service(tiny_engine, tmp_path)
    takes = 3 * 64  # four pages, less the one a turn may hold above its rows
    assert service.turn_capacity()[0] == takes
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", json=body(service.model_name, "word " * 400, max_tokens=8))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "context_length_exceeded"
        assert f"over the {takes} tokens a turn can hold" in error["message"] and "QSE_SERVED_KV_GB" in error["message"]
        r = await client.post("/v1/chat/completions", json=body(service.model_name, "Hi", max_tokens=2))
        assert r.status_code == 200  # the server still answers


async def test_behind_reaches_the_reader_and_a_bad_value_is_a_400(tiny_engine, tmp_path):
    service = real_service(tiny_engine, tmp_path)
    async with serving(service) as client:
        r = await client.post("/v1/chat/completions", headers={"X-Session-Id": "b"},
                              json=body(service.model_name, max_tokens=2))
        assert r.status_code == 200
        ask = {"session": "b", "question": "Is this a greeting?", "choices": ["A", "B"]}
        r = await client.post("/v1/conductor/shadow/ask", json={**ask, "behind": "answer_now"})
        assert r.status_code == 200, r.text
        assert r.json()["read_tokens"] == 0 and r.json()["behind"] >= 0
        r = await client.post("/v1/conductor/shadow/ask", json={**ask, "behind": "later"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "behind", r.text
        r = await client.post("/v1/conductor/shadow/summarize", json={"session": "b", "max_tokens": 2,
                                                                      "behind": "answer_now"})
        assert r.status_code == 200 and r.json()["read_tokens"] == 0
