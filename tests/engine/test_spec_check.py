"""`qse spec-check` (qse/engine/spec_check.py) on the tiny embedded model, on CPU in float64: a verify row's logits
are then a one-row round's to far below the fp32 head's last bit, so every sequence's ids are plain decoding's.
A parting is forced by editing the logits a round or a verify returns (one sequence, one position): far from a
tie it fails the check, within the tolerance of one it passes and is reported."""

from __future__ import annotations

import json

import pytest
import torch

from qse.engine.rounds import DecodeRounds
from qse.engine.spec_check import SpecCheckError, check_request, default_tolerance, first_parting, run_spec_check

# two sequences of k = 3: the oracle's first verify reads rows for positions 1 .. 4, so position 2 is its row 1
SMALL = dict(num_sequences=2, context=80, steps=7, k=3)  # 8 ids a sequence: two whole verifies
CLI = ["spec-check", "--device", "cpu", "--dtype", "float64", "--sequences", "2", "--context", "80", "--steps", "7",
       "--k", "3"]


@pytest.fixture(scope="module")
def engine64(cache_dir):
    from qse.engine.engine import Engine
    from qse.models import resolve

    return Engine(resolve("", torch.device("cpu"), torch.float64, cache_dir))


def _edit(monkeypatch, method: str, call: int, edit) -> None:
    """DecodeRounds.<method>'s logits of its call number `call` go through edit(logits) before they are returned."""
    real = getattr(DecodeRounds, method)
    calls = {"n": 0}

    def wrapped(self, *args, **kwargs):
        logits = real(self, *args, **kwargs)
        if calls["n"] == call:
            edit(logits)
        calls["n"] += 1
        return logits

    monkeypatch.setattr(DecodeRounds, method, wrapped)


def test_every_sequence_is_plain_decodings_in_float64(engine64):
    report = run_spec_check(engine64, **SMALL)
    assert report["pass"] is True and report["partings"] == []
    assert report["sequences_compared"] == 4 and report["equal_sequences"] == 4
    assert report["tokens_compared"] == 2 * 2 * SMALL["steps"]
    oracle, ngram = report["runs"]
    assert (oracle["drafter"], ngram["drafter"]) == ("oracle", "ngram")
    assert oracle["ids_per_verify"] == SMALL["k"] + 1  # every draft of every verify accepted
    assert report["tolerance"] == default_tolerance(torch.float32) and report["tolerance_source"] == "default"
    # every row compared read plain decoding's ids: the same logits but for their last fp32 bits (the rounds hand
    # back fp32 logits; float64's roundings apart, a value may round to the next fp32 number)
    assert oracle["drift"]["rows"] == 2 * SMALL["steps"] and 0.0 <= report["max_drift"] < 1e-5


def test_a_parting_far_from_a_tie_fails_and_names_its_sequence_and_position(engine64, monkeypatch, capsys, tmp_path):
    def far(logits):  # sequence 1's row for position 2: its lowest logit made the top one by far
        row = logits[1, 1]
        row[int(row.argmin())] = row.max() + 100.0

    _edit(monkeypatch, "verify", 0, far)
    from qse.cli import main

    out = tmp_path / "spec.json"
    assert main([*CLI, "--drafter", "oracle", "--out", str(out)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    assert report["pass"] is False and report["equal_sequences"] == 1
    (parting,) = report["partings"]
    assert (parting["drafter"], parting["sequence"], parting["position"]) == ("oracle", 1, 2)
    assert parting["near_tie"] is False and parting["gap"] > report["tolerance"]
    assert parting["spec_gap"] > 99.0  # the verify's own margin: the 100 added
    assert report["tokens_compared"] == SMALL["steps"] + 2  # sequence 1 compared up to its parting


def test_a_near_tie_parting_passes_and_is_reported(engine64, monkeypatch):
    tie = {}

    def close_second(logits):  # the plain round for position 2 of sequence 0: an id 0.01 below its top one
        row = logits[0]
        tie["id"] = int(row.argmin())
        row[tie["id"]] = row.max() - 0.01

    def flip(logits):  # the verify's row for the same position: that id 0.01 above the top one
        row = logits[0, 1]
        row[tie["id"]] = row.max() + 0.01

    _edit(monkeypatch, "run", 1, close_second)
    _edit(monkeypatch, "verify", 0, flip)
    report = run_spec_check(engine64, **SMALL, drafters=("oracle",), tolerance=0.05)
    assert report["pass"] is True and report["near_ties"] == 1 and report["equal_sequences"] == 1
    (parting,) = report["partings"]
    assert (parting["sequence"], parting["position"], parting["spec_id"]) == (0, 2, tie["id"])
    assert parting["near_tie"] is True and parting["gap_is_lower_bound"] is False
    assert parting["gap"] == pytest.approx(0.01, abs=1e-5) and parting["spec_gap"] == pytest.approx(0.01, abs=1e-5)
    # the parting's row stood 0.02 from the plain row at the edited id; the rows before it agreed
    assert parting["row_drift"] == pytest.approx(0.02, abs=1e-5) and report["runs"][0]["drift"]["max"] < 1e-5
    assert parting["tolerance"] == 0.05 and report["tolerance_source"] == "flag"


@pytest.mark.parametrize("flag, value", [("--k", "0"), ("--steps", "0"), ("--sequences", "-1"),
                                         ("--tolerance", "-0.1")])
def test_bad_flags_exit_2_naming_the_value(flag, value, capsys):
    from qse.cli import main

    assert main([*CLI, flag, value]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert flag in err and value in err


def test_the_request_and_the_tolerance_rules():
    with pytest.raises(SpecCheckError, match="--drafter"):
        check_request(1, 1, 1, 1, drafters=("mtp",))
    assert default_tolerance(torch.bfloat16) == pytest.approx(0.0552, abs=1e-4)
    assert default_tolerance(torch.float16) == pytest.approx(0.0069, abs=1e-4)
    assert default_tolerance(torch.float64) == default_tolerance(torch.float32)
    assert first_parting([1, 2, 3], [1, 2, 3]) is None and first_parting([1, 2, 3], [1, 5, 3]) == 1
