"""An Engine over one model: the only place torch runs work.

It holds the model and its device, runs a forward on a SequenceCache and measures what it cost on
the device (CUDA events where there is a GPU, the wall clock on a CPU), and turns a cache into a
ModelState and back (the cold verbs every tier uses). The executor thread in qse/runtime owns an
engine's device work; nothing here knows about sessions or scheduling.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..models import ResolvedModel
from ..models.cache import SequenceCache
from ..models.state import ModelState, StateManifest


@dataclass
class Stopwatch:
    """Device time of a block: CUDA events on cuda (read after a synchronize), else wall time."""

    device: torch.device
    gpu_ms: float = 0.0
    _events: Any = field(default=None, repr=False)

    @contextmanager
    def measure(self) -> Iterator["Stopwatch"]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield self
            end.record()
            end.synchronize()
            self.gpu_ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            yield self
            self.gpu_ms = (time.perf_counter() - t0) * 1e3


class DeviceClock:
    """Marks on the device's timeline (CUDA events; the wall clock elsewhere), for work launched ahead of
    reading it back, where a Stopwatch's synchronize at the end of each block would make the device wait
    for the host's next launch."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def wait(self, mark: Any) -> None:
        """Until the device has passed `mark`."""
        if self.cuda:
            mark.synchronize()

    def ms(self, start: Any, end: Any) -> float:
        """Device ms from `start` to `end` (waits for `end`)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


class Engine:
    def __init__(self, resolved: ResolvedModel, kernels: str | None = None, pdl: bool | None = None):
        self.resolved = resolved
        self.model = resolved.model
        self.chat = resolved.chat
        self.cfg = self.model.cfg
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.name = resolved.name
        self.kernels = self._pick_kernels(kernels or "auto")
        if pdl is not None and self.kernels != "naive":
            # a switch of the process's launches (every engine of a server gets the same policy's value)
            from qse_kernels import pdl as launches

            launches.ON = pdl
        self._manifest = self.model.manifest()

    def _pick_kernels(self, requested: str) -> str:
        """Swap the model's ops for qse_kernels' Triton kernels where asked (and where they can run).

        naive: the torch twins; triton: qse's kernels with cuBLAS GEMMs; invariant: qse's kernels and
        GEMM, every row's result independent of how many rows a call holds (states equal across grids);
        auto: triton on CUDA, naive elsewhere."""
        import qse_kernels

        if requested not in ("naive", "triton", "invariant", "auto"):
            raise ValueError(f"QSE_KERNELS={requested!r}: expected naive, triton, invariant or auto")
        if requested == "naive" or (requested == "auto" and self.device.type != "cuda"):
            return "naive"
        if not qse_kernels.available():
            raise ValueError(f"QSE_KERNELS={requested} asked for, but Triton cannot run here (no CUDA device, "
                             "no TRITON_INTERPRET=1): use naive or auto")
        if requested == "invariant":
            self.model.ops = qse_kernels.invariant_ops()
            return "invariant"
        self.model.ops = qse_kernels.triton_ops()
        return "triton"

    def round_rows_alike(self) -> None:
        """Make a decode round's row round as a speculative verify's rows do, where the op set would not: on
        the production kernels (triton) every call of 1 to 32 rows goes through the skinny GEMM, the one-row
        projections and the round's head too (qse_kernels.rows_alike), so speculative greedy decoding emits
        plain decoding's ids wherever a round holds 32 rows or fewer. The naive and invariant op sets already
        round a row the same in any call. Idempotent; before any graph is captured (a captured graph keeps the
        calls it captured)."""
        if self.kernels == "triton" and not getattr(self.model.ops, "rows_alike", False):
            import qse_kernels

            qse_kernels.rows_alike(self.model.ops)

    # ---- hot verbs ---------------------------------------------------------------------------
    def new_cache(self, kv=None) -> SequenceCache:
        return self.model.new_cache(kv=kv)

    def forward(self, cache: SequenceCache, ids: torch.Tensor, logits: str = "last",
                logit_row: int | None = None, taps: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor | None, float]:
        """Read ids on top of cache; returns (logits, device ms). taps: the model's tap buffers (new_taps) filled
        for every row (its last layer then runs for every row, where "last" alone runs it for the last one)."""
        watch = Stopwatch(self.device)
        with watch.measure():  # (host ids go to the device inside: checked there first, pinned ones without a wait)
            if taps is None:
                out = self.model.forward(ids, cache, logits, logit_row=logit_row)
            else:
                out = self.model.forward(ids, cache, logits, logit_row=logit_row, taps=taps)
        return out, watch.gpu_ms

    def prefill(self, cache: SequenceCache, ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, float]:
        """Read ids on top of cache in pieces of `chunk` rows; returns the last row's logits and the device ms.
        A whole prompt read in one forward holds every row's activations at once; in pieces it holds one
        piece's, whatever the prompt's length."""
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
        if ids.numel() == 0:
            raise ValueError("empty input: at least one token id is needed")
        total_ms, logits = 0.0, None
        for first in range(0, ids.shape[0], chunk):
            piece = ids[first : first + chunk]
            last = first + chunk >= ids.shape[0]
            logits, ms = self.forward(cache, piece, "last" if last else "none")
            total_ms += ms
        return logits, total_ms

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ids_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def host_ids(self, ids: list[int]) -> torch.Tensor:
        """ids as a host tensor for forward (pinned on CUDA): forward checks them on the host and sends them
        without a wait, where a device tensor's check reads it back and a pageable copy synchronises the
        stream, so the launches could not run ahead of work already on the device."""
        host = torch.tensor(ids, dtype=torch.long)
        return host.pin_memory() if self.device.type == "cuda" else host

    # ---- cold verbs --------------------------------------------------------------------------
    # A state's tensors are the model adapter's to name (`manifest()`); these verbs only walk its list.
    def manifest(self) -> StateManifest:
        """Every tensor of a sequence's state, as the model's adapter lists it (and its signature)."""
        return self._manifest

    def cost(self, length: int) -> int:
        """The bytes of a sequence's state at `length` tokens (cost(0): the fixed-size sections alone)."""
        return self._manifest.cost(length)

    def state_bytes_per_token(self) -> int:
        """The bytes one more token adds to a state (its KV rows): what a KV pool is sized by."""
        return self._manifest.view_nbytes_per_token

    def cache_state(self, cache: SequenceCache, length: int | None = None) -> ModelState:
        """The cache as a ModelState (copies): the manifest's sections, and its views' rows [0, length)."""
        length = cache.length if length is None else length
        held = cache.state_tensors()
        sections = {t.name: held[t.index].clone() for t in self._manifest.sections}
        views, rows = {}, {}
        for t in self._manifest.views:
            if not length:
                views[t.name] = torch.empty((0, *t.shape), dtype=t.dtype, device=self.device)
                continue
            if t.index not in rows:  # one read a KV slot (a paged read gathers its pages)
                rows[t.index] = cache.kv.read(t.index, length)
            views[t.name] = rows[t.index][t.part].clone()
        return ModelState(sections=sections, views=views, length=length)

    def restore_cache(self, state: ModelState, kv) -> SequenceCache | None:
        """A cache holding `state`, KV rows written into `kv`; None if kv has no room. A state that is not
        what this model's manifest lists raises StateMismatch."""
        self._manifest.check(state)
        cache = self.new_cache(kv=kv)
        if state.length and not kv.ensure(state.length):
            return None
        held = cache.state_tensors()
        # copies from the host are queued without a wait each (a wait a tensor left the link idle between
        # them), and waited for once at the end: the caller may free or reuse the host buffers on return
        from_host = False
        for t in self._manifest.sections:
            src = state.sections[t.name]
            from_host |= src.device != held[t.index].device
            held[t.index].copy_(src, non_blocking=True)
        if state.length:
            for slot, names in self._manifest.kv_slots().items():
                srcs = [state.views[name] for name in names]
                from_host |= any(x.device != self.device for x in srcs)
                kv.write(slot, 0, *(x.to(self.device, non_blocking=True) for x in srcs))
        if from_host and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        cache.length = state.length
        return cache
