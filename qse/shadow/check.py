"""`qse shadow-check`: feed a session turn by turn as a live session would, then compare its state
with one fresh prefill of the final ids on the same grid (bit for bit), and question probes with a
fresh prefill on a 4x grid (top token, KL)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..engine.engine import Engine
from ..models import ResolvedModel
from ..sessions.check import load_turns
from .reader import ShadowError, ShadowReader

PROBES = [
    "What is this session about? Answer in one word.",
    "Which programming language appears most? Answer with one word.",
    "Was the last request a question or an instruction?",
    "Name one file mentioned above.",
    "Is the user satisfied so far? Yes or no.",
    "What should happen next?",
    "Summarise the last turn in three words.",
    "Which tool was called most recently?",
]


def _probe_logits(reader: ShadowReader, session_id: str, question_ids: list[int]) -> torch.Tensor:
    session = reader.get(session_id)
    logits, _, _, _ = reader._fork_logits(session, question_ids, None)
    return logits


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the two softmaxes."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum())


def _margin(logits: torch.Tensor) -> float:
    """The gap between the top two logits: a top token flips only where noise is as large as this."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def cast_twin(engine: Engine, dtype: torch.dtype) -> Engine:
    """The same weights cast to `dtype` (an upcast is exact), on the torch ops."""
    from ..models.linear import DenseLinear

    model = engine.model
    for name, lin in model.lin.items():
        if not isinstance(lin, DenseLinear):
            raise ShadowError(f"--noise-floor handles dense weights only; {name} is {type(lin).__name__}")
    twin = model.cast(dtype)  # the family builds its own twin: nothing here names it
    r = engine.resolved
    tag = str(dtype).replace("torch.", "")
    return Engine(ResolvedModel(twin, r.chat, r.name, r.source, r.family, f"{r.weights_id}:{tag}"), kernels="naive")


def fp32_twin(engine: Engine) -> Engine:
    """The dtype's noise floor: the same weights, upcast exactly, in fp32."""
    return cast_twin(engine, torch.float32)


def run_shadow_check(engine: Engine, session_file: Path, grid: int, num_probes: int = 8,
                     pool_gb: float = 0.0, noise_floor: bool = False, chunk_group: int = 1) -> dict[str, Any]:
    turns = load_turns(session_file, engine)
    final_len = max(len(t["prompt_ids"]) + len(t["output_ids"]) for t in turns)
    per_token = engine.state_bytes_per_token()
    # room for the live session, the fresh one, the 4x-grid one and forks
    pool_bytes = int(pool_gb * (1 << 30)) or per_token * (3 * final_len + 16 * grid + 8192)
    # the live session reads in chunk groups (QSE_SHADOW_CHUNK_GROUP), the fresh prefill one chunk at a time:
    # bit equality then also says the groups' skewed streams read the bits of the contract's own definition
    reader = ShadowReader(engine, grid=grid, pool_bytes=pool_bytes, chunk_group=chunk_group)
    t0 = time.perf_counter()
    sid = "live"
    ids_fed = []
    for turn in turns:
        prompt = turn["prompt_ids"]
        reader.feed(sid, prompt, prompt_end=len(prompt))
        reader.read_all(sid)
        if turn["output_ids"]:
            ids_fed = prompt + turn["output_ids"]
            reader.feed(sid, ids_fed)
            reader.read_all(sid)
        else:
            ids_fed = prompt
    live = reader.get(sid)
    live_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    fresh = reader.fresh_prefill(ids_fed, "fresh", group=1)
    fresh_s = time.perf_counter() - t1
    equal = reader.state_equal(live, fresh)
    # probes: the live session (grid) against a fresh prefill on a 4x grid
    coarse_reader = ShadowReader(engine, grid=4 * grid, pool_bytes=per_token * (final_len + 16 * grid + 8192))
    coarse = coarse_reader.fresh_prefill(ids_fed, "coarse")
    twin_reader = None
    if noise_floor:
        twin = fp32_twin(engine)
        twin_reader = ShadowReader(twin, grid=grid, pool_bytes=twin.state_bytes_per_token() * (final_len + 16 * grid + 8192),
                                   graphs=False)
        twin_reader.fresh_prefill(ids_fed, "fp32")
    probes = []
    for question in PROBES[:num_probes]:
        q_ids = engine.chat.question_ids(question)
        a = _probe_logits(reader, sid, q_ids)
        b = _probe_logits(coarse_reader, coarse.session_id, q_ids)
        probe = {"question": question, "same_top": int(a.argmax()) == int(b.argmax()), "kl": _kl(b, a),
                 "top_margin": round(_margin(a), 5), "top_margin_4x": round(_margin(b), 5)}
        if twin_reader is not None:
            c = _probe_logits(twin_reader, "fp32", q_ids)
            probe["kl_vs_fp32"] = _kl(c, a)
            probe["same_top_as_fp32"] = int(a.argmax()) == int(c.argmax())
        probes.append(probe)
    return {
        "model": engine.name, "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
        "grid": grid, "turns": len(turns), "final_ids": len(ids_fed), "committed": live.committed,
        "tail": len(ids_fed) - live.committed, "ids_read": live.stats.ids_read, "chunks_read": live.stats.chunks_read,
        "rollbacks": live.stats.rollbacks, "restarts": live.stats.restarts, "ids_reread": live.stats.ids_reread,
        "bit_equal": all(equal.values()), "equal": equal, "mode": live.mode, "chunk_group": reader.chunk_group,
        "probes": probes, "probes_same_top": sum(p["same_top"] for p in probes),
        "probes_max_kl": max((p["kl"] for p in probes), default=None),
        "probes_max_kl_vs_fp32": max((p["kl_vs_fp32"] for p in probes), default=None) if noise_floor else None,
        "live_read_s": round(live_s, 3), "fresh_read_s": round(fresh_s, 3),
    }
