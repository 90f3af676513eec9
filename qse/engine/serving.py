"""The served model's turn: prefill eagerly, then decode one token at a time under one CUDA graph.

The served sequence's KV rows live in a paged pool of the served model's own (so a captured decode
step stays valid as the sequence grows), and its GDN state lives in the graphs' working copy for the
whole turn: after the prefill it is loaded once, every decode step replays the same graph on it, and
at the end of the turn the pages go back to the pool. Where graphs cannot run (no CUDA, the torch
ops, or a prompt the pool cannot hold) the turn runs eagerly on a growing contiguous cache, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.cache import SequenceCache
from .engine import Engine, Stopwatch
from .graphs import ForwardGraphs, capture_mode
from .kv import KVPool, PagedKV

PAGE_ROWS = 512


@dataclass
class ServedSequence:
    cache: SequenceCache
    graphed: bool


class ServedPath:
    def __init__(self, engine: Engine, graphs: bool | str | None = None, pool_bytes: int = 8 << 30):
        """graphs: None = CUDA graphs where the device is CUDA and the kernels are Triton's; True, False;
        or "static" (the graph path's buffers and flow without capturing: CPU tests)."""
        self.engine = engine
        self.graphs: ForwardGraphs | None = None
        self.pool: KVPool | None = None
        capture = capture_mode(engine, graphs, "the served model")
        if capture is not None:
            cfg = engine.cfg
            window_bytes = engine.state_bytes_per_token() * (cfg.max_position_embeddings + PAGE_ROWS)
            self.pool = KVPool.for_budget(min(pool_bytes, window_bytes), PAGE_ROWS, len(cfg.attention_layers),
                                          cfg.num_key_value_heads, cfg.head_dim, engine.dtype, engine.device)
            self.graphs = ForwardGraphs(engine.model, self.pool, capture=capture, max_tokens=1)

    @property
    def mode(self) -> str:
        return "graph" if self.graphs is not None else "eager"

    def warm(self) -> None:
        """Capture the decode step now rather than in the first turn."""
        if self.graphs is not None:
            self.graphs.prepare(1, "last")

    def prefill(self, ids: list[int]) -> tuple[ServedSequence, torch.Tensor, float]:
        """Read the prompt; returns the sequence, the last row's logits [1, vocab] and the device ms."""
        engine = self.engine
        if self.graphs is not None and self.pool.can_allocate(-(-(len(ids) + 1) // PAGE_ROWS)):
            self.graphs.prepare(1, "last")  # a first capture must run before the state is loaded
            cache = engine.new_cache(kv=PagedKV(self.pool))
            try:
                logits, ms = engine.forward(cache, engine.ids_tensor(ids), "last")
            except BaseException:
                cache.kv.release_all()
                raise
            watch = Stopwatch(engine.device)
            with watch.measure():
                self.graphs.load(cache)
            return ServedSequence(cache, True), logits, ms + watch.gpu_ms
        cache = engine.new_cache()
        logits, ms = engine.forward(cache, engine.ids_tensor(ids), "last")
        return ServedSequence(cache, False), logits, ms

    def decode(self, seq: ServedSequence, token: int) -> tuple[torch.Tensor, float]:
        """One token on top of the sequence; returns logits [1, vocab] (valid until the next step) and ms."""
        engine = self.engine
        if not seq.graphed:
            return engine.forward(seq.cache, engine.ids_tensor([token]), "last")
        cache, graphs = seq.cache, self.graphs
        pos = cache.length
        if pos + 1 > engine.cfg.max_position_embeddings:
            raise ValueError(f"position {pos + 1} exceeds the model window {engine.cfg.max_position_embeddings}")
        if pos + 1 > cache.kv.capacity:
            if not cache.kv.ensure(pos + 1):
                raise MemoryError(f"the served KV pool ({self.pool.num_pages} pages) is full at {pos} rows")
            graphs.kv.load(cache.kv)  # the new page into the table the graph reads
        entry = graphs.prepare(1, "last")
        watch = Stopwatch(engine.device)
        with watch.measure():
            logits = graphs.run(entry, [token], pos)
        cache.length = pos + 1
        return logits, watch.gpu_ms

    def finish(self, seq: ServedSequence) -> None:
        """The turn is over: its pages go back to the pool (its state is not kept)."""
        if isinstance(seq.cache.kv, PagedKV):
            seq.cache.kv.release_all()


__all__ = ["ServedPath", "ServedSequence"]
