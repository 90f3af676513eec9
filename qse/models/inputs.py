"""What a forward reads besides the ids and the cache, and the error for bad ones: the contract between
the engine (which fills these, on the device, for eager runs and CUDA graphs alike) and a family's
forward (which reads them). No family is named here, so code above qse/models/ can build them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Step:
    """What one forward needs besides the ids and the cache, kept on the device so that a CUDA graph
    can hold it: a captured forward reads its position from `start`, never from the host."""

    start: torch.Tensor  # int32 [1]: the position of the first id
    num_tokens: int
    pos: int | None = None  # the same position on the host (eager); None inside a captured graph
    logit_row: torch.Tensor | None = None  # long [1]: the row whose logits logits="row" returns
    max_rows: int | None = None  # a bound on pos + T (sizes the attention launch; exact when eager)
    logit_row_host: int | None = None  # logit_row on the host (eager), for a contiguous KV store
    # long [1]: rows at or past it are padding (a tail read in a graph of a fixed row count): they write KV
    # rows above the real ones and step no state, so the real rows' outputs and the state after them are what
    # a forward of the real rows alone gives (None: every row is real)
    valid: torch.Tensor | None = None


@dataclass
class DecodeBatch:
    """What one batched decode step reads besides the ids, on the device (a CUDA graph captured per batch
    size holds these buffers): row b is the next token of a sequence at position positions[b], whose GDN
    state is slot slots[b] of the SlotStates and whose KV rows live in the pool's pages tables[b]."""

    positions: torch.Tensor  # int32 [B]
    slots: torch.Tensor  # long [B]; distinct for real rows (padding rows may share one)
    tables: torch.Tensor  # int32 [B, pages]: each row's page ids, as many as the longest sequence needs
    pool: "object"  # the KVPool: .k, .v [P, slots, page_rows, Hkv, D]
    max_rows: int  # a bound on positions + 1 (sizes the attention launch)


class InputError(ValueError):
    """Bad ids or positions handed to the model."""


__all__ = ["DecodeBatch", "InputError", "Step"]
