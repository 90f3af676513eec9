"""The refactor gate's run: a tiny model through every verb that keeps state, every result as bytes.

`run(kernels)` builds a tiny Qwen3.5-shaped model (random weights from a fixed seed, fp32 on the CPU) on
an op set ("naive": the torch twins; "triton": qse's kernels, interpreted on the CPU) and returns, in
order, every logit and every tensor of state after:

    served.prefill    the served path's prefill (contiguous KV): logits of every row, the whole state
    served.decode     a greedy decode step: its logits, then the state
    reader.read       the reader feeds a session and reads it on the grid (paged KV, a prompt checkpoint)
    reader.ask        a question on a fork: the letters' distribution; reader.ask.put_back: the state after
    reader.summary    a greedy summary on a fork: its tokens; reader.summary.put_back: the state after
    reader.rollback   the prompt re-rendered below the committed rows: back to the checkpoint, read again
    reader.restore    the session parked to disk and brought back

`digests(results)` turns them into sha256 digests (the fixture holds those, not the tensors).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import torch

GRID = 64
SEED = 20261201
VOCAB = 256  # the letters' ids of the real tokenizer ("A".. are 32..) lie inside
# one layer of each kind, GQA on both (the interpreter runs every Triton program in Python: every row,
# head and layer costs seconds)
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, tie_word_embeddings=False, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=4096, full_attention_interval=2, model_type="qwen3_5_text",
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
LETTERS = ["A", "B", "C", "D", "E", "F", "G", "H"]


def ids_of(n: int, start: int) -> list[int]:
    """n ids spread over the vocabulary (no randomness: the same list everywhere)."""
    return [100 + (start + i * 89) % (VOCAB - 100) for i in range(n)]


def tiny_engine(kernels: str):
    from qse.engine.engine import Engine
    from qse.models import ResolvedModel
    from qse.models.qwen3_5 import ChatFormat, Qwen35Model, parse_config
    from qse.models.qwen3_5.presets import random_weights

    cfg = parse_config(dict(SHAPE), where="the refactor gate's model")
    model = Qwen35Model(cfg, random_weights(cfg, SEED, "cpu", torch.float32), "cpu", torch.float32)
    resolved = ResolvedModel(model, ChatFormat(None), "gate-tiny", "preset", "qwen3_5", f"gate-tiny:{SEED}")
    return Engine(resolved, kernels=kernels)


def _state(out: dict[str, torch.Tensor], prefix: str, engine, cache) -> None:
    state = engine.cache_state(cache)
    for name in sorted(state.sections):
        out[f"{prefix}.state.{name}"] = state.sections[name]
    for name in sorted(state.views):
        out[f"{prefix}.state.{name}"] = state.views[name]


def run(kernels: str) -> dict[str, torch.Tensor]:
    from qse.shadow.reader import ShadowReader
    from qse.store.store import ShadowStore

    engine = tiny_engine(kernels)
    out: dict[str, torch.Tensor] = {}

    # the served path: a prefill of every row's logits, then greedy decode steps
    prompt = ids_of(GRID + 21, 7)
    cache = engine.new_cache()
    logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "all")
    out["served.prefill.logits"] = logits
    _state(out, "served.prefill", engine, cache)
    token = int(logits[-1].argmax())
    logits, _ = engine.forward(cache, engine.ids_tensor([token]), "last")
    out["served.decode.logits"] = logits
    _state(out, "served.decode", engine, cache)

    # the reader: read on the grid, fork, roll back, park and restore
    with tempfile.TemporaryDirectory(prefix="qse-gate-") as disk_dir:
        store = ShadowStore(64 << 20, Path(disk_dir))
        reader = ShadowReader(engine, grid=GRID, pool_bytes=8 << 20, page_rows=GRID, residency=store, graphs=False)
        store.attach(reader)
        ids = ids_of(3 * GRID + 20, 11)
        reader.feed("s", ids, prompt_end=GRID + 5)  # a checkpoint at the line GRID
        reader.read_all("s")
        session = reader.get("s")
        _state(out, "reader.read", engine, session.cache)

        answer = reader.ask("s", ids_of(10, 5), LETTERS)
        out["reader.ask.distribution"] = torch.tensor([answer.distribution[c] for c in LETTERS], dtype=torch.float64)
        _state(out, "reader.ask.put_back", engine, session.cache)
        summary = reader.summarize("s", ids_of(6, 3), max_tokens=2)
        out["reader.summary.tokens"] = torch.tensor(summary.token_ids, dtype=torch.int64)
        _state(out, "reader.summary.put_back", engine, session.cache)

        rerendered = ids[: 2 * GRID + 7] + ids_of(GRID + 3, 23)  # differs inside the second chunk
        report = reader.feed("s", rerendered)
        out["reader.rollback.rows"] = torch.tensor([report.rolled_back_to, report.first_diff], dtype=torch.int64)
        reader.read_all("s")
        _state(out, "reader.rollback", engine, session.cache)

        if not store.park(reader, session):
            raise RuntimeError("the gate could not park its session")
        reader.ensure_resident(session)
        _state(out, "reader.restore", engine, session.cache)
    return out


def digest(t: torch.Tensor) -> bytes:
    """sha256 over the dtype, the shape and every byte of the tensor."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def digests(results: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray(digest(t)), dtype=torch.uint8) for name, t in results.items()}


def moved(results: dict[str, torch.Tensor], recorded: dict[str, torch.Tensor]) -> list[str]:
    """The names whose bytes differ from the record, and those only one side has (empty: not a byte moved)."""
    now = digests(results)
    out = [f"{name}: not recorded" for name in now if name not in recorded]
    out += [f"{name}: recorded, not produced" for name in recorded if name not in now]
    out += [f"{name}: bytes moved" for name in now if name in recorded and not torch.equal(now[name], recorded[name])]
    return out
