"""Checks over a prompt's token ids, decided in C: a prompt is 10^4 to 10^5 ids, and a Python pass over it id by
id holds the event loop (every other stream waits) for milliseconds. The id-by-id pass runs only to name the
first bad id."""

from __future__ import annotations

from typing import Sequence


def is_int_list(values: Sequence) -> bool:
    """Whether every item is a plain int (not a bool, not a float), and there is at least one."""
    return bool(values) and set(map(type, values)) == {int}


def first_outside(ids: Sequence[int], end: int) -> int | None:
    """The first id outside [0, end), or None; min and max first, the search only when one is out."""
    if not ids or (min(ids) >= 0 and max(ids) < end):
        return None
    return next(t for t in ids if not 0 <= t < end)


def namespace_of(key: str) -> str:
    """The tenant namespace of a conductor session id: what precedes its first "/" (a tenant's ids are
    "name/..."; qse/server/tenants.py), with the "/"; "" for an id with none. Two ids of one namespace may
    share state; ids of two never do."""
    head, sep, _ = key.partition("/")
    return head + sep if sep else ""


def same_namespace(session_id: str, donor_id: str) -> bool:
    """A session may start from a donor's state only inside its own tenant's namespace (QSE_SHARE_HEADS)."""
    return namespace_of(session_id) == namespace_of(donor_id)


__all__ = ["first_outside", "is_int_list", "namespace_of", "same_namespace"]
