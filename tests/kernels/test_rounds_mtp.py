"""The MTP head's drafts inside DecodeRounds (mtp=True) on qse's Triton kernels: captured as CUDA graphs and in the
static flow, the same script of rounds gives the same logits, drafts and head rows bit for bit.

A tiny random Qwen3.5 with an MTP head (presets.tiny_mtp_config_dict, the embedded model's GDN head dims) in bf16:
the embedded default ships none; and a tiny Qwen3.5-MoE with its MoE head (qwen3_5_moe presets.tiny_config_dict)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.kv import KVPool, PagedKV
from qse.engine.rounds import DecodeRounds, mtp_kv_slot, pool_slots_for
from rounds_rig import tiny_mtp_engine

PAGE_ROWS = 64  # the attention kernels' key block divides a page


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,family", [("triton", "dense"), ("invariant", "dense"), ("triton", "moe")])
def test_mtp_drafts_under_cuda_graphs_equal_the_static_flow(kernels, family):
    """Two sequences (60 and 130 rows: page lines crossed) prefilled with the head's rows, then verifies of 2 to
    4 rows at scripted accepted counts, a plain round, and a draft after each (its ids the next verify's rows,
    built on the device; the accepted counts on the device too): captured and uncaptured, the same logits,
    drafts, head rows and GDN states bit for bit. The allocator is churned between rounds, so a graph that
    kept the address of a tensor it does not own reads garbage and fails here."""
    torch.manual_seed(0)
    engine = tiny_mtp_engine(kernels, family)
    cfg = engine.cfg
    prompts = [[(300 + i) % cfg.vocab_size for i in range(n)] for n in (60, 130)]  # (the MoE vocabulary: 328)
    # (accepted counts of this verify or None: a plain round, then the next draft's length k; k = 0: the head
    # reads the round's rows and drafts nothing)
    script = [([1, 0], 3), ([3, 2], 1), ([0, 1], 2), (None, 3), (None, 0), (None, 0), (None, 3), ([2, 3], 3),
              ([0, 0], 2), ([2, 1], 3), ([3, 3], 1)]
    out = {}
    for graphs in (True, "static"):
        pool = KVPool(16, PAGE_ROWS, pool_slots_for(cfg, mtp=True), cfg.num_key_value_heads, cfg.head_dim,
                      engine.dtype, engine.device)
        rounds = DecodeRounds(engine, pool, max_running=2, graphs=graphs, verify_width=4, mtp=True)
        assert rounds.capture == (graphs is True)
        rounds.warm()
        slots, first, drafts = [], [], []
        for prompt in prompts:
            cache = engine.new_cache(kv=PagedKV(pool))
            taps = engine.model.new_taps(len(prompt))
            logits = engine.model.forward(torch.tensor(prompt), cache, "last", taps=taps)
            slot = rounds.admit(cache)
            token = int(logits[-1].argmax())
            slots.append(slot)
            first.append(token)
            drafts.append(rounds.mtp_prefill(slot, prompt[1:] + [token], taps["final_hidden"]))
        nxt = torch.tensor(first, device="cuda")
        rows_in = torch.cat((nxt[:, None], torch.stack(drafts)), 1)
        seen = [rows_in.clone()]
        for accepted, k in script:
            churn = [torch.randn(4096, device="cuda") for _ in range(8)]  # reuse what was freed
            del churn
            if accepted is None:
                logits = rounds.run(slots, rows_in[:, 0].contiguous())
                nxt = logits.argmax(-1)
                made = rounds.draft(slots, nxt, k=k)
            else:
                width = rows_in.shape[1]
                accepted = [min(a, width - 1) for a in accepted]
                logits = rounds.verify(slots, rows_in)
                acc = torch.tensor(accepted, device="cuda")
                nxt = logits.argmax(-1).gather(1, acc[:, None]).squeeze(1)
                rounds.keep(slots, accepted)
                made = rounds.draft(slots, nxt, acc, k=k)
            rows_in = torch.cat((nxt[:, None], made), 1)
            seen += [logits.clone(), made.clone()]
        slot_kv = mtp_kv_slot(cfg)
        for slot in slots:
            cache = rounds._caches[slot]
            pages = torch.tensor(cache.kv.pages, device="cuda")
            seen.append(pool.k[pages, slot_kv].flatten(0, 1)[: cache.length].clone())  # the head's kept rows
        seen.append(torch.cat([rounds.states.recurrent[:, slots].flatten(),
                               rounds.states.conv[:, slots].float().flatten()]))
        if graphs is True:  # rounds and verifies of every width, and drafts after each width at k = 3 (warm),
            # then the drafts of other lengths the script asked for
            assert rounds.num_graphs > len(rounds.buckets) * 4
        out[graphs] = seen
    assert len(out[True]) == len(out["static"])
    for i, (a, b) in enumerate(zip(out[True], out["static"])):
        assert a.shape == b.shape and torch.equal(a, b), i
