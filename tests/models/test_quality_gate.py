"""`qse quality-gate` end to end on a tiny checkpoint the test quantises: KL and top-1 agreement against the
weights it was made from, the weight set's thresholds, a failing gate exits 1."""

from __future__ import annotations

import json

import pytest
import torch

from qse.cli import main
from qse.models.linear import quantize_fp8_block
from qse.models.quality import QualityGateError, Thresholds, thresholds_for
from qse.models.qwen3_5.config import parse_config
from qse.models.qwen3_5.layout import is_linear
from qse.models.qwen3_5.presets import embedded_config_dict, random_tensors, write_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The embedded shape with random weights (the source) and its FP8 copy (every projection quantised). The
    tied embedding is scaled up so that the head is confident, as a trained one is: with the random weights'
    near-flat distributions the top token is a coin toss that any rounding flips."""
    root = tmp_path_factory.mktemp("quality")
    config = embedded_config_dict()
    tensors = random_tensors(parse_config(config), seed=3)
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] * 100
    write_checkpoint(root / "source", config, tensors)
    fp8 = {}
    for name, t in tensors.items():
        if is_linear(name):
            fp8[name], fp8[name + "_scale_inv"] = quantize_fp8_block(t)
        else:
            fp8[name] = t
    write_checkpoint(root / "fp8", config, fp8)
    # this weight set's own thresholds: a random 8-layer net amplifies the FP8 rounding far more than a trained
    # model does (its KL is tenths of a nat where a trained model's is thousandths)
    (root / "fp8" / "qse_quality_gate.json").write_text(json.dumps({"max_mean_kl": 0.25, "min_top1": 0.9}))
    return root / "source", root / "fp8"


def _gate(capsys, fp8, source, *extra) -> tuple[int, dict]:
    code = main(["quality-gate", "--model", str(fp8), "--reference", str(source), "--device", "cpu",
                 "--dtype", "float32", "--positions", "128", "--chunk", "64", *extra])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else {"error": out.err})


def test_the_fp8_copy_passes_against_its_source(checkpoints, capsys):
    source, fp8 = checkpoints
    code, report = _gate(capsys, fp8, source)
    assert code == 0 and report["pass"] is True
    assert report["positions"] == 128 and report["fp8_linears"] > 0
    assert 0 < report["mean_kl"] <= report["p99_kl"] <= report["max_kl"]
    assert report["mean_kl"] <= report["thresholds"]["max_mean_kl"]
    assert report["top1_agreement"] >= report["thresholds"]["min_top1"]
    assert report["thresholds"] == {"max_mean_kl": 0.25, "min_top1": 0.9}
    assert all(v.endswith("qse_quality_gate.json") for v in report["threshold_source"].values())


def test_the_weight_set_s_own_thresholds_and_a_failing_gate(checkpoints, capsys, tmp_path):
    source, fp8 = checkpoints
    code, report = _gate(capsys, fp8, source, "--max-kl", "0")  # no KL at all allowed: FP8 cannot pass
    assert code == 1 and report["pass"] is False and report["threshold_source"]["max_mean_kl"] == "caller"
    assert report["thresholds"] == {"max_mean_kl": 0.0, "min_top1": 0.9}  # the rest still the weight set's
    (tmp_path / "qse_quality_gate.json").write_text(json.dumps({"min_top1": 0.5}))
    thresholds, source_of = thresholds_for(tmp_path)
    assert thresholds == Thresholds(min_top1=0.5) and source_of == {
        "max_mean_kl": "default", "min_top1": str(tmp_path / "qse_quality_gate.json")}
    assert thresholds_for(tmp_path, min_top1=0.7)[0].min_top1 == 0.7  # the caller's value wins


def test_the_source_against_itself_agrees_exactly(checkpoints, capsys):
    """The comparison itself: a model against its own weights is 0 nats and every top-1 the same -- but the
    gate refuses it, since the model holds no FP8 weights."""
    from qse.engine.engine import Engine
    from qse.models import resolve
    from qse.models.quality import compare

    source, _ = checkpoints
    engine = Engine(resolve(str(source), torch.device("cpu"), torch.float32, source))
    stats = compare(engine, engine, list(range(1000, 1100)), chunk=64)
    assert stats["mean_kl"] == 0.0 and stats["top1_agreement"] == 1.0
    code, report = _gate(capsys, source, source)
    assert code == 2 and "holds no FP8 weights" in report["error"]


def test_bad_thresholds_are_named(tmp_path):
    with pytest.raises(QualityGateError, match="min_top1 must be a share in"):
        Thresholds(min_top1=1.5)
    (tmp_path / "qse_quality_gate.json").write_text('{"max_kl": 1}')
    with pytest.raises(QualityGateError, match="expected an object with keys among"):
        thresholds_for(tmp_path)
