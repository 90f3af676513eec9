"""The shadow session: exact reads on the grid, rollback to checkpoints, forks, ask(), bad input."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qse.shadow.reader import FORK_ALIGN, PAD_ID, ShadowError, ShadowReader, UnknownSession

GRID = 32
VOCAB = 248000


def _reader(engine, grid=GRID):
    return ShadowReader(engine, grid=grid, pool_bytes=16 << 20)


def _state_bytes(reader, session):
    """Everything at or below the committed length, as bytes."""
    s = session
    parts = [t.clone() for t in (*s.cache.recurrent, *s.cache.conv)]
    for slot in range(len(reader.engine.cfg.attention_layers)):
        k, v = s.kv.read(slot, s.committed)
        parts += [k.clone(), v.clone()]
    return parts, s.committed, list(s.ids)


def _assert_fresh_equal(reader, sid):
    live = reader.get(sid)
    fresh = reader.fresh_prefill(live.ids, "__fresh__")
    assert reader.state_equal(live, fresh) == {"committed": True, "kv": True, "recurrent": True, "conv": True}
    reader.close("__fresh__")


# ---- the property test ---------------------------------------------------------------------------
turn_edits = st.lists(
    st.tuples(
        st.sampled_from(["extend", "drop_reasoning", "edit_middle", "shrink"]),
        st.integers(min_value=1, max_value=3 * GRID),  # how many new ids
        st.integers(min_value=0, max_value=10_000),  # where (scaled to the session)
    ),
    min_size=2, max_size=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=turn_edits, seed=st.integers(0, 2**16))
def test_replay_equals_fresh_prefill_after_every_turn(tiny_engine, edits, seed):
    gen = torch.Generator().manual_seed(seed)
    reader = _reader(tiny_engine)

    def fresh_ids(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    ids = fresh_ids(2 * GRID + 5)
    reader.feed("s", ids, prompt_end=len(ids))
    reader.read_all("s")
    for kind, n, where in edits:
        if kind == "extend":  # a tool loop: the previous prompt is a prefix of the next
            ids = ids + fresh_ids(n)
        elif kind == "drop_reasoning":  # the template drops an earlier turn's span
            cut = where % max(1, len(ids))
            ids = ids[:cut] + ids[cut + min(n, len(ids) - cut):] + fresh_ids(n)
        elif kind == "edit_middle":  # a client prunes old tool output
            pos = where % max(1, len(ids))
            ids = ids[:pos] + fresh_ids(1) + ids[pos + 1:]
        else:  # compaction: the prompt shrinks
            ids = ids[: max(1, len(ids) - n)]
        report = reader.feed("s", ids, prompt_end=len(ids))
        reader.read_all("s")
        session = reader.get("s")
        assert session.committed == (len(ids) // GRID) * GRID
        assert len(session.checkpoints) <= reader.max_checkpoints
        if report.rolled_back_to is not None:
            assert report.rolled_back_to <= report.first_diff
        _assert_fresh_equal(reader, "s")


# ---- rollback, checkpoints -----------------------------------------------------------------------
def test_rollback_rereads_only_from_the_checkpoint(tiny_engine):
    reader = _reader(tiny_engine)
    gen = torch.Generator().manual_seed(7)
    turn1 = torch.randint(0, VOCAB, (3 * GRID + 10,), generator=gen).tolist()
    turn2 = turn1 + torch.randint(0, VOCAB, (4 * GRID,), generator=gen).tolist()
    reader.feed("s", turn1, prompt_end=len(turn1))
    reader.read_all("s")
    reader.feed("s", turn2, prompt_end=len(turn2))
    reader.read_all("s")
    session = reader.get("s")
    assert session.checkpoint_positions() == [3 * GRID, 7 * GRID]
    chunks_before = session.stats.chunks_read
    # the next prompt differs just after the first turn's prompt end
    diverged = turn2[: 3 * GRID + 20] + [5] + turn2[3 * GRID + 21 :]
    report = reader.feed("s", diverged, prompt_end=len(diverged))
    assert report.first_diff == 3 * GRID + 20
    assert report.rolled_back_to == 3 * GRID
    assert session.checkpoint_positions() == [3 * GRID]  # checkpoints past the cut are dropped
    reader.read_all("s")
    assert session.stats.chunks_read - chunks_before == 4  # rows 3G..7G again, nothing below
    assert session.stats.ids_reread == 4 * GRID
    _assert_fresh_equal(reader, "s")


def test_divergence_without_checkpoint_starts_over(tiny_engine):
    reader = _reader(tiny_engine)
    ids = list(range(1000, 1000 + 3 * GRID))
    reader.feed("s", ids)  # no prompt_end: no checkpoint
    reader.read_all("s")
    report = reader.feed("s", [7] + ids[1:])
    assert report.rolled_back_to == 0 and reader.get("s").stats.restarts == 1
    reader.read_all("s")
    _assert_fresh_equal(reader, "s")


def test_divergence_in_the_tail_costs_nothing(tiny_engine):
    reader = _reader(tiny_engine)
    ids = list(range(2000, 2000 + 2 * GRID + 10))
    reader.feed("s", ids)
    reader.read_all("s")
    report = reader.feed("s", ids[: 2 * GRID + 3] + [9, 9, 9])
    assert report.rolled_back_to is None and reader.get("s").committed == 2 * GRID


def test_at_most_six_checkpoints_newest_kept(tiny_engine):
    reader = _reader(tiny_engine)
    ids: list[int] = []
    for turn in range(8):
        ids = ids + list(range(3000 + turn * 100, 3000 + turn * 100 + GRID))
        reader.feed("s", ids, prompt_end=len(ids))
        reader.read_all("s")
    assert reader.get("s").checkpoint_positions() == [GRID * k for k in range(3, 9)]


def test_read_step_reads_one_whole_chunk(tiny_engine):
    reader = _reader(tiny_engine)
    reader.feed("s", list(range(100, 100 + 2 * GRID + 7)))
    first = reader.read_step("s")
    assert (first.position, first.backlog, first.context) == (GRID, GRID, 0) and first.gpu_ms > 0
    second = reader.read_step("s")
    assert (second.position, second.backlog) == (2 * GRID, 0)
    assert reader.read_step("s") is None  # the 7-id tail waits
    assert reader.get("s").tail == list(range(100 + 2 * GRID, 100 + 2 * GRID + 7))


# ---- forks ---------------------------------------------------------------------------------------
def test_fork_leaves_committed_state_byte_identical(tiny_engine):
    reader = _reader(tiny_engine)
    ids = list(range(500, 500 + 3 * GRID + 17))
    reader.feed("s", ids)
    reader.read_all("s")
    session = reader.get("s")
    before, committed, known = _state_bytes(reader, session)
    pages_before = list(session.kv.pages)
    free_before = reader.pool.num_free
    result = reader.ask("s", list(range(10, 60)), ["A", "B", "C"])
    summary = reader.summarize("s", list(range(70, 90)), max_tokens=4)
    after, committed_after, known_after = _state_bytes(reader, session)
    assert committed_after == committed and known_after == known
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert session.kv.pages == pages_before and reader.pool.num_free == free_before
    assert result.position == len(ids) + 50 and result.tokens_forwarded == 17 + 50
    assert abs(sum(result.distribution.values()) - 1.0) < 1e-5
    assert result.label == max(result.distribution, key=result.distribution.get)
    assert len(summary.token_ids) == 4
    _assert_fresh_equal(reader, "s")


def test_ask_equals_a_plain_forward_of_tail_and_question(tiny_engine):
    reader = _reader(tiny_engine)
    ids = list(range(800, 800 + 2 * GRID + 9))
    reader.feed("s", ids)
    reader.read_all("s")
    question = list(range(40, 70))
    letters = reader.letter_ids(["A", "B"])
    result = reader.ask("s", question, ["A", "B"])
    model = tiny_engine.model
    cache = model.new_cache()
    for s in range(0, 2 * GRID, GRID):
        model.forward(torch.tensor(ids[s : s + GRID]), cache, "none")
    # the fork is read padded to a multiple of FORK_ALIGN rows; the answer is the last real row's
    fork = ids[2 * GRID :] + question
    padded = fork + [PAD_ID] * (-len(fork) % FORK_ALIGN)
    logits = model.forward(torch.tensor(padded), cache, "row", logit_row=len(fork) - 1)
    expected = torch.softmax(logits[0][letters], -1).tolist()
    assert result.distribution == {"A": expected[0], "B": expected[1]}


def test_padding_does_not_reach_the_answer(tiny_engine):
    """Causality keeps the pad rows out of the answer: the padded fork's last real row agrees with an
    unpadded forward up to rounding (the GEMMs' row count differs, so not bit for bit)."""
    model = tiny_engine.model
    ids = list(range(300, 300 + 45))
    plain = model.forward(torch.tensor(ids), model.new_cache(), "last")[0]
    padded = model.forward(torch.tensor(ids + [PAD_ID] * 19), model.new_cache(), "row", logit_row=len(ids) - 1)[0]
    assert torch.allclose(plain, padded, atol=1e-4, rtol=1e-4)
    assert int(plain.argmax()) == int(padded.argmax())


def test_ask_at_an_insertion_point(tiny_engine):
    reader = _reader(tiny_engine)
    ids = list(range(900, 900 + 2 * GRID + 20))
    reader.feed("s", ids)
    reader.read_step("s")
    result = reader.ask("s", [1, 2, 3], ["A", "B"], upto=GRID + 5)
    assert result.position == GRID + 5 + 3
    reader.read_all("s")
    with pytest.raises(ShadowError, match="already committed"):
        reader.ask("s", [1, 2, 3], ["A", "B"], upto=GRID + 5)


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("choices,match", [
    ([], "non-empty list"),
    (["A", "A"], "duplicate choice 'A'"),
    (["A", "hello world"], "'hello world' is not a single token"),
    (["A", ""], "non-empty string"),
], ids=["empty", "duplicate", "multi-token", "empty-letter"])
def test_bad_choices_leave_state_untouched(tiny_engine, choices, match):
    reader = _reader(tiny_engine)
    reader.feed("s", list(range(10, 10 + GRID + 3)))
    reader.read_all("s")
    before, committed, _ = _state_bytes(reader, reader.get("s"))
    with pytest.raises(ShadowError, match=match):
        reader.ask("s", [1, 2], choices)
    after, committed_after, _ = _state_bytes(reader, reader.get("s"))
    assert committed == committed_after and all(torch.equal(x, y) for x, y in zip(before, after))


def test_question_over_the_window_and_unknown_session(tiny_engine):
    reader = _reader(tiny_engine)
    reader.feed("s", [1, 2, 3])
    window = tiny_engine.cfg.max_position_embeddings
    with pytest.raises(ShadowError, match=f"longer than the model window {window}"):
        reader.ask("s", [5] * (window + 1), ["A", "B"])
    with pytest.raises(UnknownSession, match="unknown session 'nope'"):
        reader.ask("nope", [1], ["A", "B"])
    with pytest.raises(ShadowError, match="outside the vocabulary"):
        reader.feed("s", [1, 248320])
    assert reader.get("s").ids == [1, 2, 3]


# ---- realistic sessions through the real template ------------------------------------------------
def _agent_session():
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object",
              "properties": {"cmd": {"type": "string"}}}}}]
    sys_msg = {"role": "system", "content": "You are a coding agent. " + "Follow the rules. " * 30}
    user1 = {"role": "user", "content": "Fix the failing test in parser.py. " + "Context line. " * 40}
    a1 = {"role": "assistant", "content": "", "reasoning_content": "I will run the tests first. " * 8,
          "tool_calls": [{"id": "1", "type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": "pytest -x"})}}]}
    t1 = {"role": "tool", "tool_call_id": "1", "content": "FAILED test_parser.py::test_x " + "trace " * 60}
    a2 = {"role": "assistant", "content": "", "reasoning_content": "The parser drops the last token. " * 8,
          "tool_calls": [{"id": "2", "type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": "sed -i s/a/b/ parser.py"})}}]}
    t2 = {"role": "tool", "tool_call_id": "2", "content": "ok"}
    a3 = {"role": "assistant", "content": "Fixed: the parser now keeps the last token.", "reasoning_content": "Done. " * 10}
    user2 = {"role": "user", "content": "Thanks. Now add a test for empty input."}
    return tools, [[sys_msg, user1], [sys_msg, user1, a1, t1], [sys_msg, user1, a1, t1, a2, t2],
                   [sys_msg, user1, a1, t1, a2, t2, a3, user2]]


