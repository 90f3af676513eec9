"""qse's kernels: Triton kernels and their naive torch twins. Knows tensors only; imports nothing of qse."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
from pathlib import Path
from types import SimpleNamespace

# The Triton modules, one a kernel family; imported only by triton_ops(), so that importing this package
# needs no Triton and no GPU.
# The torch twins: what the naive op set runs (and every op set falls back on)
NAIVE_MODULES = ("naive", "moe_naive")
KERNEL_MODULES = ("norms", "fused", "conv1d", "gdn_chunk", "gdn_recurrent", "gdn_decode", "attention", "gemm", "gemv",
                  "fp8", "moe", "skinny", "pdl", "counts")

# one-row projections (decode steps) through qse's GEMV instead of cuBLAS, and the logits head of one row;
# pinned from benchmarks/gemv_bench.py on the H200 (see benchmarks/NOTES.md)
GEMV_PROJECTIONS = True
GEMV_HEAD = True
# 2 to 16 rows of 16-bit x (a speculative verify, a small decode round) through qse's skinny GEMM instead of
# cuBLAS; pinned from benchmarks/skinny_bench.py on the H200 (benchmarks/results/skinny_bench-*.json)
SKINNY_PROJECTIONS = True


def triton_version() -> str | None:
    """The installed Triton's version, read without importing it; None when Triton is absent."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def interpreting() -> bool:
    """True when Triton runs its kernels in the interpreter (TRITON_INTERPRET, read as Triton reads it). The
    kernels widen 16-bit dot operands there: the interpreter multiplies them as raw integers."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def available() -> bool:
    """True when the Triton kernels can run here: Triton installed, and a CUDA device or TRITON_INTERPRET=1."""
    if triton_version() is None:
        return False
    if interpreting():
        return True
    import torch

    return torch.cuda.is_available()


def triton_ops() -> SimpleNamespace:
    """The Triton kernels under the names of the model's ops (qse.models.qwen3_5.model.default_ops)."""
    mods = {name: importlib.import_module(f"{__name__}.{name}") for name in KERNEL_MODULES}
    from . import naive

    import torch

    gemv = mods["gemv"].gemv
    skinny = mods["skinny"]

    def dense_matmul(x, w):
        """cuBLAS (faster than our GEMM, but its rounding follows the shape); one row through our GEMV, 2 to
        16 rows of bf16 / fp16 through our skinny GEMM (each row's bits independent of the row count)."""
        if GEMV_PROJECTIONS and x.numel() == x.shape[-1]:
            return gemv(x, w)
        rows = x.numel() // max(x.shape[-1], 1)
        if SKINNY_PROJECTIONS and 2 <= rows <= skinny.TILE_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            return skinny.skinny_matmul(x, w)
        return naive.dense_matmul(x, w)

    def head_row(x, w):
        """The fp32 logits of one row [1, K]."""
        return gemv(x, w, torch.float32)

    ops = SimpleNamespace(
        dense_matmul=dense_matmul,
        rms_norm=mods["norms"].rms_norm,
        add_rms_norm=mods["fused"].add_rms_norm,
        qk_norm_rotary=mods["fused"].qk_norm_rotary,
        qk_norm_rotary_paged=mods["fused"].qk_norm_rotary_paged,
        silu_mul=mods["fused"].silu_mul,
        sigmoid_gate=mods["fused"].sigmoid_gate,
        gated_rms_norm=mods["norms"].gated_rms_norm,
        causal_conv1d=mods["conv1d"].causal_conv1d,
        chunk_gated_delta_rule_from_gates=mods["gdn_chunk"].chunk_gated_delta_rule_from_gates,
        recurrent_gated_delta_rule_from_gates=mods["gdn_recurrent"].recurrent_gated_delta_rule_from_gates,
        attention=mods["attention"].attention,
        paged_attention=mods["attention"].paged_attention,
        fp8_matmul=mods["fp8"].fp8_matmul,  # FP8 block weights (qse.models.linear.FP8BlockLinear) as stored
        qk_norm_rotary_paged_rows=mods["fused"].qk_norm_rotary_paged_rows,
        paged_decode_attention=mods["attention"].paged_decode_attention,
        causal_conv1d_slots=mods["conv1d"].causal_conv1d_slots,
        recurrent_gated_delta_rule_slots=mods["gdn_recurrent"].recurrent_gated_delta_rule_slots,
        # a round's GDN layer between its projections: one launch with gdn_decode.FUSED, else the three above
        gdn_decode_slots=mods["gdn_decode"].gdn_decode_slots,
        # a verify's rows (all T of each of B sequences) in one launch each, with the bits of the _slots steps
        causal_conv1d_window=mods["conv1d"].causal_conv1d_window,
        recurrent_gated_delta_rule_window=mods["gdn_recurrent"].recurrent_gated_delta_rule_window,
    )
    if GEMV_HEAD:
        ops.head_row = head_row
    return ops


