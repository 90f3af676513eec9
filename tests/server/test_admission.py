"""Admission and early ends: 429 with Retry-After past QSE_MAX_RUNNING + QSE_MAX_WAITING; a client that leaves,
streaming or not, ends its turn at the next decode step (or leaves the queue) and the next request runs; a
drain ends the turns in flight cleanly (a stream: an error event and [DONE]; an answer: a JSON 503) with the
finish reason recorded; /health says 503 "stopping" meanwhile.

In process: the app called directly over ASGI, so that a test chooses when its client leaves. Tasks are ordered
by waiting for the state they reach (the admission's counts, the conductor's running turn), never by time."""

from __future__ import annotations

import asyncio
import json

import httpx
import structlog

from qse.policy import Policy
from qse.runtime.conductor import Conductor, ShadowOptions
from qse.server.admission import Admission
from qse.server.app import create_app
from qse.server.errors import ApiError
from qse.server.profiles import Profile, ShadowBlock
from qse.server.service import Service
from qse.settings import EngineSettings

MODEL_ENV = {"QSE_MAX_OUTPUT_TOKENS": "100000"}


def make_service(engine, tmp_path, **env: str) -> Service:
    conductor = Conductor(engine, None, ShadowOptions(mode="off"), Policy(journal_dir=None))
    settings = EngineSettings({"QSE_CACHE_DIR": str(tmp_path), "QSE_LEDGER": str(tmp_path / "usage.jsonl"),
                               **MODEL_ENV, **env})
    return Service(conductor, engine.chat, engine.name, Profile(shadow=ShadowBlock(mode="off")), settings,
                   max_context_tokens=engine.cfg.max_position_embeddings)


async def until(condition) -> None:
    """Let the other tasks run until `condition()` holds. What it waits for may be a forward on the engine's
    thread, which takes as long as a loaded machine makes it: no count or clock bounds the wait (a hang is
    pytest-timeout's), only the polling backs off from the loop's turns to short sleeps."""
    spins = 0
    while not condition():
        spins += 1
        await asyncio.sleep(0 if spins < 1000 else 0.005)


class Call:
    """One request driven over raw ASGI: the test decides when its client leaves."""

    live: list["Call"] = []  # every call of the running test (leave_all ends them)

    def __init__(self, app, path: str, body: dict, request_id: str | None = None):
        self.app, self.path, self.body = app, path, body
        self.request_id = request_id
        self.leave = asyncio.Event()
        Call.live.append(self)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": json.dumps(self.body).encode(), "more_body": False}
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                self.chunks.append(message.get("body", b""))

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("test", 80)}
        if self.request_id is not None:
            scope["headers"].append((b"x-request-id", self.request_id.encode()))
        await self.app(scope, receive, send)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()

    @classmethod
    def leave_all(cls) -> None:
        """Every client leaves: a test that failed half-way ends its long turns, so that the service's stop
        (which lets the turns in flight finish) does not wait on 50,000 tokens nobody reads."""
        for call in cls.live:
            call.leave.set()
        cls.live.clear()


