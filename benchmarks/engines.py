"""The engines the benchmarks run: the served model of a served benchmark (the embedded model in fp32 on the CPU
for a tiny smoke run, or a preset in bf16 on CUDA, with the policy read once from the settings: a benchmark is
an entry point), this machine's device, dtype and cache dir for the benchmarks that take what is there, and the
decoding sequences the decode benchmarks time: a KV pool and GDN state of random values (decode cost does not
depend on the values) instead of a prefill."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.models import resolve
from qse.policy import Policy
from qse.settings import SETTINGS


def served_engine(preset: str, tiny: bool) -> tuple[Engine, Policy]:
    """(the engine, the policy): `preset` on CUDA in bf16, or with `tiny` the embedded model on the CPU."""
    device, dtype, spec = ((torch.device("cpu"), torch.float32, "") if tiny
                           else (torch.device("cuda"), torch.bfloat16, preset))
    policy = Policy.from_settings(SETTINGS)
    return Engine(resolve(spec, device, dtype, SETTINGS.cache_dir()), kernels=policy.kernels), policy


def on_this_machine() -> tuple[torch.device, torch.dtype, Path]:
    """CUDA in bf16 where there is a GPU, else the CPU in fp32; the weights' cache dir (QSE_CACHE_DIR, else one
    in /tmp that the benchmarks share)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype, Path(os.environ.get("QSE_CACHE_DIR", "/tmp/qse-bench-cache"))


PAGE_ROWS = 512  # the served sessions' page size (their grid, QSE_SERVED_GRID)


def random_pool(model, num_pages: int, num_slots: int | None = None,
                seed: int = 0) -> tuple[KVPool, torch.Generator]:
    """(a pool of `num_pages` pages of PAGE_ROWS rows for `model`'s KV, every row drawn N(0, 0.5); the device
    generator that drew them, seeded `seed`, for what the caller draws next). model: an Engine or a model (its
    cfg, dtype and device); num_slots: the pool's KV slots, default one an attention layer."""
    cfg = model.cfg
    num_slots = len(cfg.attention_layers) if num_slots is None else num_slots
    pool = KVPool(num_pages, PAGE_ROWS, num_slots, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for t in (pool.k, pool.v):
        t.normal_(0.0, 0.5, generator=gen)
    return pool, gen


def random_sequences(engine: Engine, pool: KVPool, num: int, context: int, gen: torch.Generator) -> list:
    """`num` caches of `context` rows in pages of the pool (their KV whatever the pool holds), their GDN state
    drawn N(0, 0.1) from gen."""
    caches = []
    for _ in range(num):
        cache = engine.new_cache(kv=PagedKV(pool))
        assert cache.kv.ensure(context)
        cache.length = context
        for t in cache.stacked:
            t.normal_(0.0, 0.1, generator=gen)
        caches.append(cache)
    return caches


__all__ = ["PAGE_ROWS", "on_this_machine", "random_pool", "random_sequences", "served_engine"]
