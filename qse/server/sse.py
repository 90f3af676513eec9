"""Server-sent events: `data: <json>\\n\\n` frames, `data: [DONE]` last, and a client that leaves stops the turn.

The event source is closed (`aclose`) however the response ends (done, client gone, error), so the
conductor's turn always releases the engine lock and feeds the reader what was generated.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import anyio
import structlog

from . import wire
from .errors import ApiError, internal_error

log = structlog.get_logger("qse.server")

DONE = b"data: [DONE]\n\n"


def frame(obj: Any) -> bytes:
    return b"data: " + wire.encode(obj) + b"\n\n"


class EventStream:
    """An ASGI response that sends each object of `events` as one SSE frame."""

    def __init__(self, events: AsyncIterator[Any], headers: dict[str, str] | None = None,
                 on_gone: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None):
        """on_gone: called once the client left before the end (a turn still waiting for its slot leaves the
        queue at once); on_close: called when the response is over, however it ended."""
        self.events = events
        self.on_gone = on_gone
        self.on_close = on_close
        self.headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})
            state = {"gone": False, "done": False}
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, state, self.on_gone)
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
                    await send({"type": "http.response.body", "body": frame(obj), "more_body": True})
        except ApiError as exc:  # the headers are out: the error goes as the last event
            await send({"type": "http.response.body", "body": frame(exc.body()), "more_body": True})
        except Exception as exc:
            request_id = scope.get("qse", {}).get("request_id")
            log.exception("stream_failed", error=repr(exc), request_id=request_id)
            err = internal_error(request_id)
            await send({"type": "http.response.body", "body": frame(err.body()), "more_body": True})
        state["done"] = True
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _watch_disconnect(receive, state: dict, on_gone: Callable[[], None] | None) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            state["gone"] = not state.get("done")
            if state["gone"] and on_gone is not None:
                on_gone()
            return