def chat(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me a long story about a river."}]}


def finished(service: Service) -> dict[str, float]:
    text = service.metrics.exposition().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("qse_turns_finished_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


async def test_past_the_queue_is_a_429_with_retry_after(tiny_engine, tmp_path):
    service = make_service(tiny_engine, tmp_path, QSE_MAX_RUNNING="1", QSE_MAX_WAITING="1")
    await service.start()
    app = create_app(service)
    try:
        running = Call(app, "/v1/chat/completions", chat(service.model_name, 5000))
        await until(lambda: service.admission.num_running == 1 and service.conductor.status()["running"])
        waiting = Call(app, "/v1/completions", {"model": service.model_name, "prompt": "x", "max_tokens": 2})
        await until(lambda: service.admission.num_waiting == 1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/v1/chat/completions", json=chat(service.model_name, 2))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "server_busy"
            # the prior turn time (5 s) times the two turns that end before this one would run
            assert r.headers["retry-after"] == "10"
            assert error["message"] == ("the server is busy: 1 running and 1 waiting, the 2 it admits at once "
                                        "(QSE_MAX_RUNNING=1 + QSE_MAX_WAITING=1); retry after 10 s")
            running.leave.set()  # the running client leaves: the waiting one runs
            await waiting.task
            assert waiting.status == 200 and json.loads(waiting.text)["usage"]["completion_tokens"] == 2
            await running.task
            assert service.admission.live == {} and service.admission.num_running == 0
            assert (await client.post("/v1/chat/completions", json=chat(service.model_name, 1))).status_code == 200
        assert finished(service).get("abort") == 1.0
    finally:
        Call.leave_all()
        await service.stop()


async def test_a_client_that_leaves_frees_the_engine_streaming_or_not(tiny_engine, tmp_path):
    service = make_service(tiny_engine, tmp_path, QSE_MAX_RUNNING="1")
    records = []
    on_turn = service.conductor.on_turn
    service.conductor.on_turn = lambda r: (records.append(r), on_turn(r))
    await service.start()
    app = create_app(service)
    try:
        for stream in (False, True):
            leaver = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000, stream))
            await until(lambda: service.conductor.status()["running"])
            nxt = Call(app, "/v1/completions", {"model": service.model_name, "prompt": "next", "max_tokens": 2})
            await until(lambda: service.admission.num_waiting == 1)
            leaver.leave.set()
            await asyncio.gather(nxt.task, leaver.task)
            assert nxt.status == 200 and json.loads(nxt.text)["choices"][0]["finish_reason"] == "length"
            cut = records[-2]
            assert 0 < cut.output_tokens < 50_000  # ended at a decode step, long before its max_tokens
        assert finished(service) == {"abort": 2.0, "length": 2.0}
        # a client that leaves while it waits for its slot never reaches the engine
        first = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000))
        await until(lambda: service.conductor.status()["running"])
        queued = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000))
        await until(lambda: service.admission.num_waiting == 1)
        turns = len(records)
        queued.leave.set()
        await queued.task
        assert service.admission.num_waiting == 0 and len(service.admission.live) == 1
        first.leave.set()
        await first.task
        assert len(records) == turns + 1  # only the first one's turn
    finally:
        Call.leave_all()
        await service.stop()


async def test_a_drain_ends_turns_cleanly_and_health_says_stopping(tiny_engine, tmp_path):
    service = make_service(tiny_engine, tmp_path, QSE_MAX_RUNNING="1", QSE_MAX_WAITING="4")
    await service.start()
    app = create_app(service)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.get("/health")).json()["status"] == "ok"
            streamed = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000, stream=True))
            await until(lambda: service.conductor.status()["running"])
            answer = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000))
            await until(lambda: service.admission.num_waiting == 1)
            drain = asyncio.get_running_loop().create_task(service.drain(grace_s=0.0))
            await until(lambda: service.is_draining)
            for path in ("/health", "/healthz"):
                r = await client.get(path)
                assert r.status_code == 503 and r.json()["status"] == "stopping"
            r = await client.post("/v1/chat/completions", json=chat(service.model_name, 1))
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_stopping"
            await asyncio.gather(drain, streamed.task, answer.task)
        frames = [f for f in streamed.text.split("\n\n") if f]
        assert streamed.status == 200 and frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2][len("data: "):])["error"]
        assert error["code"] == "server_stopping" and set(error) == {"message", "type", "param", "code"}
        assert answer.status == 503 and json.loads(answer.text)["error"]["code"] == "server_stopping"
        assert finished(service) == {"shutdown": 1.0}  # the waiting one never ran a turn
    finally:
        Call.leave_all()
        await service.stop()


class _Opens:
    """A served session whose size, once read, has the engine's thread open another session: what a turn's
    prefill does on the served thread while the event loop sums the sessions for status()."""

    is_resident = True

    def __init__(self, sessions: dict):
        self.sessions = sessions

    @property
    def nbytes(self) -> int:
        self.sessions["opened-meanwhile"] = _Opened()
        return 7


class _Opened:
    is_resident = True
    nbytes = 1000


