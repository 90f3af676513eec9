"""The host tier's pinned arena: pieces are handed out and come back exactly when nothing views them, and the
host tier's copies made in it bring a session back bit for bit (on CPU the arena is plain memory: the same
allocator and lifetimes the CUDA path pins)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from qse.sessions.grid import GridSessions
from qse.sessions.served import ServedSessions
from qse.store import ShadowStore
from qse.store.arena import ALIGN, PinnedArena

GRID = 32
VOCAB = 248000


def _arena(nbytes: int) -> PinnedArena:
    arena = PinnedArena(nbytes, pin=False)
    arena.start()
    assert arena.wait_ready(timeout=60) and arena.error is None
    return arena


def test_pieces_come_back_when_their_last_view_goes_and_neighbours_join():
    arena = _arena(8 * ALIGN)
    a = arena.take((ALIGN // 4,), torch.float32)  # one page
    b = arena.take((3, ALIGN), torch.uint8)  # three pages
    c = arena.take((2, 5), torch.bfloat16)  # rounded up to a page
    assert a.shape == (ALIGN // 4,) and b.shape == (3, ALIGN) and c.dtype == torch.bfloat16
    assert arena.free_nbytes == 3 * ALIGN
    b.fill_(7)
    view = b[1:, 10:20]  # a view keeps the piece: its storage is the piece's
    del b
    gc.collect()
    assert arena.free_nbytes == 3 * ALIGN and bool((view == 7).all())
    del view
    assert arena.free_nbytes == 6 * ALIGN
    assert arena.take((7 * ALIGN,), torch.uint8) is None  # 6 pages free, split around c
    del a, c
    assert arena.free_nbytes == 8 * ALIGN
    whole = arena.take((8 * ALIGN,), torch.uint8)  # the returned ranges joined into one again
    assert whole is not None and whole.numel() == 8 * ALIGN


def test_pieces_do_not_overlap_and_keep_their_bytes():
    arena = _arena(64 * ALIGN)
    gen = torch.Generator().manual_seed(3)
    held = []
    for i in range(12):
        t = arena.take((i + 1, 300), torch.float32)
        t.copy_(torch.randn(t.shape, generator=gen))
        held.append((t, t.clone()))
    for t, want in held:
        assert torch.equal(t, want)
    addresses = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t, _ in held)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(addresses, addresses[1:]))


def test_a_piece_dropped_on_another_thread_comes_back():
    arena = _arena(4 * ALIGN)
    box = [arena.take((4 * ALIGN,), torch.uint8)]
    assert arena.take((1,), torch.uint8) is None
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert arena.take((4 * ALIGN,), torch.uint8) is not None


def test_nothing_is_handed_out_before_the_memory_is_there():
    arena = PinnedArena(4 * ALIGN, pin=False)  # not started
    assert arena.take((1,), torch.uint8) is None
    with pytest.raises(ValueError, match="nbytes >= 0, got -1"):
        PinnedArena(-1, pin=False)


def _served(engine, store=None) -> ServedSessions:
    book = GridSessions(engine, grid=GRID, pool_bytes=16 << 20, residency=store, graphs=False, who="the served model")
    return ServedSessions(book)


def _turn(served, sid, prompt):
    turn, logits = served.begin(sid, prompt)
    first = logits[-1].clone()
    served.finish(turn)
    return first, turn.start


@pytest.mark.parametrize("arena_share", [4.0, 0.5])  # room for the session; too little: per-move buffers
def test_host_copies_in_the_arena_bring_a_session_back_exactly(tiny_engine, tmp_path, arena_share):
    gen = torch.Generator().manual_seed(31)
    prompt = torch.randint(0, VOCAB, (3 * GRID + 5,), generator=gen).tolist()
    nxt = prompt + torch.randint(0, VOCAB, (GRID + 2,), generator=gen).tolist()
    probe = _served(tiny_engine)
    _turn(probe, "p", prompt)
    one = probe.book.get("p").nbytes
    store = ShadowStore(1 << 40, tmp_path / "served", host_cap_nbytes=8 * one,
                        host_arena_nbytes=int(one * arena_share))
    served = _served(tiny_engine, store)
    _turn(served, "a", prompt)
    arena = store.arena
    assert arena is not None and arena.wait_ready(timeout=60)
    empty = arena.free_nbytes
    assert store.move_to_host(served.book, served.book.get("a"))
    if arena_share > 1:
        assert arena.fallbacks == 0 and arena.free_nbytes < empty  # the host copy lives in the arena
    else:
        assert arena.fallbacks > 0  # what did not fit went to plain memory
    first, start = _turn(served, "a", nxt)
    cold = _served(tiny_engine)
    cold_first, _ = _turn(cold, "cold", nxt)
    assert start.tier == "host" and torch.equal(first, cold_first)
    assert served.book.state_equal(served.book.get("a"), cold.book.get("cold")) == {
        "committed": True, "kv": True, "recurrent": True, "conv": True}
    served.book.close("a")
    gc.collect()
    # on CPU a restored checkpoint may keep its host tensor (a copy to the same device is the tensor itself);
    # once the session is gone every piece is back
    assert arena.free_nbytes == empty
    assert store.stats()["host_arena_bytes"] == arena.nbytes
