"""Converters on small slices of each public trace, with values read off the files' first rows."""

import json

import pytest

from qse.replay.cli import main
from qse.replay.traces import Rates, TraceError, convert, detect_format, from_azure, from_mooncake, from_tracelab, from_weka
from qse.replay.usage import read_meta, read_usage

RATES = Rates(decode_tok_s=36.0, prefill_tok_s=936.0)


def test_weka_first_session(traces_dir):
    conv = from_weka(traces_dir / "weka_cc_sessions_dev.csv", RATES, max_sessions=1)
    recs = conv.records
    assert {r.session for r in recs} == {"trace_0002/main"}
    r0, r1 = recs[0], recs[1]
    # idx 0: t_s 0, api_time_s 5.23, out 154: the decode is the last 154/36 s
    assert (r0.arrival_s, r0.end_s, r0.prompt_tokens, r0.output_tokens, r0.shared_prefix_tokens) == (0.0, 5.23, 15818, 154, 0)
    assert r0.first_token_s == pytest.approx(5.23 - 154 / 36)
    assert r0.model == "claude-opus-4-5-20251101"
    # idx 1: lcp 15808 covers the previous 15818 up to its last partial 64-block: all shared
    assert (r1.arrival_s, r1.end_s, r1.shared_prefix_tokens) == (9.0, 12.36, 15818)
    assert r1.first_token_s == pytest.approx(12.36 - 99 / 36)
    # idx 17: the prompt was re-rendered (lcp 15168 of 43773)
    assert recs[17].shared_prefix_tokens == 15168
    assert conv.meta["format"] == "weka" and conv.meta["rates"] == {"decode_tok_s": 36.0, "prefill_tok_s": 936.0}
    assert all(r.problem() is None for r in recs)


def test_weka_row_without_api_time_is_modelled(traces_dir):
    conv = from_weka(traces_dir / "weka_cc_sessions_dev.csv", RATES, max_sessions=40)
    recs = [r for r in conv.records if r.session == "trace_0033/main"]
    r2 = recs[2]  # in 424289, out 126, no api_time_s; lcp 424064 covers the previous 424117
    assert r2.shared_prefix_tokens == 424117
    assert r2.first_token_s == pytest.approx(56.0 + (424289 - 424117) / 936)
    assert r2.end_s == pytest.approx(r2.first_token_s + 126 / 36)
    assert conv.meta["num_modelled_timing"] >= 1


@pytest.mark.parametrize("with_hashes", [True, False], ids=["hash_ids", "chains-only"])
def test_mooncake_chain_follows_parent(traces_dir, tmp_path, with_hashes):
    path = traces_dir / "mooncake_conversation_inferred_chains.csv"
    hashes = None if with_hashes else tmp_path / "absent.jsonl"
    conv = from_mooncake(path, RATES, max_sessions=2, hashes_path=hashes)
    by = {}
    for r in conv.records:
        by.setdefault(r.session, []).append(r)
    assert set(by) == {"mooncake/0", "mooncake/1"}
    s1 = by["mooncake/1"]
    root, child = s1[0], s1[1]  # idx 1 (7322 in, 490 out) and its child idx 137 (7833 in, at 48 s)
    assert (root.arrival_s, root.prompt_tokens, root.output_tokens, root.shared_prefix_tokens) == (0.0, 7322, 490, 0)
    assert root.first_token_s == pytest.approx(7322 / 936)
    assert root.end_s == pytest.approx(7322 / 936 + 490 / 36)
    assert (child.arrival_s, child.prompt_tokens, child.shared_prefix_tokens) == (48.0, 7833, 7322)
    assert child.first_token_s == pytest.approx(48.0 + (7833 - 7322) / 936)
    assert conv.meta["num_sessions"] == 2


def test_azure_each_request_its_own_session(traces_dir):
    conv = from_azure(traces_dir / "AzureLLMInferenceTrace_conv.csv", RATES, max_sessions=3)
    r0, r1, _ = conv.records
    assert (r0.session, r0.arrival_s, r0.prompt_tokens, r0.output_tokens) == ("azure/0", 0.0, 374, 44)
    assert r0.first_token_s == pytest.approx(374 / 936)
    assert r0.end_s == pytest.approx(374 / 936 + 44 / 36)
    assert r1.arrival_s == pytest.approx(50.9951690 - 46.6805900)
    assert len({r.session for r in conv.records}) == 3


def test_tracelab_event_times(traces_dir):
    conv = from_tracelab(traces_dir / "tracelab_examples" / "sanitized_round_trace.jsonl")
    recs = [r for r in conv.records if r.session.endswith("2f4697")]
    assert len(recs) == 10 and conv.meta["num_sessions"] == 2
    r0, r1 = recs[0], recs[1]
    assert r0.first_token_s - r0.arrival_s == pytest.approx(29.420 - 20.151)  # user message to first reasoning
    assert (r0.prompt_tokens, r0.shared_prefix_tokens, r0.output_tokens) == (32272, 0, 931)
    assert (r1.prompt_tokens, r1.shared_prefix_tokens) == (35740, 29380)
    assert all(r.problem() is None for r in conv.records)


def test_detect_format(traces_dir):
    assert detect_format(traces_dir / "weka_cc_sessions_dev.csv") == "weka"
    assert detect_format(traces_dir / "mooncake_conversation_inferred_chains.csv") == "mooncake"
    assert detect_format(traces_dir / "AzureLLMInferenceTrace_code.csv") == "azure"
    assert detect_format(traces_dir / "tracelab_examples" / "sanitized_round_trace.jsonl") == "tracelab"
    with pytest.raises(TraceError, match="inferred chains"):
        detect_format(traces_dir / "mooncake_conversation_trace.jsonl")


def test_unknown_format(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        convert(path)


def test_convert_command_writes_a_ledger_and_its_meta(traces_dir, tmp_path, capsys):
    out = tmp_path / "weka.jsonl"
    rc = main(["convert", str(traces_dir / "weka_cc_sessions_dev.csv"), "--max-sessions", "3", "-o", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    recs = read_usage(out)
    assert printed["num_records"] == len(recs) > 0
    assert read_meta(out)["format"] == "weka"
    # a converted ledger reads back through the ledger path with its meta
    again = convert(out)
    assert again.records == recs and again.meta["format"] == "weka"
