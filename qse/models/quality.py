"""The quantisation quality gate: FP8 weights against the BF16 (or FP32) weights they were made from.

Both models read the same ids teacher-forced, in chunks with their caches carried. At every position the
reference's next-token distribution p and the quantised model's q give KL(p || q) and whether their top tokens
agree. The gate passes when the mean KL is at most `max_mean_kl` and the top-1 agreement at least `min_top1`.

Thresholds belong to a weight set: the quantised checkpoint's dir may hold `qse_quality_gate.json`
({"max_mean_kl": ..., "min_top1": ...}); the caller's values override it; DEFAULT_THRESHOLDS fill the rest.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .linear import FP8BlockLinear

THRESHOLDS_FILE = "qse_quality_gate.json"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class QualityGateError(ValueError):
    """The gate cannot run on what it was given (no FP8 weights, other vocabularies, bad thresholds)."""


@dataclass(frozen=True)
class Thresholds:
    max_mean_kl: float = 0.05  # nats
    min_top1: float = 0.9

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_mean_kl) and self.max_mean_kl >= 0):
            raise QualityGateError(f"max_mean_kl must be a finite number of nats >= 0, got {self.max_mean_kl!r}")
        if not 0 <= self.min_top1 <= 1:
            raise QualityGateError(f"min_top1 must be a share in [0, 1], got {self.min_top1!r}")


DEFAULT_THRESHOLDS = Thresholds()


def thresholds_for(model_dir: Path | str, max_mean_kl: float | None = None,
                   min_top1: float | None = None) -> tuple[Thresholds, dict[str, str]]:
    """The weight set's thresholds and where each came from ('caller', the file, or 'default')."""
    values: dict[str, Any] = asdict(DEFAULT_THRESHOLDS)
    source = {k: "default" for k in values}
    path = Path(model_dir) / THRESHOLDS_FILE
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise QualityGateError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or not set(raw) <= set(values):
            raise QualityGateError(f"{path}: expected an object with keys among {sorted(values)}, got {raw!r}")
        for k, v in raw.items():
            values[k], source[k] = float(v), str(path)
    for k, v in (("max_mean_kl", max_mean_kl), ("min_top1", min_top1)):
        if v is not None:
            values[k], source[k] = float(v), "caller"
    return Thresholds(**values), source


def default_text() -> str:
    """The text read when none is given: the files shipped in qse/data (real text and template code)."""
    return "\n".join(p.read_text() for p in sorted(DATA_DIR.iterdir()) if p.is_file())


def num_fp8(model) -> int:
    return sum(isinstance(lin, FP8BlockLinear) for lin in model.lin.values())


@torch.inference_mode()
def compare(quantised, reference, ids: list[int], chunk: int = 256) -> dict[str, Any]:
    """KL(reference || quantised) and top-1 agreement at each of len(ids) teacher-forced positions."""
    if chunk < 1:
        raise QualityGateError(f"chunk must be a positive number of positions, got {chunk}")
    caches = (quantised.new_cache(), reference.new_cache())
    kls, agree = [], 0
    for start in range(0, len(ids), chunk):
        piece = quantised.ids_tensor(ids[start : start + chunk])
        q_logits, _ = quantised.forward(caches[0], piece, "all")
        p_logits, _ = reference.forward(caches[1], piece.to(reference.device), "all")
        log_q = torch.log_softmax(q_logits.double().cpu(), -1)
        log_p = torch.log_softmax(p_logits.double().cpu(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        agree += int((q_logits.argmax(-1).cpu() == p_logits.argmax(-1).cpu()).sum())
    kl = torch.cat(kls)
    return {"positions": len(ids), "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "p99_kl": torch.quantile(kl, 0.99).item(), "top1_agreement": agree / len(ids)}


def run_quality_gate(quantised, reference, ids: list[int], thresholds: Thresholds, chunk: int = 256) -> dict[str, Any]:
    """The gate over two engines (the quantised model's and its source's): the comparison and the verdict."""
    n = num_fp8(quantised.model)
    if n == 0:
        raise QualityGateError(f"{quantised.name} holds no FP8 weights: give the FP8 checkpoint as the model and "
                               "the weights it was made from as the reference")
    if quantised.cfg.vocab_size != reference.cfg.vocab_size:
        raise QualityGateError(f"the models' vocabularies differ ({quantised.cfg.vocab_size} and "
                               f"{reference.cfg.vocab_size}): the reference must be the FP8 weights' source")
    if len(ids) < 2:
        raise QualityGateError(f"the text holds {len(ids)} tokens; the gate needs at least 2")
    t0 = time.perf_counter()
    stats = compare(quantised, reference, ids, chunk)
    passed = stats["mean_kl"] <= thresholds.max_mean_kl and stats["top1_agreement"] >= thresholds.min_top1
    return {"fp8_linears": n, **stats, "thresholds": asdict(thresholds), "pass": passed,
            "wall_s": round(time.perf_counter() - t0, 3)}


__all__ = ["DEFAULT_THRESHOLDS", "QualityGateError", "THRESHOLDS_FILE", "Thresholds", "compare", "default_text",
           "num_fp8", "run_quality_gate", "thresholds_for"]
