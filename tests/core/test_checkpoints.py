"""The checkpoint book: exact decisions on integer rows (which lines, which kept, where a rollback lands)."""

import pytest

from qse.core.checkpoints import DIVERGENCE, FIRST, LADDER, PROMPT, RECENT, Change, CheckpointBook, CheckpointRules

G = 16


def book(**rules) -> CheckpointBook:
    return CheckpointBook(CheckpointRules(G, **rules))


def read(b: CheckpointBook, start: int, end: int) -> list[Change]:
    """Chunks read one a launch from `start` to `end`."""
    return [b.after_chunk(row) for row in range(start + G, end + 1, G)]


def test_a_prompt_end_line_is_taken_when_a_chunk_ends_on_it():
    b = book(prompt=6)
    assert b.feed(known=70, prompt_end=70) == Change()  # nothing read yet: a line, no state
    assert b.lines == {64}
    changes = read(b, 0, 64)
    assert [c.take for c in changes] == [None, None, None, 64]
    assert changes[-1].added == (PROMPT,)
    assert b.positions() == [64]


def test_lines_above_what_the_session_holds_go():
    b = book()
    b.feed(known=100, prompt_end=100)
    b.feed(known=40, prompt_end=40)  # a shorter re-render
    assert b.lines == {32}


def test_the_prompt_cap_keeps_the_highest_and_frees_the_lowest():
    b = book(prompt=2)
    dropped = []
    for end in (20, 40, 60):
        b.feed(known=end, prompt_end=end)
        dropped += [r for c in read(b, max(b.positions(None), default=0), (end // G) * G) for r in c.dropped]
    assert b.positions() == [32, 48]
    assert dropped == [16]


def test_recent_checkpoints_take_a_launch_end_and_keep_the_newest():
    b = book(prompt=6, recent=2)
    read(b, 0, 64)
    assert b.positions(RECENT) == [48, 64]
    assert b.after_chunk(80, launch_end=False) == Change()  # inside a chunk group: nothing
    assert b.may_take_at(80)


def test_at_line_takes_the_prompt_line_where_the_state_stands():
    b = book()
    read(b, 0, 32)
    change = b.feed(known=40, prompt_end=40, standing=32)
    assert change.take == 32 and b.positions() == [32]
    off = book(at_line=False)
    read(off, 0, 32)
    assert off.feed(known=40, prompt_end=40, standing=32) == Change() and off.positions() == []


def test_a_rollback_goes_to_the_newest_held_row_at_or_below_and_drops_above():
    b = book(prompt=6, recent=1)
    b.feed(known=40, prompt_end=40)
    read(b, 0, 32)
    b.feed(known=90, prompt_end=90)
    read(b, 32, 80)
    assert b.positions(None) == [32, 80]
    assert b.rollback_row(79) == 32 and b.rollback_row(31) == 0
    back = b.roll_back(50)
    assert back.row == 32 and back.dropped == (80,)
    assert b.positions(None) == [32]
    assert b.roll_back(10).row == 0 and b.positions(None) == []


def test_divergence_lines_become_checkpoints_on_the_reread():
    b = book(prompt=1, divergence=1)
    b.feed(known=100, prompt_end=100)
    read(b, 0, 96)
    back = b.roll_back(50)  # re-rendered at 50: the line 48 is a divergence line
    assert back.row == 0 and b.divergence_lines == [48]
    assert b.group_chunks(0, 8) == 2  # a group ends on the line
    changes = read(b, 0, 48)
    assert changes[-1].added == (DIVERGENCE,) and b.positions(DIVERGENCE) == [48]
    assert b.roll_back(60).row == 48  # the same place again finds the state
    b.roll_back(20)  # a newer place: the old line's checkpoint goes with it
    assert b.divergence_lines == [16] and b.positions(DIVERGENCE) == []


def test_one_row_holds_several_kinds_and_goes_when_none_is_left():
    b = book(prompt=1, recent=1)
    b.feed(known=40, prompt_end=40)
    change = read(b, 0, 32)[-1]
    assert change.take == 32 and set(change.added) == {PROMPT, RECENT}
    assert b.kinds_at(32) == {PROMPT, RECENT}
    assert b.after_chunk(48).dropped == ()  # 32 loses `recent`, keeps `prompt`
    assert b.kinds_at(32) == {PROMPT} and len(b) == 2


def test_pin_first_keeps_the_lowest_prompt_checkpoint_once():
    b = book(prompt=1, pin_first=True)
    for end in (20, 40, 60):
        b.feed(known=end, prompt_end=end)
        read(b, max(b.positions(None), default=0), (end // G) * G)
    assert b.positions(FIRST) == [16] and b.positions(PROMPT) == [48]
    assert b.positions(None) == [16, 48]


def test_a_cap_of_zero_takes_nothing():
    b = book(prompt=0)
    b.feed(known=40, prompt_end=40)
    assert all(c.take is None and c.dropped == () for c in read(b, 0, 32))
    assert len(b) == 0


def test_clear_and_load_hand_the_held_rows_out_and_back():
    b = book(recent=2)
    read(b, 0, 48)
    assert b.clear() == (32, 48) and len(b) == 0
    b.load({32: {RECENT}, 48: {RECENT, PROMPT}}, [16])
    assert b.positions(None) == [32, 48] and b.divergence_lines == [16]
    with pytest.raises(ValueError, match="tomorrow"):
        b.load({16: {"tomorrow"}})


@pytest.mark.parametrize("bad", [dict(grid=0), dict(grid=G, prompt=-1), dict(grid=G, recent=1.5)],
                         ids=["grid-0", "prompt-negative", "recent-not-whole"])
def test_bad_rules_are_named(bad):
    with pytest.raises(ValueError, match="must be"):
        CheckpointRules(**bad)


def test_counted_maps_the_policy_counts():
    rules = CheckpointRules.counted(G, max_checkpoints=3, recent_checkpoints=4, divergence_checkpoints=1)
    assert (rules.prompt, rules.recent, rules.divergence, rules.max_held) == (3, 4, 1, 8)


def test_the_ladder_takes_a_power_of_two_line_and_a_deep_rerender_goes_back_to_it():
    """ladder_from 2 chunks: lines at 32, 64, 128, ... rows. A 200-row prompt read one chunk a launch holds
    its prompt line (192) and the ladder's 32, 64 and 128; the ladder rows are never trimmed by the prompt cap;
    a re-render at row 150 goes back to 128, not to 0."""
    b = book(prompt=1, ladder_from=2 * G)
    assert [b.rules.is_ladder_line(r) for r in (G, 2 * G, 3 * G, 4 * G, 6 * G, 8 * G)] == [
        False, True, False, True, False, True]
    assert b.rules.ladder_lines(200) == [32, 64, 128]
    b.feed(200, prompt_end=200)
    read(b, 0, 192)
    assert b.positions(LADDER) == [32, 64, 128] and b.positions(PROMPT) == [192]
    b.feed(300, prompt_end=300)
    read(b, 192, 288)  # the prompt cap (1) moves to 288; the ladder stays, and gains 256
    assert b.positions(PROMPT) == [288] and b.positions(LADDER) == [32, 64, 128, 256]
    assert b.roll_back(150) == (128, (256, 288))
    assert b.positions(None) == [32, 64, 128]


def test_a_chunk_group_ends_on_a_ladder_line_so_its_checkpoint_is_taken():
    b = book(ladder_from=4 * G)
    assert b.group_chunks(0, 8) == 4  # 0 -> 64: the ladder's first line ends it
    assert b.group_chunks(4 * G, 8) == 4  # 64 -> 128
    assert b.group_chunks(8 * G, 8) == 8  # 128 -> 256: the next line is the group's end
    assert b.may_take_at(8 * G) and not b.may_take_at(6 * G)


@pytest.mark.parametrize("bad", [G + 1, -G, 1.5])
def test_a_ladder_off_the_grid_is_named(bad):
    with pytest.raises(ValueError, match="QSE_SERVED_CHECKPOINT_LADDER.*multiple of the grid"):
        CheckpointRules(G, ladder_from=bad)
