#!/usr/bin/env python
"""Qwen3.5-MoE on qse against its floor and against transformers: decode tokens/s through the engine's rounds,
prefill tokens/s, the bandwidth floor, and transformers' Qwen3_5MoeForCausalLM on the same weights.

    python benchmarks/moe_measure.py [--preset qwen3.5-35b-a3b] [--batches 1,8,32] [--context 4096]
                                     [--prompt 4096] [--prefill-chunks 4096,512] [--out DIR or FILE.json]
    python benchmarks/moe_measure.py --tiny --out DIR       (a tiny MoE on CPU: the flow only, in seconds)

On a preset's random weights (bf16 on CUDA):
- decode: DecodeRounds (qse/engine/rounds.py) at each batch, under the CUDA graph of its bucket, every sequence
  at --context tokens of random KV rows and GDN state (decode cost does not depend on the values), rounds back
  to back on the previous round's device argmax (benchmarks/round_step.py's measure): device ms a round;
- prefill: a --prompt-token prompt read by Engine.prefill onto a paged KV, in one forward or in chunks of each
  --prefill-chunks (the served sessions read whole grid chunks of 512), device ms after one untimed warm read;
- the floor: the bytes a round must read at least, over the HBM bandwidth (nominal 4.8 TB/s for the H200, and
  the bandwidth a device copy measures here): every weight but the experts and the embedding, the embedding's
  rows, the experts a round touches (for B rows of top-k of E experts routed independently, as the random
  router does: E (1 - (1 - k / E)^B) a layer), and each row's GDN state (fp32, read and written) and KV rows;
- the peer: transformers' Qwen3_5MoeForCausalLM built on the very tensors (qwen3_5_moe/reference.py: one copy of
  the weights; qse's pools and graphs are freed first), a --peer-prompt-token prefill, then --peer-steps one-token
  decode steps at batch 1 with its own cache, each timed on the wall to a synchronize.

Goals (issue 31): decode at batch 1 at least half the nominal floor's tokens/s, and at least 10x transformers'.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import PAGE_ROWS, on_this_machine  # noqa: E402
from benchmarks.results_io import result_header, write_result  # noqa: E402
from benchmarks.round_step import decode_rows  # noqa: E402
from qse.engine.engine import Engine  # noqa: E402
from qse.engine.kv import KVPool, PagedKV  # noqa: E402
from qse.models import FAMILIES, ResolvedModel, resolve  # noqa: E402

NOMINAL_HBM_TBPS = 4.8  # the H200's HBM3e
GOAL_FLOOR_SHARE = 0.5
GOAL_X_TRANSFORMERS = 10.0
def tiny_model(cache_dir: Path) -> ResolvedModel:
    from qse.models.qwen3_5_moe import ChatFormat, Qwen35MoeModel, parse_config
    from qse.models.qwen3_5_moe.presets import random_weights, tiny_config_dict

    cfg = parse_config(tiny_config_dict(), where="--tiny")
    model = Qwen35MoeModel(cfg, random_weights(cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    return ResolvedModel(model, ChatFormat(None), "tiny-moe", "preset", "qwen3_5_moe", "tiny-moe:seed0")


def hbm_tbps(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """TB/s of a device copy of nbytes (read plus write), the best of reps."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(reps + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del src, dst
    return 2 * nbytes / best / 1e12


