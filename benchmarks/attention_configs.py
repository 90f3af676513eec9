#!/usr/bin/env python
"""The attention kernel's pinned tile shape for chunks and questions (T >= 16), against variants: time per
call at the 0.8B's attention shape (H=8, Hkv=2, D=256) for a 512-row chunk and a 320-row question at 32k
and 64k of context, TFLOP/s, and the error against torch's fused attention.

    python benchmarks/attention_configs.py [--out DIR]

A variant replaces qse_kernels.attention._config for T >= 16 (BM, BN, warps, stages) or sets module
constants (MODULE_FLAGS: the TMA loads, the softmax's forms, the program target); every call runs on 512-row pages through paged_attention,
the graph path's kernel. A faster one can become the pinned default (the bits change with it, the same for eager and graph, so a session's state
records nothing new). Writes benchmarks/results/attention_configs-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qse_kernels.attention as attn  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.timing import cuda_us  # noqa: E402

VARIANTS = {
    "default": None,
    "bm64_bn64_w4_s2": dict(BM=64, BN=64, num_warps=4, num_stages=2),
    "bm64_bn64_w4_s3": dict(BM=64, BN=64, num_warps=4, num_stages=3),
    "bm128_bn32_w8_s3": dict(BM=128, BN=32, num_warps=8, num_stages=3),
    "bm128_bn64_w4_s2": dict(BM=128, BN=64, num_warps=4, num_stages=2),
    "bm128_bn128_w8_s1": dict(BM=128, BN=128, num_warps=8, num_stages=1),
    "bm64_bn128_w4_s1": dict(BM=64, BN=128, num_warps=4, num_stages=1),
    "bm64_bn32_w4_s4": dict(BM=64, BN=32, num_warps=4, num_stages=4),
    # the pinned tiles with every K/V tile loaded by per-element addresses (TMA_LOADS off: the default before
    # attention_configs-paged-tma-2026-11-29-h200.json measured the TMA loads faster)
    "no_tma": {"TMA_LOADS": False},
    # the softmax's candidate forms (qse_kernels.attention: LAZY_RESCALE_LOG2, FUSED_SCALE, WARP_SPECIALIZE)
    "lazy8": {"LAZY_RESCALE_LOG2": 8},
    "fused_scale": {"FUSED_SCALE": True},
    "lazy8_fused_scale": {"LAZY_RESCALE_LOG2": 8, "FUSED_SCALE": True},
    "warp_specialize": {"WARP_SPECIALIZE": True},
    "warp_specialize_lazy8_fused_scale": {"WARP_SPECIALIZE": True, "LAZY_RESCALE_LOG2": 8, "FUSED_SCALE": True},
    # one warpgroup a program in 96 KB of shared memory, so two programs share an SM and one's softmax can
    # run under the other's products (twice the K/V tile loads); two waves of such pairs
    "bm64_bn64_w4_s1_pairs": dict(BM=64, BN=64, num_warps=4, num_stages=1, PREFILL_TARGET_PROGRAMS=528),
    "bm64_bn32_w4_s2_pairs": dict(BM=64, BN=32, num_warps=4, num_stages=2, PREFILL_TARGET_PROGRAMS=528),
    "bm64_bn64_w4_s1_pairs_lazy8_fused": dict(BM=64, BN=64, num_warps=4, num_stages=1, PREFILL_TARGET_PROGRAMS=528,
                                              LAZY_RESCALE_LOG2=8, FUSED_SCALE=True),
    # two waves of programs for chunks and questions (the default before PREFILL_TARGET_PROGRAMS was 132)
    "two_waves": {"PREFILL_TARGET_PROGRAMS": 264},
}
# variant keys that set a qse_kernels.attention constant, not a tile size
MODULE_FLAGS = ("TMA_LOADS", "LAZY_RESCALE_LOG2", "FUSED_SCALE", "WARP_SPECIALIZE", "PREFILL_TARGET_PROGRAMS")
PAGE_ROWS = 512  # the reader's page: every call runs on pages, as the graph path does
CASES = [(512, 32768), (320, 32768), (512, 65536)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--variants", default="", help="comma-separated names (default: all); a compiler that may crash "
                   "(warp specialisation) is best run in a process of its own")
    p.add_argument("--tag", default="", help="added to the result's file name")
    args = p.parse_args(argv)
    chosen = [name for name in args.variants.split(",") if name] or list(VARIANTS)
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; expected some of {sorted(VARIANTS)}")
    heads, kv_heads, dim = 8, 2, 256
    real_config = attn._config
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name in chosen:
        variant = VARIANTS[name]
        flags = {k: v for k, v in (variant or {}).items() if k in MODULE_FLAGS}
        tiles = {k: v for k, v in (variant or {}).items() if k not in MODULE_FLAGS}

        def config(num_q, group, head_dim, fixed_tiles=False, _v=tiles):
            cfg = real_config(num_q, group, head_dim, fixed_tiles)
            if _v and num_q * group > 16:
                cfg = dict(cfg, **_v)
            return cfg

        attn._config = config
        saved_flags = {flag: getattr(attn, flag) for flag in flags}
        for flag, value in flags.items():
            setattr(attn, flag, value)
        row = {}
        for num_q, context in CASES:
            total = context + num_q
            q = torch.randn(num_q, heads, dim, device="cuda", generator=gen).bfloat16()
            k = torch.randn(total, kv_heads, dim, device="cuda", generator=gen).bfloat16()
            v = torch.randn(total, kv_heads, dim, device="cuda", generator=gen).bfloat16()
            key = f"{num_q}@{context}"
            pages = -(-total // PAGE_ROWS)
            k_pages = torch.zeros(pages * PAGE_ROWS, kv_heads, dim, device="cuda", dtype=k.dtype)
            v_pages = torch.zeros_like(k_pages)
            k_pages[:total], v_pages[:total] = k, v
            k_pages, v_pages = (x.view(pages, PAGE_ROWS, kv_heads, dim) for x in (k_pages, v_pages))
            table = torch.arange(pages, dtype=torch.int32, device="cuda")
            start = torch.tensor([context], dtype=torch.int32, device="cuda")

            def call():
                return attn.paged_attention(q, k_pages, v_pages, table, start, max_rows=total)

            try:
                out = call()
                mask = torch.arange(total, device="cuda")[None, :] <= (context + torch.arange(num_q, device="cuda"))[:, None]
                ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                     attn_mask=mask[None, None], enable_gqa=True)[0].transpose(0, 1)
                us = cuda_us(call)
                flops = 4 * num_q * heads * dim * (context + (num_q + 1) / 2)
                row[key] = {"us": round(us, 1), "tflop_s": round(flops / us / 1e6, 1),
                            "max_rel_err": float((out.float() - ref.float()).abs().max() / ref.float().abs().max())}
            except Exception as exc:  # noqa: BLE001 - a variant that does not fit is reported
                row[key] = {"error": repr(exc)[:300]}
        for flag, value in saved_flags.items():
            setattr(attn, flag, value)
        rows[name] = row
        print(json.dumps({name: row}), flush=True)
    attn._config = real_config
    result = {**result_header("triton"),
              "shape": {"H": heads, "Hkv": kv_heads, "D": dim}, "variants": rows}
    write_result(result, args.out, "attention_configs" + (f"-{args.tag}" if args.tag else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
