"""qse_kernels' package surface: the ops namespace, the fingerprint, and a Triton-free import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import qse_kernels


def test_triton_ops_cover_the_model_ops():
    from qse.models.qwen3_5.model import default_ops

    ops = qse_kernels.triton_ops()
    # head_row (one row's fp32 logits) and fp8_matmul (FP8 block weights as stored) are optional: the model
    # uses them when the op set has them (the naive set dequantises FP8 weights at each use)
    assert set(vars(ops)) - {"head_row", "fp8_matmul"} == set(vars(default_ops()))
    assert set(vars(qse_kernels.invariant_ops())) - {"head_rows", "fp8_matmul"} == set(vars(default_ops()))
    assert all(callable(fn) for fn in vars(ops).values())
    assert not hasattr(qse_kernels.invariant_ops(), "head_row")  # the invariant head is the same for any rows


def test_available_under_the_interpreter_or_cuda():
    assert qse_kernels.available()


@pytest.mark.parametrize("value", ["1", "true", "True", "on", "yes", "y", "0", "false", "no", ""])
def test_interpreting_reads_the_switch_as_triton_does(monkeypatch, value):
    """The kernels widen 16-bit dot operands under the interpreter: they must agree with Triton on whether
    it is on, however the switch is spelt."""
    from triton import knobs

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert qse_kernels.interpreting() == knobs.runtime.interpret


def test_kernel_fingerprint_is_stable_sha256():
    a, b = qse_kernels.kernel_fingerprint(), qse_kernels.kernel_fingerprint()
    assert a == b and len(a) == 64 and int(a, 16) >= 0


def test_import_needs_no_triton():
    code = "import sys, qse_kernels, qse_kernels.naive; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(qse_kernels.__file__).parents[1])


def test_the_fingerprint_covers_every_twin_and_kernel_source():
    """Every module of the package but its __init__ is in the fingerprint of the op sets that run it: a twin or
    kernel added without being named there would let saved state outlive a change to it."""
    from pathlib import Path

    here = Path(qse_kernels.__file__).parent
    sources = {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
    assert sources == set(qse_kernels.NAIVE_MODULES) | set(qse_kernels.KERNEL_MODULES)