def floor_terms(model, batch: int, context: int) -> dict:
    """The bytes a decode round of `batch` rows at `context` tokens reads at least (the module docstring)."""
    cfg = model.cfg
    experts_nbytes = embed_nbytes = other_nbytes = 0
    for name, t in model.w.items():
        if name.startswith("mtp."):
            continue  # the MTP head's layer: a plain decode round never reads it
        nbytes = t.numel() * t.element_size()
        if ".mlp.experts." in name:
            experts_nbytes += nbytes
        elif name == "embed_tokens.weight":
            embed_nbytes += nbytes
        else:
            other_nbytes += nbytes  # norms, router, shared gate, GDN's conv and gates, an untied head
    other_nbytes += sum(lin.nbytes_per_use for name, lin in model.lin.items() if not name.startswith("mtp."))
    if cfg.tie_word_embeddings:
        other_nbytes += embed_nbytes  # the head reads the whole embedding
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)  # experts a layer, expected
    size = model.embed.element_size()
    gdn = len(cfg.gdn_layers)
    state_nbytes = gdn * (2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                          + 2 * (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * size)
    kv_nbytes = len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * size * (context + 1)
    weights = other_nbytes + batch * cfg.hidden_size * size + experts_nbytes * touched / e
    return {"batch": batch, "experts_touched_a_layer": round(touched, 2), "weights_nbytes": int(weights),
            "state_nbytes": batch * state_nbytes, "kv_nbytes": batch * kv_nbytes,
            "total_nbytes": int(weights + batch * (state_nbytes + kv_nbytes)),
            "active_params_a_token": int((other_nbytes + cfg.hidden_size * size + experts_nbytes * k / e) / size)}


def prefill_rows(engine: Engine, prompt: list[int], chunks: list[int]) -> list[dict]:
    """The prompt read by Engine.prefill in pieces of each chunk onto a fresh paged KV: device ms (warm first)."""
    cfg = engine.cfg
    pool = KVPool(-(-len(prompt) // PAGE_ROWS) + 1, PAGE_ROWS, len(cfg.attention_layers), cfg.num_key_value_heads,
                  cfg.head_dim, engine.dtype, engine.device)
    ids = engine.ids_tensor(prompt)
    rows = []
    for chunk in chunks:
        times = []
        for _ in range(2):  # the first compiles and warms the kernels of this chunk's shapes
            kv = PagedKV(pool)
            _, ms = engine.prefill(engine.new_cache(kv=kv), ids, chunk)
            kv.release_all()
            times.append(ms)
        row = {"prompt": len(prompt), "chunk": chunk, "device_ms": round(times[-1], 3),
               "tokens_per_s": round(len(prompt) * 1e3 / times[-1], 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def peer_row(resolved: ResolvedModel, prompt: list[int], steps: int) -> dict:
    """transformers on the same tensors: a prefill of the prompt, then `steps` one-token steps at batch 1 (the
    first untimed), each timed on the wall to a synchronize; its prefill's last-row argmax against qse's."""
    import transformers

    model = resolved.model
    hf = importlib.import_module(FAMILIES[resolved.family] + ".reference").reference_model(model)
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf(input_ids=ids, use_cache=True)
        sync()
        prefill_s = time.perf_counter() - t0
        theirs = out.logits[0, -1].float()
        ours = model.forward(ids[0], model.new_cache(capacity=len(prompt) + 1), "last")[-1]
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            out = hf(input_ids=token, past_key_values=past, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    return {"transformers": transformers.__version__,
            "experts_implementation": getattr(hf.config, "_experts_implementation", None), "prompt": len(prompt),
            "prefill_s": round(prefill_s, 4), "steps": steps,
            "decode_ms_a_step": round(step_s * 1e3, 3), "tokens_per_s": round(1 / step_s, 2),
            "prefill_argmax_equal": bool(int(theirs.argmax()) == int(ours.argmax())),
            "prefill_max_abs_logit_diff": round(float((theirs - ours).abs().max()), 5)}


def write(result: dict, out: str) -> None:
    if out.endswith(".json"):
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps({"written": str(path)}))
    else:
        write_result(result, out, "moe_measure")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-35b-a3b", help="an MoE preset or checkpoint dir")
    p.add_argument("--batches", default="1,8,32", help="running sequences a round, comma separated")
    p.add_argument("--context", type=int, default=4096, help="tokens each decoding sequence holds")
    p.add_argument("--rounds", type=int, default=50, help="timed rounds a batch size")
    p.add_argument("--prompt", type=int, default=4096, help="prefill prompt tokens")
    p.add_argument("--prefill-chunks", default="4096,512", help="prefill piece sizes, comma separated")
    p.add_argument("--peer-prompt", type=int, default=32, help="transformers' prompt tokens before its decode")
    p.add_argument("--peer-steps", type=int, default=8, help="transformers' timed decode steps (0: no peer)")
    p.add_argument("--kernels", default="auto", help="naive, triton, invariant, auto (triton on cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny MoE on CPU: the flow only")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="a dir, or a file ending .json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(c) for c in args.prefill_chunks.split(",")]
    if min(batches) < 1 or min(chunks) < 1:
        p.error(f"--batches and --prefill-chunks must be >= 1, got {args.batches!r} and {args.prefill_chunks!r}")
    device, dtype, cache_dir = on_this_machine()
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        batches, chunks = [b for b in batches if b <= 4] or [1], [c for c in chunks if c <= 64] or [16]
        args.context, args.rounds, args.prompt, args.peer_prompt = 70, 2, 48, 8
        args.peer_steps = min(args.peer_steps, 2)
        resolved = tiny_model(cache_dir)
    else:
        resolved = resolve(args.preset, device, dtype, cache_dir, seed=args.seed)
    if resolved.family != "qwen3_5_moe":
        p.error(f"--preset {args.preset!r} is a {resolved.family} model; this benchmark measures Qwen3.5-MoE")
    engine = Engine(resolved, kernels=args.kernels)
    model, cfg = engine.model, engine.cfg
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist()

    decode, ran = decode_rows(engine, batches, args.context, args.rounds)
    prefill = prefill_rows(engine, prompt, chunks)
    measured_tbps = hbm_tbps(device, (2 << 30) if device.type == "cuda" else (32 << 20))
    floors = []
    for row in decode:
        terms = floor_terms(model, row["batch"], args.context)
        for name, tbps in (("nominal", NOMINAL_HBM_TBPS), ("measured", measured_tbps)):
            floor_ms = terms["total_nbytes"] / (tbps * 1e12) * 1e3
            terms[f"floor_ms_{name}"] = float(f"{floor_ms:.4g}")
            terms[f"floor_tokens_per_s_{name}"] = round(row["batch"] * 1e3 / floor_ms, 1)
            row[f"x_floor_{name}"] = float(f"{row['tokens_per_s'] / terms[f'floor_tokens_per_s_{name}']:.4g}")
        floors.append(terms)

    peer = None
    if args.peer_steps > 0:  # qse's pools and graphs are gone; the peer's parameters are qse's own tensors
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            peer = peer_row(resolved, prompt[: args.peer_prompt], args.peer_steps)
        except Exception as exc:  # noqa: BLE001 - the peer failing must not lose qse's figures measured above
            peer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"peer": peer}), flush=True)

    one = next((r for r in decode if r["batch"] == 1), None)
    goals = {
        "decode_b1_x_floor_nominal": one["x_floor_nominal"] if one else None,
        f"decode_b1_ge_{GOAL_FLOOR_SHARE}_floor": one["x_floor_nominal"] >= GOAL_FLOOR_SHARE if one else None,
        "decode_b1_x_transformers": (round(one["tokens_per_s"] / peer["tokens_per_s"], 2)
                                     if one and peer and "tokens_per_s" in peer else None),
    }
    x_peer = goals["decode_b1_x_transformers"]
    goals[f"decode_b1_ge_{GOAL_X_TRANSFORMERS:g}x_transformers"] = (None if x_peer is None
                                                                    else x_peer >= GOAL_X_TRANSFORMERS)
    result = {**result_header("triton", "transformers", device=None if device.type == "cuda" else "cpu"),
              "preset": "tiny" if args.tiny else args.preset, "dtype": str(dtype).removeprefix("torch."),
              "kernels": engine.kernels, **ran, "context": args.context, "page_rows": PAGE_ROWS,
              "weights_nbytes": model.weights_nbytes(), "hbm_tbps": {"nominal": NOMINAL_HBM_TBPS,
                                                                     "measured": round(measured_tbps, 3)},
              "decode": decode, "floor": floors, "prefill": prefill, "transformers": peer, "goals": goals}
    write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
