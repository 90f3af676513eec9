"""The SSE stream's keep-alive: a stream with nothing to send for QSE_SSE_KEEPALIVE_S gets a `: keep-alive` comment
(a proxy's idle timeout would cut it, e.g. while a long prompt is read before the first token), and the stream
still ends as before: every data frame, then `data: [DONE]`; a client that leaves still ends the turn.

Over raw ASGI, so that the test sees each body as it is sent. The event sources wait on an asyncio.Event the
test sets once it has seen the comment: the order is the test's, never a clock's (the interval is tiny only so
that the comment comes soon)."""

from __future__ import annotations

import asyncio
import json

import pytest

from qse.server.app import create_app
from qse.server.profiles import Profile, ShadowBlock
from qse.server.service import Service
from qse.server.sse import DONE, KEEPALIVE, EventStream, frame
from qse.settings import SettingError
from test_app import ScriptedConductor, body, settings_for, sse_events

TINY_S = 0.01


class Client:
    """One streaming response over raw ASGI: its bodies as sent; `on_body` sees each; `leave` disconnects it."""

    def __init__(self, request_body: bytes = b"", on_body=None):
        self.request_body = request_body
        self.on_body = on_body or (lambda body: None)
        self.leave = asyncio.Event()
        self.status: int | None = None
        self.bodies: list[bytes] = []
        self.scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                      "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                      "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
                      "client": ("127.0.0.1", 1), "server": ("test", 80)}
        self._sent = False

    async def receive(self):
        if not self._sent:
            self._sent = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.bodies.append(message.get("body", b""))
            self.on_body(message.get("body", b""))

    async def run(self, app) -> None:
        await app(self.scope, self.receive, self.send)


async def test_an_idle_stream_gets_a_keep_alive_comment_before_the_next_frame():
    gate = asyncio.Event()

    async def events():
        yield {"n": 1}
        await gate.wait()  # idle until the test has seen a keep-alive
        yield {"n": 2}

    client = Client(on_body=lambda b: gate.set() if b == KEEPALIVE else None)
    closed = []
    await client.run(EventStream(events(), on_close=lambda: closed.append(True), keepalive_s=TINY_S))
    bodies = client.bodies
    assert client.status == 200 and closed == [True]
    assert KEEPALIVE == b": keep-alive\n\n"
    # the comment came between the two frames; no frame is lost or doubled; [DONE] is still last
    assert bodies[0] == frame({"n": 1}) and KEEPALIVE in bodies[1:bodies.index(frame({"n": 2}))]
    assert [b for b in bodies if b != KEEPALIVE] == [frame({"n": 1}), frame({"n": 2}), DONE]
    assert bodies[-1] == DONE and "client_gone" not in client.scope.get("qse", {})


async def test_a_client_that_leaves_an_idle_stream_still_ends_its_turn():
    """The keep-alive beside the shielded pump: a client that leaves while the source waits calls on_gone once,
    the source is closed at its next event (never cancelled inside its await), and nothing more is sent."""
    gate, state = asyncio.Event(), {"closed": False, "gone": 0}

    async def events():
        try:
            yield {"n": 1}
            await gate.wait()
            yield {"n": 2}  # the turn's next event after it was told to end
            yield {"n": 3}
        finally:
            state["closed"] = True

    def gone():
        state["gone"] += 1
        gate.set()  # what admission.end does for a turn: it ends at its next step

    client = Client()
    client.on_body = lambda b: client.leave.set() if b == KEEPALIVE else None
    closed = []
    await client.run(EventStream(events(), on_gone=gone, on_close=lambda: closed.append(True), keepalive_s=TINY_S))
    data = [b for b in client.bodies if b != KEEPALIVE]
    assert data == [frame({"n": 1})]  # no frame after the client left, and no [DONE]
    assert state == {"closed": True, "gone": 1} and closed == [True]
    assert client.scope["qse"]["client_gone"] is True


def test_a_negative_interval_is_refused_naming_it():
    async def events():
        yield {}

    with pytest.raises(ValueError, match=r"keepalive_s=-1: expected seconds >= 0"):
        EventStream(events(), keepalive_s=-1)


def has_text(body: bytes) -> bool:
    """A chat chunk that carries output text (the first, the role's, carries none)."""
    if not body.startswith(b"data: {"):
        return False
    choices = json.loads(body[len(b"data: "):])["choices"]
    return any(c["delta"].get("content") or c["delta"].get("reasoning_content") for c in choices)


class GatedConductor(ScriptedConductor):
    """The scripted conductor, but its first id waits for `gate`: a long prompt read before the first token."""

    def __init__(self, ids: list[int]):
        super().__init__(ids)
        self.gate = asyncio.Event()

    async def generate(self, req):
        await self.gate.wait()
        async for token in super().generate(req):
            yield token


async def test_a_stream_waiting_for_its_first_token_gets_keep_alives_from_the_setting(tiny_engine, tmp_path):
    conductor = GatedConductor(tiny_engine.chat.tokenizer.encode("plan\n</think>\n\nalpha beta gamma"))
    service = Service(conductor, tiny_engine.chat, "scripted", Profile(shadow=ShadowBlock(mode="off")),
                      settings_for(tmp_path, QSE_SSE_KEEPALIVE_S=str(TINY_S)))
    await service.start()
    try:
        client = Client(json.dumps(body("scripted", stream=True, max_tokens=64)).encode(),
                        on_body=lambda b: conductor.gate.set() if b == KEEPALIVE else None)
        await client.run(create_app(service))
    finally:
        await service.stop()
    bodies = client.bodies
    first_token = next(i for i, b in enumerate(bodies) if has_text(b))
    assert KEEPALIVE in bodies[:first_token]  # sent while the turn had nothing to send
    events = sse_events(b"".join(b for b in bodies if b != KEEPALIVE))  # the rest parses as before, [DONE] last
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "alpha beta gamma"


def test_a_negative_setting_is_refused_when_the_app_is_built(tiny_engine, tmp_path):
    service = Service(ScriptedConductor([]), tiny_engine.chat, "scripted", Profile(shadow=ShadowBlock(mode="off")),
                      settings_for(tmp_path, QSE_SSE_KEEPALIVE_S="-2"))
    with pytest.raises(SettingError, match=r"QSE_SSE_KEEPALIVE_S=-2.0: expected seconds >= 0"):
        create_app(service)
