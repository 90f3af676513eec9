"""One dedicated thread per engine: the event loop never runs torch.

Everything that touches an engine's device goes through `EngineExecutor.run`, which hands the call
to the engine's own thread and awaits it. One thread per engine means the device work of one
engine is serialised without locks inside the engine.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class EngineExecutor:
    def __init__(self, name: str):
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"qse-{name}")
        self._thread_ident: int | None = None
        self._pool.submit(self._remember_thread).result()

    def _remember_thread(self) -> None:
        self._thread_ident = threading.get_ident()

    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread_ident

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


async def landed(load: Future) -> None:
    """Until a load of the store's loader thread is done, whatever its outcome (the store lands it, a bad file as
    a miss). Cancelling the waiter never cancels the load (the store waits for every load it started)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_) -> None:  # on the loader's thread, or here when the load is done already
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop has closed: nobody waits
            pass

    load.add_done_callback(wake)
    await done