async def test_status_reads_the_sessions_while_the_engine_thread_opens_one(tiny_engine):
    """The hang once seen in CI: `until(status()["running"])` summed the served sessions while the served
    thread's prefill added one ("dictionary changed size during iteration"); the test failed with its
    long turn running, and the stop in its `finally` waited on it. status() reads the snapshot the served
    thread publishes (GridSessions.publish), never the live dict: a session added behind its back is not read."""
    conductor = Conductor(tiny_engine, None, ShadowOptions(mode="off"), Policy(journal_dir=None))
    sessions = conductor.serving.book.sessions
    try:
        sessions["sums"] = _Opens(sessions)
        cache = conductor.status()["served_cache"]
        assert (cache["sessions"], cache["resident_sessions"], cache["resident_bytes"]) == (0, 0, 0)
        assert set(sessions) == {"sums"}  # its nbytes (which opens another) was never read
    finally:
        sessions.clear()
        await conductor.stop()


async def test_the_429_counts_every_admitted_request_as_running_or_waiting():
    """The limit counts every admitted request: one whose prompt is still being read (not yet in the queue)
    waits too. The message once counted only the queue ("2 run and 1 wait" of a limit of 4)."""
    admission = Admission(max_running=2, max_waiting=2, turn_s_prior=5.0)
    first, second = admission.admit("a"), admission.admit("b")
    await admission.start(first)
    await admission.start(second)
    queued = admission.admit("c")
    waiter = asyncio.get_running_loop().create_task(admission.start(queued))
    await until(lambda: admission.num_waiting == 1)
    admission.admit("d")  # admitted, its prompt not yet read: neither running nor queued
    try:
        admission.admit("e")
        raise AssertionError("a fifth request was admitted past QSE_MAX_RUNNING + QSE_MAX_WAITING = 4")
    except ApiError as exc:
        busy = exc
    # 5 s a turn, three turns to end before it would run (c's and d's), over two slots: ceil(7.5)
    assert busy.status == 429 and busy.headers == {"retry-after": "8"}
    assert busy.message == ("the server is busy: 2 running and 2 waiting, the 4 it admits at once "
                            "(QSE_MAX_RUNNING=2 + QSE_MAX_WAITING=2); retry after 8 s")
    admission.release(first)  # the queued one runs; one place is free
    await waiter
    assert (admission.num_running, admission.num_waiting, len(admission.live)) == (2, 0, 3)
    assert admission.admit("e").request_id == "e"


def request_events(logs: list[dict]) -> dict[str, dict]:
    return {e["request_id"]: e for e in logs if e["event"] == "request"}


async def test_the_request_event_says_abort_for_a_client_that_left(tiny_engine, tmp_path):
    """A client that leaves mid-stream, or before its answer is done: the request event's outcome and finish
    reason are "abort"; a stream read to its end is "ok" with the turn's own finish reason."""
    service = make_service(tiny_engine, tmp_path, QSE_MAX_RUNNING="1")
    await service.start()
    app = create_app(service)
    try:
        with structlog.testing.capture_logs() as logs:
            streamed = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000, stream=True), "left-stream")
            await until(lambda: streamed.text.count("data: ") >= 2)  # mid-stream: the role's chunk, then text
            streamed.leave.set()
            await streamed.task
            answer = Call(app, "/v1/chat/completions", chat(service.model_name, 50_000), "left-answer")
            await until(lambda: service.conductor.status()["running"])
            answer.leave.set()
            await answer.task
            whole = Call(app, "/v1/chat/completions", chat(service.model_name, 2, stream=True), "read-all")
            await whole.task
        events = request_events(logs)
        left = events["left-stream"]
        assert (left["outcome"], left["finish_reason"], left["client_gone"]) == ("abort", "abort", True)
        assert left["status"] == 200 and "output_tokens" not in left  # the turn's own event counts them
        assert "data: [DONE]" not in streamed.text
        assert (events["left-answer"]["outcome"], events["left-answer"]["finish_reason"]) == ("abort", "abort")
        read = events["read-all"]
        assert (read["outcome"], read["finish_reason"], read["output_tokens"]) == ("ok", "length", 2)
        assert "client_gone" not in read and whole.text.endswith("data: [DONE]\n\n")
    finally:
        Call.leave_all()
        await service.stop()
