"""The residency planner's arithmetic: which roles' models and pools fit in the device's memory.

    role       what it holds on the device
    served     the served model's weights, its KV pool, its decode state slots, its sessions' device cap
    reader     the reader's weights (none of its own when it reads the served model's), its sessions' cap
    narrator   the reader's weights (always shared) and nothing of its own: it decodes on the reader's forks

A role's `Claim` is its weights plus its pools, in bytes. Roles that name the same model share one copy of the
weights: a claim counts its weights only when no loaded role holds them already.

Admission, for a role that is not loaded:

    committed   = what the loaded roles claimed (each shared weight counted once)
    outstanding = committed - drawn, at least 0     (claimed, not allocated yet: pools fill lazily)
    available   = free - outstanding
    fits        = need <= available

`free` and `drawn` come from the caller: on a GPU the device's free memory and what this process has
reserved from it; on a CPU a configured budget (or the machine's memory) and 0, so that available is the
budget less every loaded claim. Pure: no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

GIB = 1 << 30

ROLES = ("served", "reader", "narrator")


class RoleState(str, Enum):
    OFF = "off"  # the profile or the switches ask for no such role
    PLANNED = "planned"  # will load in the first idle window
    LOADING = "loading"
    LOADED = "loaded"
    RELEASED = "released"  # was loaded, released on request; can be loaded again
    REFUSED = "refused"  # its claim did not fit (the verdict says why)
    FAILED = "failed"  # its load raised (the error says why)


@dataclass(frozen=True)
class Claim:
    """What a role holds on the device once loaded. `model` names its weights: equal names share them.
    weights_nbytes None: not known before the load (measured then)."""

    role: str
    model: str
    weights_nbytes: int | None
    pools: tuple[tuple[str, int], ...] = ()  # (pool, bytes): KV pool, state slots, session caps

    @property
    def pools_nbytes(self) -> int:
        return sum(n for _, n in self.pools)

    @property
    def nbytes(self) -> int:
        """Weights (0 where unknown) plus pools."""
        return (self.weights_nbytes or 0) + self.pools_nbytes

    def describe(self) -> str:
        weights = "weights unknown until loaded" if self.weights_nbytes is None else \
            f"weights {gib(self.weights_nbytes)}"
        parts = [weights] + [f"{name} {gib(n)}" for name, n in self.pools]
        return " + ".join(parts)


@dataclass(frozen=True)
class Verdict:
    """admit's answer. need_nbytes: what loading would add (its pools, and its weights unless shared)."""

    role: str
    fits: bool
    need_nbytes: int
    available_nbytes: int
    shares_weights_with: str | None
    message: str


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def committed_nbytes(loaded: Iterable[Claim]) -> int:
    """The loaded roles' claims, each model's weights counted once."""
    seen: set[str] = set()
    total = 0
    for c in loaded:
        total += c.pools_nbytes
        if c.model not in seen:
            seen.add(c.model)
            total += c.weights_nbytes or 0
    return total


def admit(claim: Claim, loaded: Iterable[Claim], free_nbytes: int, drawn_nbytes: int = 0,
          where: str = "the device") -> Verdict:
    """May `claim` load next to the `loaded` claims, with `free_nbytes` free and `drawn_nbytes` already drawn
    by this process? The message names the role, its claim and the memory, whichever way it goes."""
    loaded = [c for c in loaded if c.role != claim.role]
    sharer = next((c.role for c in loaded if c.model == claim.model), None)
    need = claim.pools_nbytes + (0 if sharer is not None else (claim.weights_nbytes or 0))
    outstanding = max(0, committed_nbytes(loaded) - drawn_nbytes)
    available = free_nbytes - outstanding
    shared = f" (weights shared with the {sharer})" if sharer is not None else ""
    held = f", {gib(outstanding)} of it claimed by the loaded roles" if outstanding else ""
    if need <= available:
        message = f"the {claim.role}'s claim ({claim.describe()}{shared}) needs {gib(need)}; " \
                  f"{gib(available)} is available on {where}"
        return Verdict(claim.role, True, need, available, sharer, message)
    message = (f"the {claim.role}'s claim ({claim.describe()}{shared}) needs {gib(need)}, but {where} has "
               f"{gib(free_nbytes)} free{held}: {gib(max(0, available))} available. Lower the {claim.role}'s "
               "pools or free the memory, then load it again")
    return Verdict(claim.role, False, need, available, sharer, message)


@dataclass
class RoleEntry:
    claim: Claim | None
    state: RoleState
    verdict: Verdict | None = None
    error: str | None = None


@dataclass
class Residency:
    """Every role's claim and state: one book, written by the planner (runtime) only."""

    roles: dict[str, RoleEntry] = field(default_factory=dict)

    def plan(self, claim: Claim, state: RoleState = RoleState.PLANNED) -> None:
        if claim.role not in ROLES:
            raise ValueError(f"role {claim.role!r} is not one of {ROLES}")
        self.roles[claim.role] = RoleEntry(claim, state)

    def off(self, role: str) -> None:
        self.roles[role] = RoleEntry(None, RoleState.OFF)

    def state(self, role: str) -> RoleState:
        entry = self.roles.get(role)
        return RoleState.OFF if entry is None else entry.state

    def loaded(self) -> list[Claim]:
        return [e.claim for e in self.roles.values() if e.state is RoleState.LOADED and e.claim is not None]

    def admit(self, role: str, free_nbytes: int, drawn_nbytes: int = 0, where: str = "the device") -> Verdict:
        """The role's verdict against the loaded roles; a refusal is noted (REFUSED)."""
        entry = self.roles[role]
        verdict = admit(entry.claim, self.loaded(), free_nbytes, drawn_nbytes, where)
        entry.verdict = verdict
        if not verdict.fits:
            entry.state = RoleState.REFUSED
        return verdict

    def set_state(self, role: str, state: RoleState, error: str | None = None) -> None:
        entry = self.roles[role]
        entry.state = state
        entry.error = error

    def measured(self, role: str, weights_nbytes: int) -> None:
        """The weights as loaded (they replace an estimate, or the unknown)."""
        entry = self.roles[role]
        c = entry.claim
        entry.claim = Claim(c.role, c.model, weights_nbytes, c.pools)

    def view(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for role, e in self.roles.items():
            row: dict = {"state": e.state.value}
            if e.claim is not None:
                row.update(model=e.claim.model, weights_bytes=e.claim.weights_nbytes, pools=dict(e.claim.pools),
                           claim_bytes=e.claim.nbytes)
            if e.verdict is not None:
                row.update(shares_weights_with=e.verdict.shares_weights_with, verdict=e.verdict.message)
            if e.error:
                row["error"] = e.error
            out[role] = row
        return out
