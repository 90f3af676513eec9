"""A session longer than the reader's whole KV pool: never read (so it cannot evict the others and then fail
over and over), refused by name when asked on, and readable again once its ids fit."""

from __future__ import annotations

import pytest
import torch

from qse.shadow.reader import ANSWER_NOW, SessionTooLong, ShadowReader

GRID = 32
LETTERS = ["A", "B"]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def small_reader(tiny_engine):
    """A pool of 4 grid chunks' pages: sessions up to 128 rows fit."""
    page_nbytes = ShadowReader(tiny_engine, grid=GRID, pool_bytes=1 << 20, page_rows=GRID).pool.page_nbytes
    reader = ShadowReader(tiny_engine, grid=GRID, pool_bytes=4 * page_nbytes, page_rows=GRID)
    assert reader.max_rows == 4 * GRID
    return reader


def test_a_session_longer_than_the_pool_is_not_read_and_others_are(small_reader):
    reader = small_reader
    reader.feed("long", _ids(5 * GRID + 3, 1))
    reader.feed("short", _ids(2 * GRID + 1, 2))
    long = reader.get("long")
    assert long.is_too_long and long.backlog == 0 and long.readable_end == 0
    assert reader.launch_step("long") is None and reader.read_all("long") == []
    assert [s.session_id for s in reader.sessions_with_backlog()] == ["short"]
    assert [r.position for r in reader.read_all("short")] == [GRID, 2 * GRID]
    assert long.committed == 0


def test_asking_on_a_session_too_long_names_it_and_the_pool(small_reader):
    reader = small_reader
    reader.feed("long", _ids(4 * GRID + 10, 3))
    with pytest.raises(SessionTooLong) as err:
        reader.ask("long", _ids(5, 4), LETTERS)
    assert (err.value.rows, err.value.max_rows) == (4 * GRID + 10, 4 * GRID)
    assert "'long'" in str(err.value) and str(4 * GRID) in str(err.value)
    with pytest.raises(SessionTooLong):
        reader.summarize("long", _ids(5, 4), max_tokens=2)


def test_a_question_that_would_overflow_the_pool_is_too_long_too(small_reader):
    """The session fits (all of it read), but its fork above the committed rows would not."""
    reader = small_reader
    reader.feed("full", _ids(4 * GRID, 5))
    reader.read_all("full")
    assert reader.get("full").committed == 4 * GRID
    with pytest.raises(SessionTooLong) as err:
        reader.ask("full", _ids(5, 6), LETTERS, behind=ANSWER_NOW)
    assert err.value.max_rows == 4 * GRID
    assert reader.get("full").committed == 4 * GRID  # nothing read or lost


def test_a_session_read_again_once_its_ids_fit(small_reader):
    """Compacted below the pool (as an agent's session is), the session reads and is answered on."""
    reader = small_reader
    ids = _ids(6 * GRID, 7)
    reader.feed("s", ids)
    assert reader.read_all("s") == []
    reader.feed("s", ids[: 2 * GRID + 4])  # (a question's fork takes 64 rows above the committed ones)
    assert [r.position for r in reader.read_all("s")] == [GRID, 2 * GRID]
    answer = reader.ask("s", _ids(5, 8), LETTERS)
    assert set(answer.distribution) == set(LETTERS)
