"""`qse cache-check`: a session through the served turns, its state moved across every tier between turns."""

from __future__ import annotations

import json

import torch

from qse.sessions.check import run_cache_check

GRID = 32


def _session_file(tmp_path) -> str:
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(0, 248000, (2 * GRID + 9,), generator=gen).tolist()
    lines = []
    for n in range(5):
        if n:
            prompt = prompt + torch.randint(0, 248000, (17 + 5 * n,), generator=gen).tolist()
        if n == 3:  # the template re-renders an earlier turn: a rollback
            prompt = prompt[:GRID + 3] + [11, 12, 13] + prompt[GRID + 6:]
        lines.append(json.dumps({"prompt_ids": prompt}))
    path = tmp_path / "session.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_cache_check_is_bit_equal_across_every_tier(tiny_engine, tmp_path):
    report = run_cache_check(tiny_engine, _session_file(tmp_path), GRID, decode_tokens=3, edit_every=0)
    assert report["bit_equal"] is True
    assert report["turns"] == 5 and report["rollbacks"] == 1
    assert report["hits"] == {"device": 1, "host": 2, "disk": 1}
    assert all(t["logits_equal"] and t["state_equal"] and t["tokens_equal"] for t in report["per_turn"])
    assert 0 < report["cached_tokens"] < report["prompt_tokens"]


def test_the_command_prints_one_json_object(tiny_engine, tmp_path, capsys):
    from qse.cli import main

    assert main(["cache-check", "--session", _session_file(tmp_path), "--grid", str(GRID), "--decode-tokens", "1",
                 "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bit_equal"] is True and out["turns"] == 6  # an edited copy before turn 3 (--edit-every 3)
    assert [t["edited"] for t in out["per_turn"]] == [False, False, False, True, False, False]


def test_edited_turns_roll_back_below_the_kept_line_and_stay_bit_equal(tiny_engine, tmp_path):
    gen = torch.Generator().manual_seed(22)
    prompt = torch.randint(0, 248000, (4 * GRID + 9,), generator=gen).tolist()
    lines = []
    for n in range(5):
        prompt = prompt + torch.randint(0, 248000, (GRID + 5,), generator=gen).tolist() if n else prompt
        lines.append(json.dumps({"prompt_ids": prompt}))
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = run_cache_check(tiny_engine, path, GRID, decode_tokens=2, edit_every=2)
    edited = [t for t in report["per_turn"] if t["edited"]]
    assert len(edited) == 2 and report["turns"] == 7  # copies before turns 2 and 4
    for t in edited:  # each went back under the line the turn before it kept, to a checkpoint or row 0
        before = report["per_turn"][report["per_turn"].index(t) - 1]
        assert t["rolled_back_to"] is not None and t["cached_tokens"] < before["prompt_tokens"] // GRID * GRID - GRID
    assert report["rollbacks"] >= 4  # each edited turn, and the real turn after it
    assert report["bit_equal"] is True
    assert all(t["logits_equal"] and t["state_equal"] and t["tokens_equal"] for t in report["per_turn"])
