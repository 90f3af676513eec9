"""qse's forward against transformers' Qwen3_5ForCausalLM on a checkpoint transformers wrote (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from qse.models.qwen3_5 import load

transformers = pytest.importorskip("transformers")
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def pair(hf_tiny_dir):
    ours = load(hf_tiny_dir, "cpu", torch.float32)
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(hf_tiny_dir, dtype=torch.float32).eval()
    return ours, ref


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _ref_logits(ref, ids):
    with torch.inference_mode():
        return ref(input_ids=ids[None]).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < REL_TOL, f"relative max difference {rel:.3g} >= {REL_TOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_one_shot_prefill_matches_transformers(pair):
    ours, ref = pair
    ids = _ids(300)
    _assert_close(ours.forward(ids, ours.new_cache(), "all"), _ref_logits(ref, ids))


@pytest.mark.parametrize("chunk", [64, 512], ids=["chunk64", "chunk512"])
def test_chunked_prefill_with_carried_state_matches_transformers(pair, chunk):
    ours, ref = pair
    ids = _ids(1100, seed=1)
    cache = ours.new_cache()
    parts = [ours.forward(ids[s : s + chunk], cache, "all") for s in range(0, len(ids), chunk)]
    _assert_close(torch.cat(parts), _ref_logits(ref, ids))


def test_decode_after_prefill_matches_transformers(pair):
    ours, ref = pair
    ids = _ids(140, seed=2)
    cache = ours.new_cache()
    ours.forward(ids[:100], cache, "none")
    steps = [ours.forward(ids[i : i + 1], cache, "all") for i in range(100, 140)]
    _assert_close(torch.cat(steps), _ref_logits(ref, ids)[100:])


def test_decode_matches_transformers_cached_decode(pair):
    """transformers' own cached decode path (recurrent step + conv update) against ours."""
    ours, ref = pair
    ids = _ids(90, seed=3)
    with torch.inference_mode():
        out = ref(input_ids=ids[None, :80], use_cache=True)
        cache_hf = out.past_key_values
        hf_steps = []
        for i in range(80, 90):
            o = ref(input_ids=ids[None, i : i + 1], past_key_values=cache_hf, use_cache=True)
            hf_steps.append(o.logits[0].float())
    cache = ours.new_cache()
    ours.forward(ids[:80], cache, "none")
    steps = [ours.forward(ids[i : i + 1], cache, "all") for i in range(80, 90)]
    _assert_close(torch.cat(steps), torch.cat(hf_steps))


def test_refcheck_command_reports_agreement(hf_tiny_dir, capsys):
    from qse.cli import main

    assert main(["refcheck", "--model", str(hf_tiny_dir), "--device", "cpu", "--dtype", "float32",
                 "--positions", "96", "--chunk", "32"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["positions"] == 96
    assert report["argmax_agreement"] == 1.0
    assert report["max_rel_logit_diff"] < REL_TOL
    assert report["chunked"]["argmax_agreement"] == 1.0
