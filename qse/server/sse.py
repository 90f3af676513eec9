"""Server-sent events: `data: <json>\\n\\n` frames, `data: [DONE]` last, and a client that leaves stops the turn.

The event source is closed (`aclose`) however the response ends (done, client gone, error), so the
conductor's turn always releases the engine lock and feeds the reader what was generated. A stream with
nothing to send for `keepalive_s` (a long prompt read before the first token, a wait for a slot) gets an SSE
comment line, which clients skip, so that a proxy's idle timeout does not cut it.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import anyio
import structlog

from . import wire
from .errors import ApiError, internal_error

log = structlog.get_logger("qse.server")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # a comment line: SSE clients skip it


def frame(obj: Any) -> bytes:
    return b"data: " + wire.encode(obj) + b"\n\n"


class EventStream:
    """An ASGI response that sends each object of `events` as one SSE frame."""

    def __init__(self, events: AsyncIterator[Any], headers: dict[str, str] | None = None,
                 on_gone: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None,
                 keepalive_s: float = 0.0):
        """on_gone: called once the client left before the end (a turn still waiting for its slot leaves the
        queue at once); on_close: called when the response is over, however it ended; keepalive_s: the
        longest the stream stays silent before a keep-alive comment (0: never one)."""
        if keepalive_s < 0:
            raise ValueError(f"keepalive_s={keepalive_s}: expected seconds >= 0 (0: no keep-alive)")
        self.events = events
        self.on_gone = on_gone
        self.on_close = on_close
        self.keepalive_s = keepalive_s
        self.headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})
            # one lock over every body send: a keep-alive never lands inside a send of the pump, nor after the
            # last one (asyncio's: taken free, it does not yield, so a frame costs no extra loop turn)
            state = {"gone": False, "done": False, "lock": asyncio.Lock(), "last_s": anyio.current_time()}
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, state, self.on_gone)
                if self.keepalive_s > 0:
                    tg.start_soon(_keep_alive, send, state, self.keepalive_s)
                # Shielded: the turn is never cancelled inside an await (the conductor must get to release
                # the engine lock and feed the reader); a client that left stops it at the next event.
                with anyio.CancelScope(shield=True):
                    await self._pump(scope, send, state)
                tg.cancel_scope.cancel()
            if state["gone"]:
                scope.setdefault("qse", {})["client_gone"] = True
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _pump(self, scope, send, state: dict) -> None:
        try:
            async with aclosing(self.events) as events:
                async for obj in events:
                    if state["gone"]:
                        return
                    await _send_body(send, state, frame(obj))
        except ApiError as exc:  # the headers are out: the error goes as the last event
            scope.setdefault("qse", {})["stream_error"] = exc.code or exc.type
            await _send_body(send, state, frame(exc.body()))
        except Exception as exc:
            request_id = scope.get("qse", {}).get("request_id")
            log.exception("stream_failed", error=repr(exc), request_id=request_id)
            err = internal_error(request_id)
            scope.setdefault("qse", {})["stream_error"] = err.code
            await _send_body(send, state, frame(err.body()))
        state["done"] = True
        await _send_body(send, state, DONE, more_body=False)


async def _send_body(send, state: dict, body: bytes, more_body: bool = True) -> None:
    async with state["lock"]:
        await send({"type": "http.response.body", "body": body, "more_body": more_body})
        state["last_s"] = anyio.current_time()


async def _keep_alive(send, state: dict, every_s: float) -> None:
    """A comment line whenever nothing went out for `every_s`, until the stream is done or the client gone."""
    while True:
        await anyio.sleep(max(0.0, state["last_s"] + every_s - anyio.current_time()))
        async with state["lock"]:
            if state["done"] or state["gone"]:
                return
            if anyio.current_time() - state["last_s"] < every_s:
                continue  # a frame went out meanwhile: wait from it
            try:
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            except OSError:  # a server that raises once the client is gone (ASGI 2.4): the watcher sees it leave
                return
            state["last_s"] = anyio.current_time()


async def _watch_disconnect(receive, state: dict, on_gone: Callable[[], None] | None) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            state["gone"] = not state.get("done")
            if state["gone"] and on_gone is not None:
                on_gone()
            return
