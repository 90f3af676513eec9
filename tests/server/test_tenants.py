"""Tenants: a session belongs to the tenant of the key that made it. Two tenants cannot see or touch each other's
sessions through any route (chat, completions, ask, summarize, status); prefix mapping never joins two tenants,
nor two conversations that share only a system prompt; admin sees every session; the keys never show.

In process (httpx.ASGITransport) over the embedded model, and once through a real `qse serve` with the openai
client."""

from __future__ import annotations

import json
import re
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from qse.cli import main
from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions
from qse.server.app import create_app
from qse.server.profiles import Profile
from qse.server.service import Service
from qse.server.tenants import Keyring, Tenant, read_keys_file
from qse.server.wire import SESSION_ID_MAX_CHARS
from qse.settings import EngineSettings, SettingError
from qse.shadow.reader import ShadowReader

KEYS = {"alice": "k-alice", "bob": "k-bob", "admin": "k-admin"}
SYSTEM = ("You are a careful coding agent. You work in a Python repository, you read files before you change "
          "them, you run the tests after every change and you explain what you did in one short paragraph. ") * 2


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    return path


def service_for(engine, tmp_path: Path, **env: str) -> Service:
    reader = ShadowReader(engine, grid=64, pool_bytes=16 << 20)
    conductor = Conductor(engine, reader, ShadowOptions(), Policy(idle_poll_s=0.05, journal_dir=None))
    settings = EngineSettings({"QSE_CACHE_DIR": str(tmp_path), "QSE_LEDGER": str(tmp_path / "usage.jsonl"), **env})
    return Service(conductor, engine.chat, engine.name, Profile(), settings,
                   max_context_tokens=engine.cfg.max_position_embeddings)


@asynccontextmanager
async def clients(service: Service):
    """One httpx client per tenant of KEYS, over one app."""
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service))
    made = {t: httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60,
                                 headers={"Authorization": f"Bearer {k}"}) for t, k in KEYS.items()}
    try:
        yield made
    finally:
        for c in made.values():
            await c.aclose()
        await service.stop()


def chat(model: str, messages: list[dict], **fields) -> dict:
    return {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}


def sessions(status: dict) -> dict[str, int]:
    return {s["session"]: s["known"] for s in status["sessions"]}


