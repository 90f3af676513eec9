"""The read-rate model and its JSON format."""

import json

import pytest

from qse.replay.read_model import ReadModel, ReadModelError


def test_default_is_the_seed_figure():
    model = ReadModel.flat()
    assert model.ms_per_chunk(0) == pytest.approx(44.544)
    assert model.ms_per_chunk(100_000) == pytest.approx(44.544)
    assert model.ms_per_chunk(0, grid=1024) == pytest.approx(89.088)  # per-token cost kept
    assert ReadModel.flat(8.0).ms_per_chunk(0) == pytest.approx(4.096)


def test_interpolation_and_extrapolation():
    model = ReadModel(((0, 4.0), (32768, 8.0), (65536, 16.0)))
    assert model.ms_per_chunk(0) == 4.0
    assert model.ms_per_chunk(16384) == 6.0
    assert model.ms_per_chunk(49152) == 12.0
    assert model.ms_per_chunk(98304) == 24.0  # the last slope goes on
    falling = ReadModel(((0, 10.0), (1000, 8.0)))
    assert falling.ms_per_chunk(5000) == 8.0  # never falls past the last point
    assert ReadModel(((1000, 5.0),)).ms_per_chunk(0) == 5.0


def test_json_round_trip_and_other_keys_ignored(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"device": "H200", "read_model": {"points": [[0, 4.0], [65536, 9.0]], "grid": 512,
                                                                 "source": "bench"}}))
    model = ReadModel.load(path)
    assert model.points == ((0, 4.0), (65536, 9.0))
    assert model.source == "bench"
    assert ReadModel.from_json(model.to_json()) == model


@pytest.mark.parametrize("obj,match", [
    ({}, "expected"),
    ({"read_model": {"points": []}}, "no points"),
    ({"read_model": {"points": [[10, 1.0], [5, 2.0]]}}, "increase strictly"),
    ({"read_model": {"points": [[0, -1.0]]}}, r"\[0, -1.0\]"),
    ({"read_model": {"points": [[0, 1.0]], "grid": 0}}, "grid must be positive"),
], ids=["missing", "empty", "order", "negative", "grid"])
def test_bad_models_say_what_is_wrong(obj, match):
    with pytest.raises(ReadModelError, match=match):
        ReadModel.from_json(obj)


def test_unreadable_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{")
    with pytest.raises(ReadModelError, match="x.json"):
        ReadModel.load(path)
