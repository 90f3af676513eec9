"""ModelState: the one form every tier keeps a sequence's state in.

`sections` are whole tensors copied as they are (recurrent and conv state, by name); `views` are
position-indexed buffers with their token axis, sliced by length (KV rows). The signature covers
names, shapes (token axis excluded) and dtypes, so a restore across models is refused by name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


class StateMismatch(ValueError):
    """A restore across models (or across grids/dtypes): the signatures differ."""


@dataclass
class ModelState:
    sections: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # token axis 0, exactly `length` rows
    length: int = 0

    def signature(self) -> str:
        parts = []
        for name in sorted(self.sections):
            t = self.sections[name]
            parts.append(f"s:{name}:{tuple(t.shape)}:{t.dtype}")
        for name in sorted(self.views):
            t = self.views[name]
            parts.append(f"v:{name}:{tuple(t.shape[1:])}:{t.dtype}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.sections.values(), *self.views.values()))

    def clone(self, device: torch.device | str | None = None) -> "ModelState":
        return ModelState(
            sections={k: v.to(device or v.device, copy=True) for k, v in self.sections.items()},
            views={k: v.to(device or v.device, copy=True) for k, v in self.views.items()},
            length=self.length,
        )

    def check_compatible(self, signature: str) -> None:
        mine = self.signature()
        if mine != signature:
            raise StateMismatch(f"state signature {mine} does not match the model's {signature}; refusing a foreign restore")

    def equal(self, other: "ModelState") -> bool:
        """Bit equality of every tensor (torch.equal), lengths and names included."""
        if self.length != other.length or self.sections.keys() != other.sections.keys() or self.views.keys() != other.views.keys():
            return False
        return all(torch.equal(self.sections[k], other.sections[k]) for k in self.sections) and all(
            torch.equal(self.views[k], other.views[k]) for k in self.views
        )