async def test_two_tenants_cannot_see_or_touch_each_others_sessions(tiny_engine, tmp_path):
    service = service_for(tiny_engine, tmp_path, QSE_API_KEYS_FILE=str(keys_file(tmp_path)))
    model = service.model_name
    async with clients(service) as c:
        long = [{"role": "user", "content": "Remember the number forty-two for later, please. " * 6}]
        r = await c["alice"].post("/v1/chat/completions", headers={"X-Session-Id": "s1"}, json=chat(model, long))
        assert r.status_code == 200 and r.headers["x-session-id"] == "s1"
        alice_known = r.json()["usage"]["total_tokens"]
        # bob's s1 is another session: it neither reads nor overwrites alice's (a short prompt would roll it back)
        r = await c["bob"].post("/v1/chat/completions", headers={"X-Session-Id": "s1"},
                                json=chat(model, [{"role": "user", "content": "hi"}]))
        assert r.status_code == 200 and r.headers["x-session-id"] == "s1"
        bob_known = r.json()["usage"]["total_tokens"]
        assert bob_known < alice_known

        alice = (await c["alice"].get("/v1/conductor/shadow/status")).json()
        bob = (await c["bob"].get("/v1/conductor/shadow/status")).json()
        assert sessions(alice) == {"s1": alice_known} and sessions(bob) == {"s1": bob_known}
        assert alice["running"] is False and bob["backlog"] == sum(s["backlog"] for s in bob["sessions"])
        admin = (await c["admin"].get("/v1/conductor/shadow/status")).json()
        assert sessions(admin) == {"alice/s1": alice_known, "bob/s1": bob_known}

        ask = {"question": "Is a number mentioned? A) yes B) no", "choices": ["A", "B"]}
        r = await c["bob"].post("/v1/conductor/shadow/ask", json={"session": "s1", **ask})
        assert r.status_code == 200 and r.json()["session"] == "s1" and r.json()["position"] > bob_known
        for route, body in (("ask", ask), ("summarize", {"max_tokens": 2})):
            # another tenant's id, however it is spelled, is not one of bob's
            for name in ("alice/s1", "../alice/s1", "/alice/s1"):
                r = await c["bob"].post(f"/v1/conductor/shadow/{route}", json={"session": name, **body})
                assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
                assert r.json()["error"]["message"].startswith(f"unknown session {name!r}")
        r = await c["admin"].post("/v1/conductor/shadow/ask", json={"session": "alice/s1", **ask})
        assert r.status_code == 200 and r.json()["session"] == "alice/s1" and r.json()["position"] > alice_known
        # an admin's own id without a slash is its own namespace
        r = await c["admin"].post("/v1/conductor/shadow/ask", json={"session": "s1", **ask})
        assert r.status_code == 404
        # bob's completions with alice's id spelled out land in bob's namespace too
        r = await c["bob"].post("/v1/completions", headers={"X-Session-Id": "alice/s1"},
                                json={"model": model, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-session-id"] == "alice/s1"
        admin = (await c["admin"].get("/v1/conductor/shadow/status")).json()
        assert sessions(admin)["alice/s1"] == alice_known and "bob/alice/s1" in sessions(admin)

        r = await c["alice"].get("/v1/models", headers={"Authorization": "Bearer k-nobody"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_prefix_mapping_stays_in_a_tenant_and_needs_more_than_a_shared_head(tiny_engine, tmp_path):
    service = service_for(tiny_engine, tmp_path, QSE_API_KEYS_FILE=str(keys_file(tmp_path)))
    model = service.model_name
    async with clients(service) as c:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the parser's empty input."}]
        r = await c["alice"].post("/v1/chat/completions", json=chat(model, first))
        sid = r.headers["x-session-id"]
        reasoning = r.json()["choices"][0]["message"]["reasoning_content"] or ""
        assert r.json()["usage"]["prompt_tokens"] > 64  # the shared system prompt alone is over one grid chunk

        # the same system prompt, another first question: another conversation
        other = [first[0], {"role": "user", "content": "Write a haiku about rivers instead."}]
        r = await c["alice"].post("/v1/chat/completions", json=chat(model, other))
        assert r.headers["x-session-id"] != sid
        # the conversation goes on, and a new user turn re-renders the history (the reasoning drops): still it
        follow = [*first, {"role": "assistant", "content": "Done.", "reasoning_content": reasoning},
                  {"role": "user", "content": "Now explain the fix in one sentence."}]
        r = await c["alice"].post("/v1/chat/completions", json=chat(model, follow))
        assert r.headers["x-session-id"] == sid
        # another tenant with the very same conversation never joins alice's session
        r = await c["bob"].post("/v1/chat/completions", json=chat(model, follow))
        bob_sid = r.headers["x-session-id"]
        assert "/" not in bob_sid
        admin = sessions((await c["admin"].get("/v1/conductor/shadow/status")).json())
        assert f"alice/{sid}" in admin and f"bob/{bob_sid}" in admin and len(admin) == 3
        # a raw prompt joins a session only by X-Session-Id, even when it continues one
        prompt = tiny_engine.chat.tokenizer.encode(tiny_engine.chat.render(follow))
        r = await c["alice"].post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})
        assert r.headers["x-session-id"] not in (sid, f"alice/{sid}")


async def test_one_limit_on_session_ids_everywhere(tiny_engine, tmp_path):
    service = service_for(tiny_engine, tmp_path)
    model = service.model_name
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                     base_url="http://test") as client:
            longest, over = "x" * SESSION_ID_MAX_CHARS, "x" * (SESSION_ID_MAX_CHARS + 1)
            prompt = {"model": model, "prompt": "hello", "max_tokens": 1}
            r = await client.post("/v1/completions", headers={"X-Session-Id": longest}, json=prompt)
            assert r.status_code == 200 and r.headers["x-session-id"] == longest
            ask = {"question": "A or B?", "choices": ["A", "B"]}
            assert (await client.post("/v1/conductor/shadow/ask", json={"session": longest, **ask})).status_code == 200
            for route in ("/v1/completions", "/v1/chat/completions"):
                body = prompt if route == "/v1/completions" else chat(model, [{"role": "user", "content": "hi"}])
                r = await client.post(route, headers={"X-Session-Id": over}, json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
                assert r.json()["error"]["param"] == "X-Session-Id" and str(SESSION_ID_MAX_CHARS) in r.text
            for route, body in (("ask", ask), ("summarize", {})):
                r = await client.post(f"/v1/conductor/shadow/{route}", json={"session": over, **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == "session"
                assert str(SESSION_ID_MAX_CHARS) in r.json()["error"]["message"]
    finally:
        await service.stop()


def test_keys_file_rules(tmp_path):
    path = keys_file(tmp_path)
    keys = read_keys_file(path)
    assert keys["k-alice"] == Tenant("alice") and keys["k-admin"].sees_all and not keys["k-bob"].sees_all
    ring = Keyring.from_settings(EngineSettings({"QSE_API_KEYS_FILE": str(path)}))
    assert ring.tenant(b"k-bob") == Tenant("bob") and ring.tenant(b"k-bo") is None
    bad = [("alice k1 extra\n", "expected 'TENANT KEY' (two fields), got 3"),
           ("al/ice k1\n", "tenant 'al/ice' is not a valid name"),
           ("alice k1\nbob k1\n", "this key is already given to tenant 'alice'"),
           ("# nothing\n", "no 'TENANT KEY' line")]
    for text, message in bad:
        path.write_text(text)
        with pytest.raises(SettingError, match=re.escape(message)) as info:
            read_keys_file(path)
        assert "k1" not in str(info.value)  # an error never shows a key
    with pytest.raises(SettingError, match="QSE_API_KEY and QSE_API_KEYS_FILE are both set"):
        Keyring.from_settings(EngineSettings({"QSE_API_KEY": "k", "QSE_API_KEYS_FILE": str(path)}))
    alice = Tenant("alice")
    assert alice.key("a/b") == "alice/a/b" and alice.shown(alice.key("a/b")) == "a/b"
    assert Tenant("admin").key("alice/x") == "alice/x" and Tenant("admin").key("x") == "admin/x"
    assert Tenant("").key("x") == "x" and not alice.owns("bob/x") and alice.owns("alice/x")


def test_settings_command_masks_the_key(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("QSE_API_KEY", "sk-very-secret")
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "sk-very-secret" not in out
    rows = {r["name"]: r for r in json.loads(out)["settings"]}
    assert rows["QSE_API_KEY"]["value"] == "(set)"
    monkeypatch.delenv("QSE_API_KEY")
    monkeypatch.setenv("QSE_API_KEYS_FILE", str(keys_file(tmp_path)))
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert not any(k in out for k in KEYS.values())


def absolute_paths(obj):
    """Every string in a JSON value that names an absolute path."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from absolute_paths(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from absolute_paths(v)
    elif isinstance(obj, str) and (obj.startswith("/") or obj[1:3] == ":\\"):
        yield obj


def test_tenants_through_a_real_server(launcher, tmp_path):
    """The openai client against `qse serve` with a keys file: each tenant's own session, its own status."""
    openai = pytest.importorskip("openai")
    srv = launcher.start(tmp_path, ["--profile", "default"], QSE_API_KEY="",
                         QSE_API_KEYS_FILE=str(keys_file(tmp_path)))
    made = {t: openai.OpenAI(base_url=srv.url + "/v1", api_key=k, max_retries=0, timeout=60) for t, k in KEYS.items()}
    try:
        lengths = {}
        for tenant, words in (("alice", 24), ("bob", 2)):
            raw = made[tenant].chat.completions.with_raw_response.create(
                model=srv.model, messages=[{"role": "user", "content": "word " * words}], max_tokens=2,
                temperature=0, extra_headers={"X-Session-Id": "shared-name"})
            assert raw.headers["x-session-id"] == "shared-name"
            lengths[tenant] = raw.parse().usage.total_tokens
        for tenant in ("alice", "bob"):
            status = httpx.get(srv.url + "/v1/conductor/shadow/status",
                               headers={"Authorization": f"Bearer {KEYS[tenant]}"}).json()
            assert sessions(status) == {"shared-name": lengths[tenant]}
        status = httpx.get(srv.url + "/v1/conductor/shadow/status",
                           headers={"Authorization": f"Bearer {KEYS['admin']}"}).json()
        assert sessions(status) == {f"{t}/shared-name": n for t, n in lengths.items()}
        assert status["store"]["disk"] is True and not list(absolute_paths(status))  # the disk tier is on
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError):
                stranger.models.list()
    finally:
        for client in made.values():
            client.close()
        launcher.stop(srv)
    assert not any(k in srv.log_path.read_text() for k in KEYS.values())


def test_the_status_shows_a_tenant_only_its_own_narrations():
    """The live narrator's recent summaries carry a session, a request id and the thought's summary: a tenant
    sees only its own, under its own ids; admin sees every one."""
    from qse.server.service import tenant_view

    def entry(session, request, text):
        return {"session_id": session, "request_id": request, "text": text, "tokens": 3, "position": 64,
                "gpu_ms": 1.0, "live": True}

    status = {"sessions": [], "narrations": {}, "running": True,
              "narrator": {"following": 0, "live": 2, "missed": 0, "summary_est_ms": 1.0,
                           "recent": [entry("alice/s1", "req-a", "alice's plan"), entry("bob/s2", "req-b", "bob's")]}}
    alice = tenant_view(status, Tenant("alice"))["narrator"]
    assert alice["recent"] == [entry("s1", "req-a", "alice's plan")]
    assert alice["live"] == 2 and status["narrator"]["recent"][1]["session_id"] == "bob/s2"  # the status is kept
    assert [n["session_id"] for n in tenant_view(status, Tenant("admin"))["narrator"]["recent"]] == ["alice/s1",
                                                                                                  "bob/s2"]
