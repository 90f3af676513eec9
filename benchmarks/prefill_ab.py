"""An MoE preset's prompt read in chunks (eager Engine.prefill) with programmatic dependent launch off and on,
and the block's combine fused with the next norm and not: whether either moves the chunked prefill.

    python benchmarks/prefill_ab.py [PRESET] [--out DIR]     (GPU; default qwen3.5-35b-a3b)

Prints a JSON row a configuration and chunk size (benchmarks/moe_measure.py's prefill_rows), then writes them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import on_this_machine  # noqa: E402
from benchmarks.moe_measure import prefill_rows  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402

CONFIGS = (("pdl_off_fused", False, True), ("pdl_on_fused", True, True), ("pdl_on_unfused", True, False),
           ("pdl_off_unfused", False, False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", nargs="?", default="qwen3.5-35b-a3b")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--chunks", default="512,4096")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    from qse_kernels import pdl

    device, dtype, cache_dir = on_this_machine()
    engine = Engine(resolve(args.preset, device, dtype, cache_dir, seed=0), kernels="auto")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, engine.cfg.vocab_size, (args.prompt,), generator=gen).tolist()
    fused = getattr(engine.model, "moe_block_add_norm", None)
    before = pdl.ON
    rows = []
    try:
        for name, on, fuse in CONFIGS:
            pdl.ON = on
            if fused is not None:
                engine.model.moe_block_add_norm = fused if fuse else None
            for row in prefill_rows(engine, prompt, [int(c) for c in args.chunks.split(",")]):
                rows.append({"config": name, "pdl_active": pdl.active(), **row})
                print(json.dumps(rows[-1]), flush=True)
    finally:  # the switches as they were found, whatever a configuration raised
        pdl.ON = before
        if fused is not None:
            engine.model.moe_block_add_norm = fused
    write_result({**result_header("triton", device=None if device.type == "cuda" else "cpu"), "preset": args.preset,
                  "kernels": engine.kernels, "rows": rows}, args.out, "prefill_ab")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