def test_template_rendered_agent_session_reads_correctly(tiny_engine):
    chat = tiny_engine.chat
    tools, turns = _agent_session()
    reader = _reader(tiny_engine)
    prompts = [chat.tokenizer.encode(chat.render(msgs, tools)) for msgs in turns]
    rollbacks = []
    for prompt in prompts:
        report = reader.feed("agent", prompt, prompt_end=len(prompt))
        rollbacks.append(report.rolled_back_to)
        reader.read_all("agent")
        _assert_fresh_equal(reader, "agent")
    # inside the tool loop each prompt extends the last (the generation prompt's "<think>\n" is
    # replaced by the rendered reasoning, so those few ids sit in the tail, never committed);
    # the new user turn drops the reasoning of the earlier turn: exactly one rollback
    assert rollbacks[1] is None and rollbacks[2] is None
    assert rollbacks[3] is not None
    assert reader.get("agent").stats.rollbacks == 1
    first_diff = next(i for i, (a, b) in enumerate(zip(prompts[2], prompts[3])) if a != b)
    assert rollbacks[3] <= first_diff


def test_shadow_check_command(tiny_engine, tmp_path, capsys):
    chat = tiny_engine.chat
    tools, turns = _agent_session()
    lines = [json.dumps({"messages": msgs, "tools": tools, "output_ids": [100 + i, 200 + i, chat.tokenizer.im_end_id]})
             for i, msgs in enumerate(turns)]
    lines.append(json.dumps({"prompt": "<|im_start|>user\nplain prompt<|im_end|>\n"}))
    session_file = tmp_path / "session.jsonl"
    session_file.write_text("\n".join(lines))
    from qse.cli import main

    assert main(["shadow-check", "--model", "", "--device", "cpu", "--dtype", "float32", "--session", str(session_file),
                 "--grid", str(GRID), "--probes", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bit_equal"] is True and report["turns"] == 5
    assert report["rollbacks"] >= 1 and report["ids_reread"] > 0
    assert report["probes_same_top"] == 2 and report["probes_max_kl"] < 1e-2


def test_shadow_check_noise_floor(tiny_engine, tmp_path):
    """The fp32 twin of an fp32 engine is the same model: exactly zero KL. A bf16 engine against its
    fp32 twin shows the dtype's rounding, which the grid's KL is read against."""
    from qse.shadow.check import cast_twin, run_shadow_check

    session_file = tmp_path / "session.jsonl"
    session_file.write_text("\n".join(json.dumps({"prompt_ids": list(range(1000, 1000 + n))}) for n in (40, 75)))
    report = run_shadow_check(tiny_engine, session_file, GRID, num_probes=2, noise_floor=True)
    assert report["probes_max_kl_vs_fp32"] == 0.0
    assert all(p["same_top_as_fp32"] and p["top_margin"] >= 0 for p in report["probes"])
    engine16 = cast_twin(tiny_engine, torch.bfloat16)
    report16 = run_shadow_check(engine16, session_file, GRID, num_probes=1, noise_floor=True)
    assert report16["bit_equal"] is True
    assert 0.0 < report16["probes_max_kl_vs_fp32"] < 1.0


def test_append_is_feed_of_the_longer_list(tiny_engine):
    a, b = _reader(tiny_engine), _reader(tiny_engine)
    ids = list(range(600, 600 + GRID + 9))
    for reader in (a, b):
        reader.feed("s", ids, prompt_end=len(ids))
        reader.read_all("s")
    more = list(range(50, 50 + GRID))
    ra = a.append("s", more)
    rb = b.feed("s", ids + more)
    assert (ra.position, ra.backlog, ra.tail) == (rb.position, rb.backlog, rb.tail)
    assert a.get("s").ids == b.get("s").ids
    a.read_all("s")
    b.read_all("s")
    assert all(a.state_equal(a.get("s"), b.get("s")).values())
    with pytest.raises(ShadowError, match="outside the vocabulary"):
        a.append("s", [5, -1])
    assert a.get("s").ids == b.get("s").ids  # nothing appended


def test_recent_and_divergence_checkpoints(tiny_engine):
    """Optional checkpoints: the newest lines read (a ring) and the line of each re-render place. A rollback
    goes to the newest of any kind at or below the change, and the state still equals a fresh prefill."""
    ids = list(range(2000, 2000 + 5 * GRID))
    recent = ShadowReader(tiny_engine, grid=GRID, pool_bytes=16 << 20, recent_checkpoints=2)
    recent.feed("s", ids, prompt_end=GRID + 3)
    recent.read_all("s")
    s = recent.get("s")
    assert s.checkpoint_positions() == [GRID]  # the prompt end's line
    assert s.checkpoint_positions("recent") == [4 * GRID, 5 * GRID]
    assert recent.feed("s", ids[: 4 * GRID + 7] + [5, 6] + ids[4 * GRID + 9 :]).rolled_back_to == 4 * GRID
    recent.read_all("s")
    _assert_fresh_equal(recent, "s")

    div = ShadowReader(tiny_engine, grid=GRID, pool_bytes=16 << 20, divergence_checkpoints=1)
    div.feed("s", ids, prompt_end=GRID + 3)
    div.read_all("s")
    edited = ids[: 3 * GRID + 7] + [5, 6] + ids[3 * GRID + 9 :]
    assert div.feed("s", edited).rolled_back_to == GRID  # nothing nearer yet: the prompt end's line
    s = div.get("s")
    assert s.divergence_lines == [3 * GRID]
    div.read_all("s")
    assert s.checkpoint_positions("divergence") == [3 * GRID]  # the re-read took it
    _assert_fresh_equal(div, "s")
    again = edited[: 3 * GRID + 7] + [9, 9] + edited[3 * GRID + 9 :]
    assert div.feed("s", again).rolled_back_to == 3 * GRID  # the same place again: back to its line only
    div.read_all("s")
    _assert_fresh_equal(div, "s")
    with pytest.raises(ShadowError, match="recent_checkpoints"):
        ShadowReader(tiny_engine, grid=GRID, pool_bytes=1 << 20, recent_checkpoints=-1)


def test_turn_ids_are_learnt_by_what_is_new_and_fall_back_to_a_feed(tiny_engine):
    """A slice hands the reader only a running turn's new ids while the session stands at the epoch the turn fed
    its prompt at; a session whose ids were replaced since is compared, and fed where it differs. Either way the
    session ends holding the turn's ids and reads them to the same state as a feed of the whole list."""
    from qse.runtime.reading import TurnIds, learn

    reader, plain = _reader(tiny_engine), _reader(tiny_engine)
    prompt = list(range(700, 700 + GRID + 5))
    out = list(range(40, 40 + GRID + 3))
    reader.feed("s", prompt, prompt_end=len(prompt))
    epoch = reader.get("s").epoch
    appended = []
    real_append = reader.append
    reader.append = lambda sid, new_ids, now=None: (appended.append(list(new_ids)), real_append(sid, new_ids))[1]

    view = TurnIds(prompt, tuple(out[:10]), epoch)
    assert len(view) == len(prompt) + 10 and view.since(len(prompt) - 2) == prompt[-2:] + out[:10]
    learn(reader, reader.get("s"), view)
    learn(reader, reader.get("s"), TurnIds(prompt, tuple(out), epoch, end=len(prompt) + 20))  # the narrator's end
    learn(reader, reader.get("s"), TurnIds(prompt, tuple(out), epoch))
    assert appended == [out[:10], out[10:20], out[20:]]
    assert reader.get("s").epoch == epoch  # appends keep the epoch
    assert reader.get("s").ids == prompt + out

    # the session's ids replaced by a feed (a new epoch): a stale view is compared, not trusted
    reader.read_all("s")
    edited = prompt[:3] + [9] + prompt[4:]
    reader.feed("s", edited + out[:5])
    assert reader.get("s").epoch != epoch and reader.get("s").stats.rollbacks == 1
    reader.read_all("s")
    learn(reader, reader.get("s"), TurnIds(prompt, tuple(out), epoch))
    assert reader.get("s").ids == prompt + out
    assert reader.get("s").stats.rollbacks == 2  # the view's prompt differs at id 3: read again from there
    reader.read_all("s")
    plain.feed("s", prompt + out)
    plain.read_all("s")
    assert all(reader.state_equal(reader.get("s"), plain.get("s")).values())
