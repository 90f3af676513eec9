"""What one forward reads and writes for one sequence: KV rows and the GDN state.

The model never owns storage. It writes the chunk's K/V rows into a KV store at absolute
positions and reads rows [0, length) back; it updates the recurrent and conv state tensors in
place (`copy_`), so their addresses never change (a CUDA graph may hold them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVStore(Protocol):
    """KV rows of the attention layers (slot = index among attention layers), token axis first."""

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at rows [start, start + T)."""

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, length) as contiguous [length, Hkv, D] tensors."""

    def ensure(self, length: int) -> bool:
        """Make room for `length` rows; False if it cannot (the caller decides what to do)."""


class ContiguousKV:
    """One growing buffer per attention layer. Growth reallocates (fine for the reference path and
    the served model's eager path; the shadow uses the paged store, whose rows never move)."""

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 1024):
        self.k = [torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_slots)]
        self.v = [torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_slots)]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def ensure(self, length: int) -> bool:
        if length <= self.capacity:
            return True
        new_cap = max(length, 2 * self.capacity)
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                grown = torch.empty((new_cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
                grown[: old.shape[0]] = old
                bufs[i] = grown
        return True

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.ensure(start + k.shape[0])
        self.k[slot][start : start + k.shape[0]] = k
        self.v[slot][start : start + v.shape[0]] = v

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[slot][:length], self.v[slot][:length]


@dataclass
class SequenceCache:
    kv: KVStore
    recurrent: list[torch.Tensor]  # per GDN layer [Hv, Dk, Dv] fp32
    conv: list[torch.Tensor]  # per GDN layer [K-1, C] in the model dtype
    length: int = 0  # rows of the sequence this cache holds (positions [0, length))
    # (recurrent, conv) stacked on a leading layer axis, when the lists are the rows of these two tensors
    # (new_cache makes them so): a whole state then moves in two copies instead of one a layer (a graph
    # replay's working state is loaded and stored every chunk, and the reader keeps a checkpoint of it;
    # 36 copies issued one by one from the host left the GPU idle ~0.6 ms a chunk)
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.recurrent, *self.conv]

    def copy_state_from(self, other: "SequenceCache") -> None:
        """This cache's GDN state := other's (the KV rows are not touched)."""
        mine, theirs = self.stacked, other.stacked
        if mine is not None and theirs is not None and all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in zip(mine, theirs)):
            for dst, src in zip(mine, theirs):
                dst.copy_(src)
        else:
            self.set_state(other.recurrent, other.conv)

    def set_state(self, recurrent: list[torch.Tensor], conv: list[torch.Tensor]) -> None:
        """This cache's GDN state := the given layers' (a checkpoint's, a saved copy's), in place."""
        torch._foreach_copy_(self.state_tensors(), [*recurrent, *conv])

    def clone_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of the GDN state as (recurrent, conv) lists (rows of two stacked copies where this cache
        is stacked: two copies, not one a layer)."""
        if self.stacked is not None:
            recurrent, conv = (t.clone() for t in self.stacked)
            return list(recurrent.unbind(0)), list(conv.unbind(0))
        return [t.clone() for t in self.recurrent], [t.clone() for t in self.conv]


@dataclass
class SlotStates:
    """The GDN state of up to S sequences at once, one slot each: what a batched decode step reads and
    updates in place (row slot of every layer's stack). Rows of one tensor a kind, so a sequence's whole state
    moves in or out in two copies. Who uses which slot is the owner's business (qse.engine.rounds)."""

    recurrent: torch.Tensor  # [GDN layers, S, Hv, Dk, Dv] fp32
    conv: torch.Tensor  # [GDN layers, S, K-1, C] in the model dtype

    @property
    def num_slots(self) -> int:
        return self.recurrent.shape[1]

    def load(self, slot: int, cache: SequenceCache) -> None:
        """Slot := the cache's GDN state."""
        if cache.stacked is not None:
            self.recurrent[:, slot].copy_(cache.stacked[0])
            self.conv[:, slot].copy_(cache.stacked[1])
        else:
            torch._foreach_copy_([*self.recurrent[:, slot].unbind(0), *self.conv[:, slot].unbind(0)], cache.state_tensors())

    def keep(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Slots dst[i] := slots src[i] (long tensors [B] on the device, so a graph may hold them): a verify
        window's accepted row's state becomes the sequence's (VerifyWindow). dst and src rows may be equal."""
        self.recurrent.index_copy_(1, dst, self.recurrent.index_select(1, src))
        self.conv.index_copy_(1, dst, self.conv.index_select(1, src))

    def store(self, slot: int, cache: SequenceCache) -> None:
        """The cache's GDN state := the slot's."""
        if cache.stacked is not None:
            cache.stacked[0].copy_(self.recurrent[:, slot])
            cache.stacked[1].copy_(self.conv[:, slot])
        else:
            cache.set_state(list(self.recurrent[:, slot].unbind(0)), list(self.conv[:, slot].unbind(0)))


@dataclass
class VerifyWindow:
    """A verify: each of B sequences reads T rows at once (its last token and T - 1 drafted ids), row-major
    (sequence b's rows are b * T .. b * T + T - 1). The attention rows need nothing more (a row attends below
    its own position over its sequence's pages, the rows before it in the window written first), but a GDN
    state steps row after row, and a draft may be refused: row j's state goes to its own slot scratch[b, j]
    (stepped from scratch[b, j - 1], row 0 from slots[b]), so the sequence's own slot is untouched until the
    caller keeps the state after its last accepted row (SlotStates.keep(slots, scratch[b, accepted[b]]))."""

    slots: torch.Tensor  # long [B]: each sequence's own slot (read by row 0, not written)
    scratch: torch.Tensor  # long [B, T]: distinct slots, one a row, none of them a sequence's own

    @property
    def width(self) -> int:
        return int(self.scratch.shape[1])
