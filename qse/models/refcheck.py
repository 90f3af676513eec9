"""Teacher-forced agreement of a qse model with the published implementation (transformers)."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import torch

from ..settings import default_cache_dir
from . import FAMILIES, pick_device, pick_dtype, resolve


def run_refcheck(spec: str, device: str, dtype: str, positions: int, seed: int = 0, chunk: int = 0,
                 cache_dir: Path | None = None) -> dict[str, Any]:
    """cache_dir: where the embedded model lives (the entry point's QSE_CACHE_DIR)."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    resolved = resolve(spec, dev, dt, cache_dir if cache_dir is not None else default_cache_dir())
    model = resolved.model
    reference = importlib.import_module(FAMILIES[resolved.family] + ".reference").reference_model(model)
    vocab = resolved.chat.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(vocab, model.cfg.vocab_size), (positions,), generator=gen).to(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        ref = reference(input_ids=ids[None]).logits[0].float()
        ours = model.forward(ids, model.new_cache(), "all")
        result: dict[str, Any] = {}
        if chunk:
            cache = model.new_cache()
            parts = [model.forward(ids[s : s + chunk], cache, "all") for s in range(0, positions, chunk)]
            chunked = torch.cat(parts)
            result["chunked"] = {"chunk": chunk, "max_abs_diff": float((chunked - ref).abs().max()),
                                 "argmax_agreement": float((chunked.argmax(-1) == ref.argmax(-1)).float().mean())}
    agree = (ours.argmax(-1) == ref.argmax(-1)).float()
    top2 = ref.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.5  # positions with a clear winner
    result.update({
        "model": resolved.name, "source": resolved.source, "device": str(dev), "dtype": str(dt).replace("torch.", ""),
        "positions": positions, "argmax_agreement": float(agree.mean()),
        "confident_positions": int(confident.sum()),
        "confident_agreement": float(agree[confident].mean()) if confident.any() else None,
        "max_abs_logit_diff": float((ours - ref).abs().max()),
        "max_rel_logit_diff": float((ours - ref).abs().max() / ref.abs().max()),
        "wall_s": round(time.perf_counter() - t0, 3),
    })
    return result
