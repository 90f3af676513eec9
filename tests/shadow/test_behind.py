"""A question about a session the reader is behind on: the whole chunks are read on the grid first and kept
(the fork holds only the tail under one chunk), or, with behind="answer_now", nothing is read and the answer
says how far behind it is."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from qse.server import wire
from qse.shadow.reader import ANSWER_NOW, BEHIND_MODES, ShadowError, ShadowReader

LETTERS = ["A", "B", "C", "D"]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_question_5000_behind_reads_them_once_and_keeps_them(tiny_engine, one_thread):
    grid, behind = 512, 5000
    reader = ShadowReader(tiny_engine, grid=grid, pool_bytes=64 << 20, graphs=False)
    ids, question = _ids(behind, 1), _ids(12, 2)
    line = (behind // grid) * grid
    reader.feed("asked", ids)
    reader.feed("idle", ids)

    first = reader.ask("asked", question, LETTERS)
    asked = reader.get("asked")
    assert asked.committed == line  # the backlog was read on the grid and kept: the read position advanced
    assert first.read_tokens == line and first.behind == 0 and first.read_ms > 0
    assert first.tokens_forwarded == behind - line + len(question)  # the fork: the tail under one chunk + question
    chunks = asked.stats.chunks_read
    assert chunks == line // grid

    second = reader.ask("asked", question, LETTERS)  # nothing new to read
    assert second.read_tokens == 0 and asked.stats.chunks_read == chunks and asked.committed == line
    assert torch.equal(first.logits, second.logits)

    reader.read_all("idle")  # the idle reader reads the same session to the same line
    idle = reader.ask("idle", question, LETTERS)
    assert idle.read_tokens == 0 and reader.get("idle").committed == line
    assert torch.equal(first.logits, idle.logits)
    assert reader.state_equal(asked, reader.get("idle")) == {"committed": True, "kv": True, "recurrent": True,
                                                             "conv": True}


def test_answer_now_reads_nothing_and_says_how_far_behind(tiny_engine, one_thread):
    grid = 32
    reader = ShadowReader(tiny_engine, grid=grid, pool_bytes=16 << 20, graphs=False)
    ids = _ids(3 * grid + 5, 3)
    reader.feed("s", ids)
    now = reader.ask("s", [10, 11, 12], ["A", "B"], behind=ANSWER_NOW)
    assert reader.get("s").committed == 0 and now.read_tokens == 0
    assert now.behind == len(ids) and now.tokens_forwarded == 3 and now.position == 3
    summary = reader.summarize("s", [20, 21], max_tokens=2, behind=ANSWER_NOW)
    assert reader.get("s").committed == 0 and summary.behind == len(ids) and summary.read_tokens == 0

    read = reader.summarize("s", [20, 21], max_tokens=2)  # the default reads the chunks first and keeps them
    assert reader.get("s").committed == 3 * grid and read.read_tokens == 3 * grid and read.behind == 0
    after = reader.ask("s", [10, 11, 12], ["A", "B"], behind=ANSWER_NOW)  # under one chunk behind: it is forked
    assert after.behind == 0 and after.tokens_forwarded == 5 + 3


def test_a_bad_behind_is_refused_by_name(tiny_engine):
    reader = ShadowReader(tiny_engine, grid=32, pool_bytes=16 << 20, graphs=False)
    reader.feed("s", _ids(40, 4))
    with pytest.raises(ShadowError, match="behind='later'"):
        reader.ask("s", [1, 2], ["A", "B"], behind="later")
    assert set(get_args(wire.Behind)) == set(BEHIND_MODES)  # the wire's names are the reader's
