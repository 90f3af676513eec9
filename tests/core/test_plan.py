"""The plan passed to the executor: prompt first, then the output; whole chunks only."""

from qse.core.ledger import Role
from qse.core.plan import Backlog, Window, next_backlog, plan_read, whole_chunks


def test_prompt_first_then_output():
    grid = 512
    # prompt 1200 ids: chunks [0, 512) and [512, 1024) are prompt; [1024, 1536) needs 336 output ids
    assert next_backlog(0, 1200, 1200, grid) is Backlog.PROMPT
    assert next_backlog(512, 1200, 1200, grid) is Backlog.PROMPT
    assert next_backlog(1024, 1200, 1200, grid) is None  # the tail waits
    assert next_backlog(1024, 1200, 1535, grid) is None
    assert next_backlog(1024, 1200, 1536, grid) is Backlog.OUTPUT
    assert whole_chunks(0, 1200, grid) == 2
    assert whole_chunks(1024, 1536, grid) == 1
    assert whole_chunks(2048, 1536, grid) == 0


def test_plan_fields():
    plan = plan_read(Window.RATION, session_id="s", turn_id="s#1", committed_rows=512, prompt_tokens=1200,
                     known_tokens=2100, grid=512, budget_ms=150.0, first_chunk_est_ms=44.544)
    assert plan.backlog is Backlog.PROMPT
    assert plan.max_chunks == 3
    assert plan.end_row_max == 2048
    assert plan.role is Role.READER_RATION
    assert plan.sync_first and not plan.stop_when_waiting

    idle = plan_read(Window.IDLE, session_id="s", turn_id=None, committed_rows=1024, prompt_tokens=1200,
                     known_tokens=2100, grid=512, budget_ms=2000.0, first_chunk_est_ms=44.544)
    assert idle.backlog is Backlog.OUTPUT
    assert idle.stop_when_waiting and not idle.sync_first
    assert idle.role is Role.READER_IDLE


def test_no_plan_without_a_whole_chunk_or_off_grid():
    kw = dict(session_id="s", turn_id=None, prompt_tokens=100, grid=512, budget_ms=1.0, first_chunk_est_ms=1.0)
    assert plan_read(Window.IDLE, committed_rows=0, known_tokens=511, **kw) is None
    assert plan_read(Window.IDLE, committed_rows=100, known_tokens=5000, **kw) is None


def test_a_chunk_group_is_a_power_of_two_that_ends_at_the_first_line_inside_it():
    from qse.core.plan import group_size

    assert [group_size(0, n, 512) for n in (1, 2, 3, 4, 7, 8, 16)] == [1, 2, 2, 4, 4, 8, 16]
    # a line 3 chunks in (from either set): the group may cover 3, so it reads 2; a line at its end does not cut it
    assert group_size(1024, 8, 512, {2560}) == 2
    assert group_size(1024, 8, 512, set(), {2560}) == 2
    assert group_size(1024, 4, 512, {3072}) == 4
    assert group_size(1024, 8, 512, {1536}) == 1