def rows_alike(ops: SimpleNamespace) -> None:
    """triton_ops' `ops`, in place, with every call of 1 to 32 rows of 16-bit x through the skinny GEMM: the
    projections (the one-row GEMV's rows too) and the fp32 head of a decode round (`head_rows`). A row's bits
    then depend on its values alone in any round of up to 32 rows (8 sequences verifying 4 rows each), so a
    plain round's row and a speculative verify's row of the same token round alike on the production kernels
    (DecodeRounds asks for it where it verifies). Past 32 rows the calls go to cuBLAS as before. A one-row
    projection costs a little more than the GEMV's (skinny_bench: 3.67 against 3.54 ms for the 9B's a forward)."""
    import torch

    skinny = importlib.import_module(f"{__name__}.skinny")
    base = ops.dense_matmul
    sixteen = (torch.bfloat16, torch.float16)

    def dense_matmul(x, w):
        if x.dtype in sixteen and 1 <= x.numel() // max(x.shape[-1], 1) <= skinny.MAX_ROWS:
            return skinny.skinny_matmul(x, w)
        return base(x, w)

    def head_rows(x, w):
        if x.dtype in sixteen and 1 <= x.shape[0] <= skinny.MAX_ROWS:
            return skinny.skinny_matmul(x, w, torch.float32)
        return torch.mm(x, w.t(), out_dtype=torch.float32) if x.is_cuda else torch.nn.functional.linear(x.float(), w.float())

    ops.dense_matmul, ops.head_rows = dense_matmul, head_rows
    ops.rows_alike = True


def invariant_ops() -> SimpleNamespace:
    """triton_ops with every op grid-invariant: a row's result never depends on how many rows a call holds
    (qse's GEMM instead of cuBLAS, attention with one tile shape and constant splits). A session read on
    one grid then equals, bit for bit, the same session read on any other grid, and so do the answers."""
    ops = triton_ops()
    if hasattr(ops, "head_row"):
        del ops.head_row  # the model's own head: one row or many, the same GEMM
    import torch

    gemm = importlib.import_module(f"{__name__}.gemm")
    attention = importlib.import_module(f"{__name__}.attention")
    ops.dense_matmul = gemm.dense_matmul
    ops.attention = attention.attention_invariant
    ops.paged_attention = attention.paged_attention_invariant
    ops.fp8_matmul = importlib.import_module(f"{__name__}.fp8").fp8_gemm  # one row or many, the same GEMM
    ops.paged_decode_attention = attention.paged_decode_attention_invariant
    # a batched decode's fp32 logits through the same GEMM (torch's head picks its algorithm by the row count)
    ops.head_rows = lambda x, w: gemm.dense_matmul(x, w, torch.float32)
    return ops


def kernel_fingerprint(ops: str = "triton") -> str:
    """sha256 over the sources of the kernels op set `ops` runs, and the Triton version where it runs
    Triton: state written by one build is read only by the same build (the disk tier keeps it in each file).
    The naive twins' state depends on their source and torch alone: installing or upgrading Triton (the
    test extras do) must not refuse the sessions a CPU server saved."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    # the Triton op sets call the naive twins too (cuBLAS's GEMM through torch)
    for name in NAIVE_MODULES if ops == "naive" else (*NAIVE_MODULES, *KERNEL_MODULES):
        digest.update(name.encode() + b"\0")
        digest.update((here / f"{name}.py").read_bytes())
    if ops != "naive":
        digest.update(b"triton\0" + str(triton_version()).encode())
    return digest.hexdigest()


__all__ = ["KERNEL_MODULES", "NAIVE_MODULES", "available", "interpreting", "invariant_ops", "kernel_fingerprint", "triton_ops", "triton_version"]
