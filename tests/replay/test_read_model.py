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


# ---- a benchmarks/shadow_measure.py result, read as it is ------------------------------------------

def _measure_result(rows):
    return {"command": "python benchmarks/shadow_measure.py --presets qwen3.5-0.8b,qwen3.5-2b --ops naive,triton",
            "date": "2026-11-29T14:03:24+00:00", "device": "NVIDIA H200", "versions": {"torch": "2.11"},
            "qse": rows, "peer_best_ms_per_1000_tokens": {"0.8B": 236.0}}


ROW_08_TRITON = {"preset": "qwen3.5-0.8b", "ops": "triton", "grid": 512, "chunks": 200,
                 "ms_per_chunk_by_context": {"0": 28.3, "4096": 27.6, "32768": 26.9, "99840": 27.7},
                 "read_65536_ms_per_1000_tokens": 53.267}
ROW_08_NAIVE = {"preset": "qwen3.5-0.8b", "ops": "naive", "grid": 512,
                "ms_per_chunk_by_context": {"0": 160.0, "65024": 158.0}}
ROW_2B = {"preset": "qwen3.5-2b", "ops": "triton", "grid": 256, "ms_per_chunk_by_context": {"8192": 11.0, "0": 10.5}}
ROW_4B_FAILED = {"preset": "qwen3.5-4b", "ops": "triton", "error": "OutOfMemoryError()"}


def test_shadow_measure_result_gives_the_0_8b_row(tmp_path):
    path = tmp_path / "shadow_measure.json"
    path.write_text(json.dumps(_measure_result([ROW_08_TRITON, ROW_2B, ROW_4B_FAILED])))
    model = ReadModel.load(path)
    assert model.points == ((0, 28.3), (4096, 27.6), (32768, 26.9), (99840, 27.7))
    assert model.grid == 512
    assert model.ms_per_chunk(16384) == pytest.approx(27.6 + (26.9 - 27.6) * 12288 / 28672)
    # past the last point the last segment's (rising) slope goes on
    assert model.ms_per_chunk(200_000) == pytest.approx(27.7 + 0.8 * (200_000 - 99840) / (99840 - 32768))
    for part in ("shadow_measure.json", "preset=qwen3.5-0.8b", "ops=triton", "NVIDIA H200", "2026-11-29",
                 "benchmarks/shadow_measure.py"):
        assert part in model.source
    # the source survives the round trip through the replay's own format
    assert ReadModel.from_json(model.to_json()) == model


def test_shadow_measure_preset_and_ops_are_chosen(tmp_path):
    obj = _measure_result([ROW_08_TRITON, ROW_08_NAIVE, ROW_2B])
    with pytest.raises(ReadModelError, match=r"several ops \(\['naive', 'triton'\]\).*--read-model-ops"):
        ReadModel.from_json(obj, "m.json")
    assert ReadModel.from_json(obj, "m.json", ops="naive").points == ((0, 160.0), (65024, 158.0))
    two = ReadModel.from_json(obj, "m.json", preset="qwen3.5-2b")
    assert two.points == ((0, 10.5), (8192, 11.0)) and two.grid == 256  # contexts sorted
    with pytest.raises(ReadModelError, match=r"no measured row for preset 'qwen3.5-4b'.*failed: \['qwen3.5-4b/triton'\]"):
        ReadModel.from_json(_measure_result([ROW_08_TRITON, ROW_4B_FAILED]), "m.json", preset="qwen3.5-4b")
    with pytest.raises(ReadModelError, match="only be chosen in a shadow_measure result"):
        ReadModel.from_json({"read_model": {"points": [[0, 1.0]]}}, "rm.json", preset="qwen3.5-0.8b")


def test_shadow_measure_without_usable_rows(tmp_path):
    with pytest.raises(ReadModelError, match="measured: none"):
        ReadModel.from_json(_measure_result([ROW_4B_FAILED]), "m.json")
    bad = dict(ROW_08_TRITON, ms_per_chunk_by_context={"0": "fast"})
    with pytest.raises(ReadModelError, match="not \\{context: ms\\}"):
        ReadModel.from_json(_measure_result([bad]), "m.json")


def test_flat_source_names_the_seed_only_for_the_seed_figure():
    assert "seed 000" in ReadModel.flat().source
    assert ReadModel.flat(8.0).source == "flat 8 ms per 1000 tokens at grid 512"


@pytest.mark.parametrize("grid", [512, 256])
def test_a_span_of_chunks_costs_the_sum_of_its_chunks(grid):
    model = ReadModel(((0, 40.0), (32768, 52.0), (100000, 75.0)), 512)
    for start, end in ((0, 0), (0, grid), (grid, 70 * grid), (3 * grid, 400 * grid), (0, 500 * grid)):
        direct = sum(model.ms_per_chunk(r, grid) for r in range(start, end, grid))
        assert model.chunks_ms(start, end, grid) == pytest.approx(direct, rel=1e-12)
    with pytest.raises(ValueError, match="grid lines"):
        model.chunks_ms(10, grid, grid)
