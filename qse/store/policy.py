"""The store's decisions, as pure functions: which resident sessions leave, which parked files go.

Nothing here touches torch, the disk or a clock: callers pass what they see (bytes, pages, the
time `now`) and get back names in the order to act on them. Tests script the inputs and assert
the exact decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Resident:
    """One resident session other than the one being fed or read."""

    session_id: str
    last_fed_s: float
    nbytes: int  # everything it holds: KV pages in use, recurrent, conv, checkpoints
    pages: int  # KV pool pages it would give back


class Room(NamedTuple):
    victims: list[str]  # evict in this order (least recently fed first)
    fits_pool: bool  # the pages are free once the victims are gone
    fits_cap: bool  # the resident bytes plus what is about to be added are under the cap


def plan_room(residents: list[Resident], kept_nbytes: int, free_pages: int, need_pages: int,
              need_nbytes: int, cap_nbytes: int) -> Room:
    """Evict the least recently fed sessions until `need_pages` pages are free and the resident
    bytes plus `need_nbytes` fit under `cap_nbytes`.

    `residents` never holds the kept session (the one being fed or read); its bytes come in as
    `kept_nbytes`. Ties in `last_fed_s` go in the given order. A session that holds no pages is
    not evicted for pages alone. When the pool cannot find the pages even with every other session
    gone, nobody is evicted (the caller refuses the growth). When the kept session alone is over
    the cap, every other session goes and `fits_cap` is False: the cap is then exceeded by that one
    session only.
    """
    if free_pages + sum(r.pages for r in residents) < need_pages:
        total = kept_nbytes + sum(r.nbytes for r in residents)
        return Room([], False, total + need_nbytes <= cap_nbytes)
    total = kept_nbytes + sum(r.nbytes for r in residents)
    victims: list[str] = []
    for r in sorted(residents, key=lambda r: r.last_fed_s):
        short_of_pages = free_pages < need_pages
        over_cap = total + need_nbytes > cap_nbytes
        if not short_of_pages and not over_cap:
            break
        if not over_cap and r.pages == 0:
            continue  # gives back no page, and bytes are not the problem
        victims.append(r.session_id)
        free_pages += r.pages
        total -= r.nbytes
    return Room(victims, free_pages >= need_pages, total + need_nbytes <= cap_nbytes)


@dataclass(frozen=True)
class ParkedFile:
    session_id: str
    written_s: float  # wall clock (seconds since the epoch) when the file was renamed into place
    nbytes: int  # the file's size


class Sweep(NamedTuple):
    expired: list[str]  # older than the time-to-live
    evicted: list[str]  # oldest first, until the disk cap holds with the incoming file


def plan_sweep(files: list[ParkedFile], now: float, ttl_s: float, cap_nbytes: int, incoming_nbytes: int = 0) -> Sweep:
    """Files past `ttl_s` go; then the oldest go until the rest plus `incoming_nbytes` fit under
    `cap_nbytes`. Ties in `written_s` go in the given order."""
    expired = [f.session_id for f in files if now - f.written_s > ttl_s]
    gone = set(expired)
    kept = sorted((f for f in files if f.session_id not in gone), key=lambda f: f.written_s)
    total = sum(f.nbytes for f in kept) + incoming_nbytes
    evicted: list[str] = []
    for f in kept:
        if total <= cap_nbytes:
            break
        evicted.append(f.session_id)
        total -= f.nbytes
    return Sweep(expired, evicted)


__all__ = ["ParkedFile", "Resident", "Room", "Sweep", "plan_room", "plan_sweep"]
