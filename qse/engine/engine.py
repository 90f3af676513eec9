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
from ..models.state import ModelState


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
    def __init__(self, resolved: ResolvedModel, kernels: str | None = None):
        self.resolved = resolved
        self.model = resolved.model
        self.chat = resolved.chat
        self.cfg = self.model.cfg
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.name = resolved.name
        self.kernels = self._pick_kernels(kernels or "auto")

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

    # ---- hot verbs ---------------------------------------------------------------------------
    def new_cache(self, kv=None) -> SequenceCache:
        return self.model.new_cache(kv=kv)

    def forward(self, cache: SequenceCache, ids: torch.Tensor, logits: str = "last",
                logit_row: int | None = None) -> tuple[torch.Tensor | None, float]:
        """Read ids on top of cache; returns (logits, device ms)."""
        watch = Stopwatch(self.device)
        with watch.measure():
            out = self.model.forward(ids.to(self.device), cache, logits, logit_row=logit_row)
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

    # ---- cold verbs --------------------------------------------------------------------------
    def state_bytes_per_token(self) -> int:
        cfg = self.cfg
        return 2 * len(cfg.attention_layers) * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def recurrent_nbytes(self) -> int:
        cfg = self.cfg
        n = len(cfg.gdn_layers)
        rec = n * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        conv = n * (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * torch.empty((), dtype=self.dtype).element_size()
        return rec + conv

    def cache_state(self, cache: SequenceCache, length: int | None = None) -> ModelState:
        """The cache as a ModelState (copies): sections = GDN state, views = KV rows [0, length)."""
        length = cache.length if length is None else length
        sections = {}
        for i, t in enumerate(cache.recurrent):
            sections[f"gdn.{i}.recurrent"] = t.clone()
        for i, t in enumerate(cache.conv):
            sections[f"gdn.{i}.conv"] = t.clone()
        views = {}
        for slot in range(len(self.cfg.attention_layers)):
            k, v = cache.kv.read(slot, length) if length else self._empty_rows()
            views[f"kv.{slot}.k"] = k.clone()
            views[f"kv.{slot}.v"] = v.clone()
        return ModelState(sections=sections, views=views, length=length)

    def _empty_rows(self):
        shape = (0, self.cfg.num_key_value_heads, self.cfg.head_dim)
        e = torch.empty(shape, dtype=self.dtype, device=self.device)
        return e, e

    def state_signature(self) -> str:
        return self.cache_state(self.new_cache(), 0).signature()

    def restore_cache(self, state: ModelState, kv) -> SequenceCache | None:
        """A cache holding `state`, KV rows written into `kv`; None if kv has no room."""
        state.check_compatible(self.state_signature())
        cache = self.new_cache(kv=kv)
        if state.length and not kv.ensure(state.length):
            return None
        for i, t in enumerate(cache.recurrent):
            t.copy_(state.sections[f"gdn.{i}.recurrent"])
        for i, t in enumerate(cache.conv):
            t.copy_(state.sections[f"gdn.{i}.conv"])
        for slot in range(len(self.cfg.attention_layers)):
            if state.length:
                kv.write(slot, 0, state.views[f"kv.{slot}.k"].to(self.device), state.views[f"kv.{slot}.v"].to(self.device))
        cache.length = state.length
        return cache
