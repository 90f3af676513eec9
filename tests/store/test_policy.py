"""The store's pure decisions, with scripted inputs and exact answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qse.store.policy import ParkedFile, Resident, Room, Sweep, plan_room, plan_sweep


def res(sid: str, fed: float, nbytes: int = 100, pages: int = 1) -> Resident:
    return Resident(sid, fed, nbytes, pages)


def test_nothing_leaves_when_everything_fits():
    room = plan_room([res("a", 1), res("b", 2)], kept_nbytes=100, free_pages=3, need_pages=1, need_nbytes=10, cap_nbytes=400)
    assert room == Room([], True, True)


def test_cap_evicts_least_recently_fed_first():
    residents = [res("b", 2), res("a", 1), res("c", 3)]
    room = plan_room(residents, kept_nbytes=100, free_pages=10, need_pages=0, need_nbytes=0, cap_nbytes=250)
    assert room == Room(["a", "b"], True, True)


def test_pool_evicts_until_the_pages_are_free_and_skips_pageless_sessions():
    residents = [res("a", 1, pages=0), res("b", 2, pages=2), res("c", 3, pages=2)]
    room = plan_room(residents, kept_nbytes=0, free_pages=1, need_pages=3, need_nbytes=0, cap_nbytes=10_000)
    assert room == Room(["b"], True, True)


def test_bytes_to_add_count_against_the_cap():
    room = plan_room([res("a", 1), res("b", 2)], kept_nbytes=100, free_pages=10, need_pages=1, need_nbytes=50, cap_nbytes=300)
    assert room == Room(["a"], True, True)


def test_no_eviction_when_the_pool_cannot_hold_the_growth_anyway():
    room = plan_room([res("a", 1, pages=1)], kept_nbytes=0, free_pages=0, need_pages=5, need_nbytes=0, cap_nbytes=10_000)
    assert room == Room([], False, True)


def test_an_oversized_kept_session_sends_everyone_else_away():
    room = plan_room([res("a", 1), res("b", 2)], kept_nbytes=500, free_pages=10, need_pages=0, need_nbytes=0, cap_nbytes=300)
    assert room == Room(["a", "b"], True, False)


def test_ties_go_in_the_given_order():
    room = plan_room([res("x", 5), res("y", 5)], kept_nbytes=0, free_pages=10, need_pages=0, need_nbytes=0, cap_nbytes=100)
    assert room.victims == ["x"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 500), st.integers(0, 4)), max_size=8),
       st.integers(0, 500), st.integers(0, 8), st.integers(0, 6), st.integers(0, 200), st.integers(0, 2000))
def test_room_invariants(specs, kept, free, need_pages, need_nbytes, cap):
    residents = [Resident(f"s{i}", fed, nb, pg) for i, (fed, nb, pg) in enumerate(specs)]
    room = plan_room(residents, kept, free, need_pages, need_nbytes, cap)
    by_id = {r.session_id: r for r in residents}
    left = [r for r in residents if r.session_id not in room.victims]
    assert room.fits_pool == (free + sum(by_id[v].pages for v in room.victims) >= need_pages)
    assert room.fits_cap == (kept + sum(r.nbytes for r in left) + need_nbytes <= cap)
    if room.fits_pool and room.fits_cap and room.victims:
        # minimal in LRU order: without the last victim the room would not be there
        last = by_id[room.victims[-1]]
        short = free + sum(by_id[v].pages for v in room.victims) - last.pages < need_pages
        over = kept + sum(r.nbytes for r in left) + last.nbytes + need_nbytes > cap
        assert short or over
    fed = [by_id[v].last_fed_s for v in room.victims]
    assert fed == sorted(fed)


def test_sweep_removes_expired_files_then_the_oldest_over_the_cap():
    files = [ParkedFile("a", 0.0, 100), ParkedFile("b", 50.0, 100), ParkedFile("c", 80.0, 100), ParkedFile("d", 90.0, 100)]
    assert plan_sweep(files, now=120.0, ttl_s=100.0, cap_nbytes=1000) == Sweep(["a"], [])
    assert plan_sweep(files, now=120.0, ttl_s=100.0, cap_nbytes=200) == Sweep(["a"], ["b"])
    assert plan_sweep(files, now=120.0, ttl_s=100.0, cap_nbytes=250, incoming_nbytes=100) == Sweep(["a"], ["b", "c"])
    assert plan_sweep(files, now=100.0, ttl_s=100.0, cap_nbytes=1000) == Sweep([], [])  # exactly the ttl: kept
    assert plan_sweep([], now=0.0, ttl_s=1.0, cap_nbytes=0) == Sweep([], [])
