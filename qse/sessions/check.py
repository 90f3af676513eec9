"""`qse cache-check`: a session fed through the served model's turns, its state moved between the tiers on a
schedule, every turn's first-token logits and kept state compared with a cold prefill, bit for bit."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..engine.engine import Engine
from .grid import GridSessions, SessionError
from .served import TIERS, ServedSessions

# where the session's state goes between turns, by turn number: it stays, goes to the host, goes to disk
SCHEDULE = ("device", "host", "disk")


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
            raise SessionError(f"{path}:{lineno}: not valid JSON ({exc})") from None
        if "prompt_ids" in obj:
            prompt = list(obj["prompt_ids"])
        elif "prompt" in obj:
            prompt = chat.tokenizer.encode(obj["prompt"])
        elif "messages" in obj:
            prompt = chat.tokenizer.encode(chat.render(obj["messages"], obj.get("tools")))
        else:
            raise SessionError(f"{path}:{lineno}: a turn needs prompt_ids, prompt or messages")
        output = list(obj.get("output_ids") or [])
        if "output" in obj and not output:
            output = chat.tokenizer.encode(obj["output"])
        turns.append({"prompt_ids": prompt, "output_ids": output})
    if not turns:
        raise SessionError(f"{path}: no turns")
    return turns


EDIT_IDS = 64  # ids an edited turn drops: an agent's compaction of an old tool output


def with_edits(turns: list[dict[str, list[int]]], grid: int, every: int) -> list[dict[str, Any]]:
    """The turns with an edited copy before every `every`-th one (0: none): the turn's prompt with EDIT_IDS ids
    dropped a grid line and a half below the line the previous turn kept, so the served path must go back to
    a checkpoint under it (a rollback), and the real turn after it goes back again."""
    out: list[dict[str, Any]] = []
    for n, turn in enumerate(turns):
        prompt = turn["prompt_ids"]
        if every and n and n % every == 0:
            kept = len(turns[n - 1]["prompt_ids"]) // grid * grid
            at = kept - grid - grid // 2
            if at > grid and at + EDIT_IDS < len(prompt):
                out.append({"prompt_ids": prompt[:at] + prompt[at + EDIT_IDS:], "output_ids": [], "edited": True})
        out.append({**turn, "edited": False})
    return out


def run_cache_check(engine: Engine, session_file: Path, grid: int, decode_tokens: int = 4,
                    disk_dir: Path | None = None, edit_every: int = 3, chunk_group: int = 1) -> dict[str, Any]:
    """Feed the session's prompts as served turns; between turns the state stays on the device, moves to the
    host, or is parked on disk (SCHEDULE, round robin). Each turn's first-token logits, its greedy tokens and
    the state it kept are compared with a cold prefill of the same prompt on the same grid. edit_every: an
    edited copy of every such turn goes first (`with_edits`), so rollbacks are checked on every session.
    chunk_group: chunks a launch of the served turns may read (the cold prefill reads one at a time)."""
    from ..store import ShadowStore

    turns = with_edits(load_turns(session_file, engine), grid, edit_every)
    longest = max(len(t["prompt_ids"]) for t in turns)
    per_token = engine.state_bytes_per_token()
    # the longest turn, its decode, a few grid chunks of slack, and the scratch pages a chunk group's graph
    # capture keeps (on the GPU; one page a chunk of the largest group)
    pool_bytes = per_token * (longest + decode_tokens + (4 + chunk_group) * grid)
    with tempfile.TemporaryDirectory(prefix="qse-cache-check-") as tmp:
        root = Path(disk_dir) if disk_dir is not None else Path(tmp)
        # the host tier's copies in a pinned arena as the server's are (room for two copies of the session)
        store = ShadowStore(1 << 62, root, host_cap_nbytes=1 << 62, journal=True,
                            host_arena_nbytes=2 * pool_bytes + 16 * engine.cost(0))
        live = ServedSessions(GridSessions(engine, grid=grid, pool_bytes=pool_bytes, residency=store,
                                           recent_checkpoints=4, chunk_group=chunk_group, who="the served model"))
        cold = ServedSessions(GridSessions(engine, grid=grid, pool_bytes=pool_bytes, recent_checkpoints=4,
                                           who="the cold prefill"))
        store.attach(live.book)
        live.warm()
        cold.warm()
        report: list[dict[str, Any]] = []
        for n, turn in enumerate(turns):
            prompt = turn["prompt_ids"]
            if n and live.book.sessions.get("live") is not None:
                where = SCHEDULE[n % len(SCHEDULE)]
                session = live.book.get("live")
                if where == "host":
                    store.move_to_host(live.book, session)
                elif where == "disk":
                    store.park(live.book, session)
            t0 = time.perf_counter()
            first, tokens, start = greedy_turn(live, "live", prompt, decode_tokens)
            live_ms = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            cold_first, cold_tokens, _ = greedy_turn(cold, "cold", prompt, decode_tokens, fresh=True)
            cold_ms = (time.perf_counter() - t1) * 1e3
            state = live.book.state_equal(live.book.get("live"), cold.book.get("cold"))
            report.append({
                "turn": n, "edited": turn["edited"], "prompt_tokens": len(prompt), "cached_tokens": start.cached_tokens,
                "tier": start.tier,
                "rolled_back_to": start.rolled_back_to, "chunks_read": start.chunks_read, "tail": start.tail_tokens,
                "logits_equal": torch.equal(first, cold_first), "tokens_equal": tokens == cold_tokens,
                "state_equal": all(state.values()), "wall_ms": round(live_ms, 3), "cold_wall_ms": round(cold_ms, 3)})
            cold.book.close("cold")
    bit_equal = all(t["logits_equal"] and t["state_equal"] and t["tokens_equal"] for t in report)
    hits = {tier: sum(1 for t in report if t["tier"] == tier) for tier in TIERS}
    return {
        "bit_equal": bit_equal, "turns": len(report), "grid": grid, "chunk_group": chunk_group, "mode": live.mode,
        "kernels": engine.kernels, "model": engine.name, "rollbacks": sum(1 for t in report if t["rolled_back_to"] is not None),
        "hits": hits, "host_arena_fallbacks": store.stats()["host_arena_fallbacks"],
        "cached_tokens": sum(t["cached_tokens"] for t in report),
        "prompt_tokens": sum(t["prompt_tokens"] for t in report), "per_turn": report,
    }


def greedy_turn(served: ServedSessions, sid: str, prompt: list[int], steps: int, fresh: bool = False):
    """A greedy turn of `steps` tokens in session `sid` (`fresh`: closed first, so it starts cold): the first
    token's logits (an fp32 copy), the tokens, and what the turn start found (`ServedSessions.begin`)."""
    if fresh and sid in served.book.sessions:
        served.book.close(sid)
    turn, logits = served.begin(sid, prompt)
    first = logits[-1].float().clone()
    tokens = []
    try:
        for _ in range(steps):
            tokens.append(int(torch.argmax(logits[-1])))
            logits, _ = served.decode(turn, tokens[-1])
    finally:
        served.finish(turn)
    served.engine.synchronize()
    return first, tokens, turn.start


__all__ = ["SCHEDULE", "greedy_turn", "load_turns", "run_cache_check"]
