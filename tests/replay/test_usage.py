"""The usage ledger format: JSONL round trip, appends, and errors that name the line."""

import pytest

from qse.replay.usage import (UsageError, UsageRecord, append_usage, read_meta, read_usage, sessions_of,
                              write_usage)

REC = dict(session="s", arrival_s=0.0, first_token_s=1.25, end_s=10.5, prompt_tokens=16350,
           shared_prefix_tokens=0, output_tokens=346, model="qwen3.5-27b")


def test_round_trip_and_append(tmp_path):
    path = tmp_path / "usage.jsonl"
    a = UsageRecord(**REC)
    b = UsageRecord(**{**REC, "arrival_s": 11.0, "first_token_s": 11.5, "end_s": 12.0, "prompt_tokens": 16800,
                       "shared_prefix_tokens": 16350})
    assert write_usage(path, [a], meta={"format": "test"}) == 1
    append_usage(path, b)
    assert read_usage(path) == [a, b]
    assert read_meta(path) == {"format": "test"}
    first = path.read_text().splitlines()[0]
    assert first == ('{"session":"s","arrival_s":0.0,"first_token_s":1.25,"end_s":10.5,"prompt_tokens":16350,'
                     '"shared_prefix_tokens":0,"output_tokens":346,"model":"qwen3.5-27b"}')


def test_model_is_optional_and_meta_absent(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text('{"session":"x","arrival_s":0,"first_token_s":0,"end_s":0,"prompt_tokens":1,'
                    '"shared_prefix_tokens":0,"output_tokens":0}\n\n')
    (rec,) = read_usage(path)
    assert rec.model == "" and rec.arrival_s == 0
    assert read_meta(path) is None


@pytest.mark.parametrize("line,match", [
    ('{"session":"x"}', "u.jsonl:2: not a usage record"),
    ('{"session":"x","arrival_s":5,"first_token_s":4,"end_s":6,"prompt_tokens":1,"shared_prefix_tokens":0,'
     '"output_tokens":0}', "u.jsonl:2: times out of order"),
    ('{"session":"x","arrival_s":0,"first_token_s":0,"end_s":0,"prompt_tokens":1,"shared_prefix_tokens":2,'
     '"output_tokens":0}', "shared_prefix_tokens 2"),
    ('not json', "u.jsonl:2"),
], ids=["missing-fields", "times", "shared", "garbage"])
def test_bad_line_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "u.jsonl"
    good = ('{"session":"x","arrival_s":0,"first_token_s":0,"end_s":0,"prompt_tokens":1,'
            '"shared_prefix_tokens":0,"output_tokens":0}')
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(UsageError, match=match):
        read_usage(path)


def test_sessions_of_orders_by_arrival():
    recs = [UsageRecord(**{**REC, "session": s, "arrival_s": t, "first_token_s": t, "end_s": t})
            for s, t in (("b", 5.0), ("a", 3.0), ("b", 1.0))]
    grouped = sessions_of(recs)
    assert list(grouped) == ["b", "a"]
    assert [r.arrival_s for r in grouped["b"]] == [1.0, 5.0]


def test_server_records_with_more_fields_and_no_first_token(tmp_path):
    path = tmp_path / "server.jsonl"
    path.write_text('{"request_id":"r1","session":"x","arrival_s":1.0,"first_token_s":null,"end_s":1.5,'
                    '"prompt_tokens":10,"shared_prefix_tokens":0,"output_tokens":0,"model":"m","prefill_ms":480.0}\n')
    (rec,) = read_usage(path)
    assert (rec.first_token_s, rec.end_s, rec.model) == (1.5, 1.5, "m")
