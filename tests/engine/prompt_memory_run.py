"""Run by test_prompt_memory.py in a process of its own: a 64k-token prompt through the served turn's start and
a reader's question, on the embedded model on the CPU; prints JSON with the peak resident memory (VmHWM) above
what the model itself took.

The session's rows below the prompt's last chunks come back as a parked state (as the store brings back a
session read earlier: random rows here, since their values do not change what a read holds in memory); the
rest of the prompt is read on the grid over the whole 64k of context, the tail and a question on forks. What a
read holds depends only on the rows it reads and the context it attends over, and the last chunks attend over
the most; reading all 64k rows from row 0 would hold no more, but takes many minutes of a shared core.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

PROMPT = int(os.environ.get("QSE_TEST_PROMPT", 65536 + 100))  # 64Ki and a tail
GRID = 512


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def parked_state(engine, length: int, seed: int):
    """A state of `length` rows in the engine's ModelState form (what the disk tier hands back)."""
    gen = torch.Generator().manual_seed(seed)
    fresh = engine.cache_state(engine.new_cache(), 0)
    views = {name: torch.randn((length, *t.shape[1:]), generator=gen).to(t.dtype) * 0.5
             for name, t in fresh.views.items()}
    sections = {name: torch.randn(t.shape, generator=gen).to(t.dtype) * 0.1 for name, t in fresh.sections.items()}
    return type(fresh)(sections=sections, views=views, length=length)


def park(book, session_id: str, ids: list[int]) -> None:
    """The session known and its state parked (as the store leaves it): the next read brings it back."""
    book.feed(session_id, ids)
    book.drop_state(book.get(session_id))


def main(cache_dir: str, parked_rows: int) -> None:
    torch.set_num_threads(1)
    from qse.engine.engine import Engine
    from qse.engine.kv import PagedKV
    from qse.models import resolve
    from qse.sessions.grid import DropLRU, GridSessions
    from qse.sessions.served import ServedSessions
    from qse.shadow.reader import ShadowReader

    engine = Engine(resolve("", torch.device("cpu"), torch.float32, Path(cache_dir)))
    model_bytes = vm_hwm_bytes()

    class Parked(DropLRU):
        """Each session comes back from a parked state of `rows` rows."""

        def __init__(self, rows: int):
            self.rows = rows

        def bring_back(self, book, session) -> bool:
            state = parked_state(book.engine, self.rows, len(session.session_id))
            session.cache = book.engine.restore_cache(state, PagedKV(book.pool))
            session.committed = state.length
            return True

    pool_bytes = 2 * PROMPT * engine.state_bytes_per_token()  # the 64k rows, and room for a fork
    ids = torch.randint(0, engine.cfg.vocab_size - 1000, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    question = engine.chat.tokenizer.encode("<|im_start|>user\nIs this code?<|im_end|>\n<|im_start|>assistant\n")
    t0 = time.perf_counter()

    served = ServedSessions(GridSessions(engine, grid=GRID, pool_bytes=pool_bytes, residency=Parked(parked_rows),
                                         graphs=False, who="the served model"))
    park(served.book, "served", ids)
    turn, logits = served.begin("served", ids)  # reads the chunks above the parked rows, then the tail
    start = turn.start
    token = int(logits[0].argmax())
    served.decode(turn, token)
    served.finish(turn)

    # the reader's question: the whole chunk behind is read (and kept), then the tail and the question on a fork
    reader = ShadowReader(engine, grid=GRID, pool_bytes=pool_bytes, residency=Parked(parked_rows), graphs=False)
    park(reader, "read", ids)
    answer = reader.ask("read", question, ["A", "B"])  # reads the chunks behind (kept), forks the tail + question
    print(json.dumps({
        "prompt_tokens": PROMPT, "parked_rows": parked_rows, "model_bytes": model_bytes,
        "peak_growth_bytes": vm_hwm_bytes() - model_bytes, "served_chunks_read": start.chunks_read,
        "served_tail_tokens": start.tail_tokens, "reader_read_tokens": answer.read_tokens,
        "reader_committed": reader.get("read").committed, "fork_tokens": answer.tokens_forwarded,
        "wall_s": round(time.perf_counter() - t0, 3),
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
