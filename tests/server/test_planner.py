"""The residency planner through `qse serve`'s wiring (build_service) and the app, on the embedded model: the
reader loads in the first idle window after the server answered, a claim that does not fit is refused by
name, a release and a load give the same answers, and roles on one model share one copy of the weights."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest

from qse.core.locks import HeldLocks, Priority
from qse.server.app import create_app
from qse.server.cli import build_service
from qse.settings import EngineSettings


def _settings(cache_dir, tmp_path, **env):
    return EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
                           "QSE_SERVED_KV_GB": "0.05", "QSE_SERVED_CACHE_GB": "0.05", "QSE_SHADOW_IDLE_POLL_S": "0.01",
                           "QSE_LEDGER": str(tmp_path / "usage.jsonl"), "QSE_HOST_CACHE_GB": "0", **env})


@asynccontextmanager
async def serving(service):
    await service.start()
    app = create_app(service)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            yield client
    finally:
        await service.stop()


def chat(session: str, content: str = "Tell me about grid chunks and their checkpoints, please.") -> tuple:
    return ({"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0},
            {"x-session-id": session})


async def caught_up(service) -> None:
    """Idle windows until the reader has no whole chunk left (no sleeping: when the conductor's own idle loop
    has the engine, wait for it behind the lock)."""
    conductor = service.conductor
    reader = conductor.reader
    while any(s.backlog >= reader.grid for s in reader.sessions.values()):
        if await conductor.idle_once() == 0:
            async with conductor.board.engine_lock(Priority.QUESTION):
                pass


async def test_the_reader_loads_after_the_server_answered_its_first_request(cache_dir, tmp_path):
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                            settings=_settings(cache_dir, tmp_path), reader_load="idle")
    hold = AsyncExitStack()  # the idle window stays shut until the first answer is in
    await hold.enter_async_context(service.conductor.board.hold(HeldLocks()))
    async with serving(service) as client:
        body, headers = chat("first")
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] is not None
        roles = (await client.get("/v1/conductor/shadow/status")).json()["residency"]["roles"]
        assert roles["reader"]["state"] == "planned" and roles["served"]["state"] == "loaded"
        assert service.conductor.reader is None
        r = await client.post("/v1/conductor/shadow/ask", json={"session": "first", "question": "A or B?",
                                                                "choices": ["A", "B"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "shadow_not_loaded"
        task = service.planner.idle_load
        await hold.aclose()  # the first idle window opens
        await task
        status = (await client.get("/v1/conductor/shadow/status")).json()
        assert status["residency"]["roles"]["reader"]["state"] == "loaded"
        # the session served before the reader loaded is known to it, and read in the idle windows
        assert "first" in {s["session"] for s in status["sessions"]}
        await caught_up(service)
        r = await client.post("/v1/conductor/shadow/ask", json={"session": "first", "question": "A or B?",
                                                                "choices": ["A", "B"]})
        assert r.status_code == 200 and set(r.json()["distribution"]) == {"A", "B"}


async def test_a_claim_that_does_not_fit_is_refused_naming_the_role_its_claim_and_the_free_memory(cache_dir,
                                                                                               tmp_path):
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32", reader_load="idle",
                            settings=_settings(cache_dir, tmp_path, QSE_DEVICE_MEMORY_GB="0.05"))
    async with board_held(service):
        async with serving(service) as client:
            r = await client.post("/v1/conductor/shadow/reader", json={"action": "load"})
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "insufficient_memory"
            assert err["message"].startswith("the reader's claim (weights 0.")  # shared: the served weights
            assert "kv_pool 0.02 GiB + session_cache 0.02 GiB" in err["message"]
            assert "but cpu has 0.05 GiB free" in err["message"]
            roles = (await client.get("/v1/conductor/shadow/status")).json()["residency"]["roles"]
            assert roles["reader"]["state"] == "refused" and roles["reader"]["verdict"] == err["message"]
            assert service.conductor.reader is None
    with pytest.raises(Exception, match=r"the reader's claim .* needs .* but cpu has 0\.05 GiB free"):
        build_service(profile="coding", grid=64, device="cpu", dtype="float32", reader_load="start",
                      settings=_settings(cache_dir, tmp_path, QSE_DEVICE_MEMORY_GB="0.05"))


@asynccontextmanager
async def board_held(service):
    async with service.conductor.board.hold(HeldLocks()):  # no idle-window load: only the route's
        yield


async def test_release_then_load_gives_the_same_answers_and_the_weights_stay_one_copy(cache_dir, tmp_path):
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                            settings=_settings(cache_dir, tmp_path), reader_load="start")
    conductor = service.conductor
    first = service.planner.reader
    assert first.engine is conductor.served and first.engine.model is conductor.served.model  # one copy
    content = "Explain how a grid chunk is read and kept, and what a checkpoint holds. " * 6
    async with serving(service) as client:
        body, headers = chat("keep", content)
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        # at the prompt's end: what the served sessions hold (a reader loaded later learns their prompts; the
        # answer's ids come to it with the session's next prompt)
        ask = {"session": "keep", "question": "Is this about data structures?", "choices": ["A", "B", "C"],
               "at": r.json()["usage"]["prompt_tokens"]}
        await caught_up(service)
        before = (await client.post("/v1/conductor/shadow/ask", json=ask)).json()
        status = (await client.get("/v1/conductor/shadow/status")).json()["residency"]
        assert status["roles"]["reader"]["shares_weights_with"] == "served"
        assert status["roles"]["reader"]["model"] == status["roles"]["served"]["model"]

        r = await client.post("/v1/conductor/shadow/reader", json={"action": "release"})
        assert r.status_code == 200 and r.json()["residency"]["roles"]["reader"]["state"] == "released"
        assert conductor.reader is None and service.store is None
        assert (await client.post("/v1/conductor/shadow/ask", json=ask)).json()["error"]["code"] == \
            "shadow_not_loaded"
        body, headers = chat("other")
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200

        r = await client.post("/v1/conductor/shadow/reader", json={"action": "load"})
        assert r.status_code == 200, r.text
        assert conductor.reader is not first and conductor.reader.engine is conductor.served
        assert service.store is conductor.reader.residency
        r = await client.post("/v1/conductor/shadow/reader", json={"action": "load"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "already_loaded"
        await caught_up(service)
        after = (await client.post("/v1/conductor/shadow/ask", json=ask)).json()
    assert after["distribution"] == before["distribution"] and after["position"] == before["position"]
    assert after["label"] == before["label"]


async def test_only_the_admin_loads_and_releases_and_a_bad_action_is_named(cache_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice\nadmin sk-admin\n")
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32", reader_load="start",
                            settings=_settings(cache_dir, tmp_path, QSE_API_KEYS_FILE=str(keys)))
    async with serving(service) as client:
        r = await client.post("/v1/conductor/shadow/reader", json={"action": "release"},
                              headers={"Authorization": "Bearer sk-alice"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        r = await client.post("/v1/conductor/shadow/reader", json={"action": "unload"},
                              headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 400 and "action" in r.json()["error"]["message"]
        assert service.conductor.reader is not None
        r = await client.post("/v1/conductor/shadow/reader", json={"action": "release"},
                              headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 200
        r = await client.post("/v1/conductor/shadow/reader", json={"action": "release"},
                              headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_loaded"


def test_a_claims_weights_before_the_load_are_what_the_load_holds(cache_dir, tiny_engine):
    """The reader's claim is admitted before its weights load: the checkpoint's headers (and a preset's shapes)
    give the bytes the loaded weights then hold."""
    import torch

    from qse.server.cli import _weights_estimate

    assert _weights_estimate("", torch.float32, cache_dir) == tiny_engine.model.weights_nbytes()
    assert _weights_estimate("no-such-preset-or-dir", torch.float32, cache_dir) is None


async def test_a_release_writes_the_readers_files_with_the_engine_serving(cache_dir, tmp_path, held_writes):
    """Only the copies off the device happen under the engine: while the released reader's files are being
    written (the mover held), a served request runs to its end; then the files land and a reader loaded again
    answers as before, from them."""
    import asyncio

    disk = tmp_path / "disk"
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32", reader_load="start",
                            settings=_settings(cache_dir, tmp_path, QSE_SHADOW_DISK=str(disk)))
    content = "Explain how a grid chunk is read and kept, and what a checkpoint holds. " * 6
    async with serving(service) as client:
        body, headers = chat("keep", content)
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        ask = {"session": "keep", "question": "Is this about data structures?", "choices": ["A", "B", "C"],
               "at": r.json()["usage"]["prompt_tokens"]}
        await caught_up(service)
        before = (await client.post("/v1/conductor/shadow/ask", json=ask)).json()

        release = asyncio.create_task(client.post("/v1/conductor/shadow/reader", json={"action": "release"}))
        try:
            assert await asyncio.to_thread(held_writes["started"].wait, 60)  # a file write waits on the mover
            body, headers = chat("meanwhile")
            served = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=headers))
            # (a release that wrote under the engine would hold this request until the writes land: never here)
            await asyncio.wait({served}, timeout=120)
            assert served.done() and served.result().status_code == 200, "the request waited for the writes"
            assert not release.done()  # served while the release's writes are held
        finally:
            held_writes["release"].set()  # (also when it failed: the server can then stop)
        r = await release
        assert r.status_code == 200, r.text
        assert sorted(p.name for p in disk.glob("*.safetensors")), "the reader's session was written"

        r = await client.post("/v1/conductor/shadow/reader", json={"action": "load"})
        assert r.status_code == 200, r.text
        await caught_up(service)
        after = (await client.post("/v1/conductor/shadow/ask", json=ask)).json()
    assert after["distribution"] == before["distribution"] and after["position"] == before["position"]
    assert service.store.counts.restores >= 1  # the session came back from its file, not read again
