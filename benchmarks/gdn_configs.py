#!/usr/bin/env python
"""The GDN chunk kernel's pinned configurations, timed per kernel at the 0.8B shape of one grid chunk
(T=512, Hk=Hv=16, Dk=Dv=128), and whether each variant gives the default's bits.

    python benchmarks/gdn_configs.py [--out DIR]

A variant changes module constants of qse_kernels.gdn_chunk (launch shapes, warps); a faster one that
keeps the bits can become the pinned default. Writes benchmarks/results/gdn_configs-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qse_kernels.gdn_chunk as gdn  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402

VARIANTS = {
    "default": {},
    "prepare_warps8": {"PREPARE_NUM_WARPS": 8},
    "scan_bv8": {"SCAN_BLOCK_V": 8},
    "scan_bv32": {"SCAN_BLOCK_V": 32},
    "scan_bv32_warps8": {"SCAN_BLOCK_V": 32, "SCAN_NUM_WARPS": 8},
    "scan_stages1": {"SCAN_NUM_STAGES": 1},
    "output_bv64": {"OUTPUT_BLOCK_V": 64},
    "output_warps8": {"OUTPUT_NUM_WARPS": 8},
    "tf32_one_product": {"DOT_PRECISION": "tf32", "OUTPUT_DOT_PRECISION_16BIT": "tf32"},  # scale only: state error ~1e-3
    # the bf16 output's products through three tf32 products, as pinned before 2026-11-29 (the state keeps its bits)
    "output_products_tf32x3": {"OUTPUT_DOT_PRECISION_16BIT": "tf32x3"},
    # the prepare kernel's products on the normalised rows in fp32 (three tf32 products), as before v8
    "normalised_rows_tf32x3": {"EXACT_16BIT_PRODUCTS": False},
}


def inputs(num_tokens=512, hk=16, hv=16, dk=128, dv=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_tokens, hk, dk, device="cuda", generator=gen).bfloat16()
    k = torch.randn(num_tokens, hk, dk, device="cuda", generator=gen).bfloat16()
    v = torch.randn(num_tokens, hv, dv, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(num_tokens, hv, device="cuda", generator=gen) * 0.5
    beta = torch.rand(num_tokens, hv, device="cuda", generator=gen)
    state = torch.randn(hv, dk, dv, device="cuda", generator=gen) * 0.1
    return q, k, v, g, beta, state


def per_kernel_us(args, iters=30) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        gdn.chunk_gated_delta_rule(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            gdn.chunk_gated_delta_rule(*args)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if "_chunk_" in ev.key and total > 0:
            out[ev.key] = round(total / iters, 2)
    out["sum"] = round(sum(out.values()), 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    data = inputs()
    defaults = {name: getattr(gdn, name) for spec in VARIANTS.values() for name in spec}
    ref_o, ref_s = gdn.chunk_gated_delta_rule(*data)
    from qse_kernels import naive

    exact_o, exact_s = naive.chunk_gated_delta_rule(*(t.double() for t in data))  # the float64 twin
    rows = {}
    for variant, spec in VARIANTS.items():
        for name, value in defaults.items():
            setattr(gdn, name, value)
        for name, value in spec.items():
            setattr(gdn, name, value)
        try:
            o, s = gdn.chunk_gated_delta_rule(*data)
            rows[variant] = {"us": per_kernel_us(data), "same_bits": bool(torch.equal(o, ref_o) and torch.equal(s, ref_s)),
                             "same_state_bits": bool(torch.equal(s, ref_s)),
                             "state_max_abs_diff": float((s - ref_s).abs().max()),
                             "output_max_rel_diff": float(((o.float() - ref_o.float()).norm() / ref_o.float().norm())),
                             "state_rel_err_vs_float64": float((s.double() - exact_s).abs().max() / exact_s.abs().max()),
                             "output_rel_err_vs_float64": float((o.double() - exact_o).norm() / exact_o.norm())}
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
            rows[variant] = {"error": repr(exc)[:500]}
        print(json.dumps({variant: rows[variant]}), flush=True)
    for name, value in defaults.items():
        setattr(gdn, name, value)
    result = {**result_header("triton"),
              "shape": {"T": 512, "Hk": 16, "Hv": 16, "Dk": 128, "Dv": 128}, "variants": rows}
    write_result(result, args.out, "gdn_configs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
