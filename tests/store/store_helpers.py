"""Helpers of the store tests (fixtures are in conftest.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from qse.engine.engine import Engine
from qse.shadow.reader import ShadowReader
from qse.sessions.session import GridSession as ShadowSession
from qse.store import ShadowStore
from qse.store import disk

GRID = 32


def session_nbytes(engine: Engine, reader: ShadowReader, rows: int, checkpoints: int = 0) -> int:
    """What a resident session of `rows` committed rows holds (pages are whole)."""
    pages = -(-rows // reader.pool.page_rows)
    return pages * reader.pool.page_nbytes + (1 + checkpoints) * engine.cost(0)


def make_reader(engine: Engine, disk_dir: Path | None, cap_nbytes: int = 1 << 30, pool_bytes: int = 4 << 20,
                grid: int = GRID, reader_kwargs: dict | None = None, **store_kwargs) -> tuple[ShadowReader, ShadowStore]:
    store = ShadowStore(cap_nbytes, disk_dir, **store_kwargs)
    reader = ShadowReader(engine, grid=grid, pool_bytes=pool_bytes, residency=store, **(reader_kwargs or {}))
    return reader, store


def random_ids(seed: int, n: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def snapshot(reader: ShadowReader, session: ShadowSession) -> dict:
    """Every tensor and field of a resident session's state, copied."""
    assert session.cache is not None
    return {
        "state": reader.engine.cache_state(session.cache),
        "committed": session.committed,
        "ids": list(session.ids),
        "checkpoint_lines": set(session.checkpoint_lines),
        "checkpoints": [(c.position, [t.clone() for t in c.recurrent], [t.clone() for t in c.conv]) for c in session.checkpoints],
        "mode": session.mode,
    }


def assert_same(reader: ShadowReader, session: ShadowSession, snap: dict) -> None:
    """Bit equality (torch.equal) of every tensor with a snapshot, and of every field."""
    now = snapshot(reader, session)
    assert now["committed"] == snap["committed"]
    assert now["ids"] == snap["ids"]
    assert now["checkpoint_lines"] == snap["checkpoint_lines"]
    assert now["mode"] == snap["mode"]
    assert now["state"].equal(snap["state"])
    assert [c[0] for c in now["checkpoints"]] == [c[0] for c in snap["checkpoints"]]
    for (_, rec_a, conv_a), (_, rec_b, conv_b) in zip(now["checkpoints"], snap["checkpoints"]):
        assert all(torch.equal(x, y) for x, y in zip(rec_a, rec_b))
        assert all(torch.equal(x, y) for x, y in zip(conv_a, conv_b))


def assert_fresh(reader: ShadowReader, session_id: str, ref: ShadowReader) -> None:
    """The session equals a fresh prefill of its ids on the same grid (read on `ref`)."""
    session = reader.get(session_id)
    fresh = ref.fresh_prefill(list(session.ids))
    assert ref.state_equal(session, fresh) == {"committed": True, "kv": True, "recurrent": True, "conv": True}


def rewrite_meta(path: Path, **changes: str) -> None:
    """Rewrite a parked file with some metadata changed and a valid checksum (only those fields differ)."""
    header = disk.read_header(path)
    tensors = disk.read_tensors(header)
    disk.write_file(path, tensors, {**header.meta, **changes})
