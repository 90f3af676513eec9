"""`qse shadow-check`: feed a session turn by turn as a live session would, then compare its state
with one fresh prefill of the final ids on the same grid (bit for bit), and question probes with a
fresh prefill on a 4x grid (top token, KL)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ..engine.engine import Engine
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


def load_turns(path: Path, engine: Engine) -> list[dict[str, list[int]]]:
    """JSONL turns: {"prompt_ids": [...]} | {"prompt": text} | {"messages": [...]}, optional "output_ids"."""
    turns = []
    chat = engine.chat
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ShadowError(f"{path}:{lineno}: not valid JSON ({exc})") from None
        if "prompt_ids" in obj:
            prompt = list(obj["prompt_ids"])
        elif "prompt" in obj:
            prompt = chat.tokenizer.encode(obj["prompt"])
        elif "messages" in obj:
            prompt = chat.tokenizer.encode(chat.render(obj["messages"], obj.get("tools")))
        else:
            raise ShadowError(f"{path}:{lineno}: a turn needs prompt_ids, prompt or messages")
        output = list(obj.get("output_ids") or [])
        if "output" in obj and not output:
            output = chat.tokenizer.encode(obj["output"])
        turns.append({"prompt_ids": prompt, "output_ids": output})
    if not turns:
        raise ShadowError(f"{path}: no turns")
    return turns


def _probe_logits(reader: ShadowReader, session_id: str, question_ids: list[int]) -> torch.Tensor:
    session = reader.get(session_id)
    logits, _, _, _ = reader._fork_logits(session, question_ids, None)
    return logits


def run_shadow_check(engine: Engine, session_file: Path, grid: int, num_probes: int = 8,
                     pool_gb: float = 0.0) -> dict[str, Any]:
    turns = load_turns(session_file, engine)
    final_len = max(len(t["prompt_ids"]) + len(t["output_ids"]) for t in turns)
    per_token = engine.state_bytes_per_token()
    # room for the live session, the fresh one, the 4x-grid one and forks
    pool_bytes = int(pool_gb * (1 << 30)) or per_token * (3 * final_len + 16 * grid + 8192)
    reader = ShadowReader(engine, grid=grid, pool_bytes=pool_bytes)
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
    fresh = reader.fresh_prefill(ids_fed, "fresh")
    fresh_s = time.perf_counter() - t1
    equal = reader.state_equal(live, fresh)
    # probes: the live session (grid) against a fresh prefill on a 4x grid
    coarse_reader = ShadowReader(engine, grid=4 * grid, pool_bytes=per_token * (final_len + 16 * grid + 8192))
    coarse = coarse_reader.fresh_prefill(ids_fed, "coarse")
    probes = []
    tok = engine.chat.tokenizer
    for question in PROBES[:num_probes]:
        q_ids = tok.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        a = _probe_logits(reader, sid, q_ids)
        b = _probe_logits(coarse_reader, coarse.session_id, q_ids)
        pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = float((pb.exp() * (pb - pa)).sum())
        probes.append({"question": question, "same_top": int(a.argmax()) == int(b.argmax()), "kl": kl})
    return {
        "model": engine.name, "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
        "grid": grid, "turns": len(turns), "final_ids": len(ids_fed), "committed": live.committed,
        "tail": len(ids_fed) - live.committed, "ids_read": live.stats.ids_read, "chunks_read": live.stats.chunks_read,
        "rollbacks": live.stats.rollbacks, "restarts": live.stats.restarts, "ids_reread": live.stats.ids_reread,
        "bit_equal": all(equal.values()), "equal": equal, "mode": live.mode,
        "probes": probes, "probes_same_top": sum(p["same_top"] for p in probes),
        "probes_max_kl": max((p["kl"] for p in probes), default=None),
        "live_read_s": round(live_s, 3), "fresh_read_s": round(fresh_s, 3),
    }
