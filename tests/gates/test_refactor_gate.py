"""The refactor gate: a tiny model's run, every logit and every byte of state, must not move by one bit.

`gate_run.run` takes a tiny model through a prefill, a decode, the reader's read on the grid, a question and
a summary on forks (and their put-back), a rollback, and a park and restore through the disk tier; this
test compares the sha256 of every tensor it produced with `refactor_gate.safetensors`, on the naive twins
and on the Triton kernels (run by Triton's interpreter on the CPU, so that any machine checks them).

A change that is meant to move arithmetic (a kernel's reduction order, a fused op, a torch or Triton
upgrade) re-records the fixture and says why in its commit:

    QSE_GATE_RECORD=1 python -m pytest -q tests/gates/test_refactor_gate.py

(on a CPU machine, the same kind as CI's: the bytes are the CPU's; the fixture's metadata names the torch
and Triton versions and the machine it was recorded with). Everything runs on one torch thread, so the
bytes do not depend on how many cores the machine has.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

import gate_run

FIXTURE = Path(__file__).with_name("refactor_gate.safetensors")
RECORD = os.environ.get("QSE_GATE_RECORD", "") == "1"
VARIANTS = ["naive", "triton"]


def _recorded(kernels: str) -> dict[str, torch.Tensor]:
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing: record it with QSE_GATE_RECORD=1 (see this module's docstring)")
    prefix = kernels + "."
    return {name[len(prefix):]: t for name, t in load_file(FIXTURE).items() if name.startswith(prefix)}


def _metadata() -> dict[str, str]:
    if not FIXTURE.exists():
        return {}
    with safe_open(FIXTURE, "pt") as f:
        return dict(f.metadata() or {})


def _record(kernels: str, results: dict[str, torch.Tensor]) -> None:
    kept = {n: t for n, t in (load_file(FIXTURE).items() if FIXTURE.exists() else []) if not n.startswith(kernels + ".")}
    kept.update({f"{kernels}.{n}": t for n, t in gate_run.digests(results).items()})
    meta = {**_metadata(), f"{kernels}.torch": torch.__version__, f"{kernels}.triton": _triton_version(),
            f"{kernels}.machine": platform.machine()}
    save_file(dict(sorted(kept.items())), FIXTURE, metadata=meta)


def _triton_version() -> str:
    import qse_kernels

    return str(qse_kernels.triton_version())


def _skip_unless_runnable(kernels: str) -> None:
    import qse_kernels

    if kernels == "triton" and not (qse_kernels.interpreting() and qse_kernels.triton_version()):
        pytest.skip("the gate's Triton bytes are the interpreter's on the CPU: run it with TRITON_INTERPRET=1")


@pytest.mark.parametrize("kernels", VARIANTS)
def test_not_a_byte_moves(kernels, cache_dir, one_thread):
    _skip_unless_runnable(kernels)
    results = gate_run.run(kernels)
    if RECORD:
        _record(kernels, results)
    moved = gate_run.moved(results, _recorded(kernels))
    meta = _metadata()
    recorded_with = f"torch {meta.get(kernels + '.torch')}, triton {meta.get(kernels + '.triton')}, {meta.get(kernels + '.machine')}"
    running = f"torch {torch.__version__}, triton {_triton_version()}, {platform.machine()}"
    assert not moved, (f"the refactor gate ({kernels}): {len(moved)} of {len(results)} results moved "
                       f"(recorded with {recorded_with}; this run {running}). A change meant to move arithmetic "
                       f"re-records with QSE_GATE_RECORD=1 and says why in its commit:\n  " + "\n  ".join(moved))


def test_the_run_covers_every_verb_and_puts_forks_back(cache_dir, one_thread):
    """What the gate records: each verb's results are there, and a fork leaves the state as it found it."""
    results = gate_run.run("naive")
    verbs = {name.split(".state.")[0] for name in results if ".state." in name}
    assert {"served.prefill", "served.decode", "reader.read", "reader.ask.put_back", "reader.summary.put_back",
            "reader.rollback", "reader.restore"} <= verbs
    assert results["served.prefill.logits"].shape == (gate_run.GRID + 21, gate_run.VOCAB)
    reads = {n.split(".state.")[1]: t for n, t in results.items() if n.startswith("reader.read.state.")}
    assert reads and any(n.startswith("kv.") for n in reads) and any(n.endswith(".recurrent") for n in reads)
    for fork in ("reader.ask.put_back", "reader.summary.put_back"):
        assert all(torch.equal(results[f"{fork}.state.{n}"], t) for n, t in reads.items())
    # the rollback went back to the prompt's checkpoint, and the restore brought back the rolled-back state
    assert results["reader.rollback.rows"].tolist() == [gate_run.GRID, 2 * gate_run.GRID + 7]
    after = {n.split(".state.")[1]: t for n, t in results.items() if n.startswith("reader.rollback.state.")}
    assert all(torch.equal(results[f"reader.restore.state.{n}"], t) for n, t in after.items())


@pytest.mark.parametrize("op", ["dense_matmul", "rms_norm", "chunk_gated_delta_rule_from_gates", "paged_attention"])
def test_the_gate_fails_when_one_op_moves_by_one_part_in_a_thousand(op, monkeypatch, cache_dir, one_thread):
    """The gate itself: one naive op's result scaled by 1 + 1e-3 moves recorded bytes, and the gate says which."""
    import qse_kernels.naive as naive

    real = getattr(naive, op)

    def perturbed(*args, **kwargs):
        out = real(*args, **kwargs)
        if isinstance(out, tuple):  # (output, state): the output moves
            return (out[0] * (1 + 1e-3), *out[1:])
        return out * (1 + 1e-3)

    monkeypatch.setattr(naive, op, perturbed)
    moved = gate_run.moved(gate_run.run("naive"), _recorded("naive"))
    assert moved and all(m.endswith("bytes moved") for m in moved)
    assert "reader.read.state.kv.0.k: bytes moved" in moved or op == "paged_attention"
    assert any(m.startswith("reader.ask.distribution") for m in moved)
