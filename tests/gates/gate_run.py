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

The bytes are only comparable between runs that take the same arithmetic path, and left to itself a CPU picks
its own: torch's vector kernels follow the CPU's capability (AVX-512 on one host, AVX2 on another), MKL's GEMM
and numpy's (Triton's interpreter computes with numpy: OpenBLAS for tl.dot, SIMD loops for exp) pick code paths
by the processor, and thread counts split reductions. So the gate runs in a fresh process (the switches are
read when the libraries start) under a PROFILE that pins each of them to code every x86-64 host runs the same:

    python tests/gates/gate_run.py --profile baseline --out digests.safetensors [--perturb silu_mul ...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

# Every switch a profile sets is read when its library starts: they are set in the environment a gate
# process starts with (pinned_env), never in a process that has computed already.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# numpy's dispatched SIMD targets above a profile's level (names of numpy 2.x, then of 1.x)
_NPY_V3 = "X86_V3 AVX AVX2 FMA3 F16C"
_NPY_V4 = "X86_V4 AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
PROFILES = {
    # what every x86-64 CPU runs: torch's DEFAULT kernels, MKL's SSE2 path, OpenBLAS's Prescott kernels,
    # numpy's baseline loops, oneDNN up to SSE4.1
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Prescott",
                 "NPY_DISABLE_CPU_FEATURES": f"{_NPY_V3} {_NPY_V4}", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    # a second capability, for any CPU with AVX2 (every x86-64 host of the last decade): torch's AVX2 kernels,
    # OpenBLAS's Haswell kernels, numpy up to AVX2; MKL stays on its SSE2 path, the one whose bits MKL
    # promises across vendors (its AVX2 path on an AMD host is not the one on an Intel host)
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Haswell",
             "NPY_DISABLE_CPU_FEATURES": _NPY_V4, "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
# the ops a --perturb may scale by 1 + 2**-10, by op set (the model looks its ops up when an Engine is built)
PERTURBABLE = {"naive": ("dense_matmul", "rms_norm", "chunk_gated_delta_rule_from_gates", "paged_attention",
                         "silu_mul"),
               "triton": ("silu_mul",)}
ONE_PART_IN_1024 = 1 + 2 ** -10

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
    """Every result of the tiny model's run through the verbs, by name."""
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


def moved(now: dict[str, torch.Tensor], recorded: dict[str, torch.Tensor]) -> list[str]:
    """The names whose digests differ from the record, and those only one side has (empty: not a byte moved)."""
    out = [f"{name}: not recorded" for name in now if name not in recorded]
    out += [f"{name}: recorded, not produced" for name in recorded if name not in now]
    out += [f"{name}: bytes moved" for name in now if name in recorded and not torch.equal(now[name], recorded[name])]
    return out


def perturbed(kernels: str, op: str):
    """A context in which `kernels`'s `op` returns its result scaled by 1 + 2**-10 (a tuple's first item)."""
    module = importlib.import_module("qse_kernels.naive" if kernels == "naive" else "qse_kernels.fused")
    real = getattr(module, op)

    def scaled(*args, **kwargs):
        out = real(*args, **kwargs)
        if isinstance(out, tuple):  # (output, state): the output moves
            return (out[0] * ONE_PART_IN_1024, *out[1:])
        return out * ONE_PART_IN_1024

    @contextlib.contextmanager
    def patched():
        setattr(module, op, scaled)
        try:
            yield
        finally:
            setattr(module, op, real)

    return patched()


def pinned_env(profile: str, base: dict | None = None) -> dict[str, str]:
    """The environment of a gate process under `profile`: the profile's switches, one thread, the interpreter."""
    env = dict(os.environ if base is None else base)
    env.update(PROFILES[profile])
    env.update(THREADS)
    env["TRITON_INTERPRET"] = "1"
    return env


def arithmetic_path() -> dict[str, str]:
    """What this process computes with, as the libraries report it (the fixture's metadata, the test's checks)."""
    import numpy

    import qse_kernels

    return {"torch": torch.__version__, "triton": str(qse_kernels.triton_version()), "numpy": numpy.__version__,
            "machine": platform.machine(), "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_cbwr": os.environ.get("MKL_CBWR", ""), "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
            "threads": str(torch.get_num_threads())}


def main(argv: list[str] | None = None) -> int:
    """Run the gate in this process (started under `pinned_env`) and write every variant's digests to --out."""
    p = argparse.ArgumentParser(description="the refactor gate's run under a pinned arithmetic path")
    p.add_argument("--profile", required=True, choices=sorted(PROFILES))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--kernels", nargs="+", default=["naive", "triton"], choices=["naive", "triton"])
    p.add_argument("--perturb", nargs="*", default=[], metavar="KERNELS:OP",
                   help="also run with one op scaled by 1 + 2**-10, e.g. naive:silu_mul")
    args = p.parse_args(argv)
    wrong = {k: v for k, v in PROFILES[args.profile].items() if os.environ.get(k) != v}
    if wrong:
        p.error(f"the process was not started under profile {args.profile!r} (set first: {wrong}); "
                "start it with gate_run.pinned_env")
    for spec in args.perturb:
        kernels, _, op = spec.partition(":")
        if op not in PERTURBABLE.get(kernels, ()):
            p.error(f"--perturb {spec!r}: expected KERNELS:OP, one of "
                    + ", ".join(f"{k}:{o}" for k, ops in PERTURBABLE.items() for o in ops))
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the interpreter's patching once a launch
    from triton_interpreter import patch_once_a_launch

    patch_once_a_launch()  # the same interpreted ops, the same bytes, in half the time
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False  # no oneDNN path in the gate's ops, whatever the build routes to it
    out: dict = {}
    for kernels in args.kernels:
        out.update({f"{kernels}.{n}": t for n, t in digests(run(kernels)).items()})
    for spec in args.perturb:
        kernels, _, op = spec.partition(":")
        with perturbed(kernels, op):
            out.update({f"{spec}.{n}": t for n, t in digests(run(kernels)).items()})
    save_file(out, args.out, metadata=arithmetic_path())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's qse, run as a script
    raise SystemExit(main())
