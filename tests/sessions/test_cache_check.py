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
    report = run_cache_check(tiny_engine, _session_file(tmp_path), GRID, decode_tokens=3)
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
    assert out["bit_equal"] is True and out["turns"] == 5
