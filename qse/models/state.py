"""ModelState: the one form every tier keeps a sequence's state in; StateManifest: what it holds.

`sections` are whole tensors copied as they are (recurrent and conv state, by name); `views` are
position-indexed buffers with their token axis, sliced by length (KV rows). The model's adapter
names them: its `manifest()` lists every state tensor (name, section or view, shape, dtype, and where
a SequenceCache holds it), and nothing above the adapter spells a name. The signature covers names,
shapes (token axis excluded) and dtypes, so a restore across models is refused by name.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch


class StateMismatch(ValueError):
    """A restore across models (or across grids/dtypes): the state is not what the manifest lists."""


SECTION, VIEW = "section", "view"


def _signature(tensors: Iterable[tuple[str, str, tuple[int, ...], torch.dtype]]) -> str:
    """A hash of (kind, name, shape, dtype) of every tensor (a view's shape is one token's), sections first,
    each kind by name: the same for a manifest and for a state it lists, whatever their orders."""
    entries = sorted((kind != SECTION, name, f"{'s' if kind == SECTION else 'v'}:{name}:{tuple(int(n) for n in shape)}:{dtype}")
                     for kind, name, shape, dtype in tensors)
    return hashlib.sha256("|".join(e for _, _, e in entries).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a sequence's state as the adapter names it.

    A section is a whole tensor of fixed size (`shape` is its shape); a view is a buffer whose rows are
    positions (`shape` is one position's, the token axis excluded). Where a SequenceCache holds it: a
    section is `cache.state_tensors()[index]`; a view is item `part` (0 keys, 1 values) of
    `cache.kv.read(index, length)`, the rows of KV slot `index`."""

    name: str
    kind: Literal["section", "view"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: int
    part: int = 0

    @property
    def nbytes(self) -> int:
        """A section's bytes; a view's bytes per token."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateManifest:
    """Every tensor of one model's sequence state (from the adapter's `manifest()`): what a ModelState of
    that model holds, its bytes at any length (`cost`), and the signature the disk tier fingerprints."""

    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"a state manifest names each tensor once, got {names}")

    @property
    def sections(self) -> tuple[StateTensor, ...]:
        """The sections in the order of SequenceCache.state_tensors() (their `index`)."""
        return tuple(sorted((t for t in self.tensors if t.kind == SECTION), key=lambda t: t.index))

    @property
    def views(self) -> tuple[StateTensor, ...]:
        return tuple(t for t in self.tensors if t.kind == VIEW)

    def kv_slots(self) -> dict[int, tuple[str, ...]]:
        """KV slot -> its views' names in part order (keys, values): what KVStore.write takes together."""
        slots: dict[int, list[StateTensor]] = {}
        for t in self.views:
            slots.setdefault(t.index, []).append(t)
        return {slot: tuple(t.name for t in sorted(parts, key=lambda t: t.part)) for slot, parts in sorted(slots.items())}

    @property
    def section_nbytes(self) -> int:
        return sum(t.nbytes for t in self.sections)

    @property
    def view_nbytes_per_token(self) -> int:
        return sum(t.nbytes for t in self.views)

    def cost(self, length: int) -> int:
        """The bytes of a state at `length` tokens: every section, and `length` rows of every view."""
        if length < 0:
            raise ValueError(f"a state's length is a number of tokens >= 0, got {length}")
        return self.section_nbytes + length * self.view_nbytes_per_token

    def signature(self) -> str:
        """Names, kinds, shapes and dtypes, order-free: equal to ModelState.signature() of a state it lists."""
        return _signature((t.kind, t.name, t.shape, t.dtype) for t in self.tensors)

    def check(self, state: "ModelState") -> None:
        """Raise StateMismatch naming the first tensor that is not as listed (missing, extra, or of another
        shape or dtype) or a view whose rows are not the state's length."""
        held = {**{(SECTION, k): v for k, v in state.sections.items()}, **{(VIEW, k): v for k, v in state.views.items()}}
        want = {(t.kind, t.name): t for t in self.tensors}
        extra = sorted(name for kind, name in held if (kind, name) not in want)
        if extra:
            raise StateMismatch(f"the state holds {extra[0]!r}, which this model's manifest does not list; "
                                "refusing a foreign restore")
        for (kind, name), t in want.items():
            got = held.get((kind, name))
            if got is None:
                raise StateMismatch(f"the state lacks the {kind} {name!r} this model's manifest lists; refusing a foreign restore")
            shape = tuple(got.shape) if kind == SECTION else tuple(got.shape[1:])
            if shape != t.shape or got.dtype != t.dtype:
                raise StateMismatch(f"the state's {kind} {name!r} is {shape} {got.dtype}, this model's manifest says "
                                    f"{t.shape} {t.dtype}; refusing a foreign restore")
            if kind == VIEW and got.shape[0] != state.length:
                raise StateMismatch(f"the state's view {name!r} has {got.shape[0]} rows, its length is {state.length}")

    def fits_sections(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` (a checkpoint's, in the order of SequenceCache.state_tensors()) are this model's
        sections: same count, shapes and dtypes."""
        sections = self.sections
        return len(tensors) == len(sections) and all(
            tuple(x.shape) == t.shape and x.dtype == t.dtype for x, t in zip(tensors, sections))


@dataclass
class ModelState:
    sections: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # token axis 0, exactly `length` rows
    length: int = 0

    def signature(self) -> str:
        """The signature of the manifest that lists this state's tensors (StateManifest.signature)."""
        return _signature([*((SECTION, k, t.shape, t.dtype) for k, t in self.sections.items()),
                           *((VIEW, k, t.shape[1:], t.dtype) for k, t in self.views.items())])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.sections.values(), *self.views.values()))

    def clone(self, device: torch.device | str | None = None) -> "ModelState":
        return ModelState(
            sections={k: v.to(device or v.device, copy=True) for k, v in self.sections.items()},
            views={k: v.to(device or v.device, copy=True) for k, v in self.views.items()},
            length=self.length,
        )

    def equal(self, other: "ModelState") -> bool:
        """Bit equality of every tensor (torch.equal), lengths and names included."""
        if self.length != other.length or self.sections.keys() != other.sections.keys() or self.views.keys() != other.views.keys():
            return False
        return all(torch.equal(self.sections[k], other.sections[k]) for k in self.sections) and all(
            torch.equal(self.views[k], other.views[k]) for k in self.views
        )
