"""The simulator goes back where the runtime's reader goes back, and holds the checkpoints it holds.

The simulator's decisions (which chunks each window read) are carried out on a real ShadowReader over
the tiny embedded model, fed as the conductor feeds it: the prompt with its end at a turn start, then
the turn's output. At every turn start the reader must stand where the simulator says (the same
rollback, the same row), and at the end it must hold the same checkpoints. Both ask one checkpoint book
(qse/core/checkpoints.py), so this checks the simulator's feeding and reading end to end. The simulator's checkpoint
switches are the reader's too (recent and divergence checkpoints, off by default in both).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qse.core import Window
from qse.core.checkpoints import DIVERGENCE, PROMPT, RECENT
from qse.replay.read_model import ReadModel
from qse.replay.simulator import SimOptions, Simulator, _SessionReplay
from qse.replay.usage import UsageRecord

GRID = 16
MODEL = ReadModel.flat(20.0 / GRID * 1000, grid=GRID)  # 20 ms a chunk: the windows leave some unread


def _build(turns, seed: int):
    """turns: (kind, a, b, out) a turn. extend: keep all held, a new ids; cut: keep a ids of the previous
    prompt, b new; short: the new prompt is the first (prompt + a) held ids (the output not kept whole)."""
    rng = random.Random(seed)
    fresh = lambda n: [rng.randrange(1, 240_000) for _ in range(n)]  # noqa: E731
    prompts, outputs, recs = [], [], []
    held: list[int] = []
    t = 0.0
    for k, (kind, a, b, out) in enumerate(turns):
        if k == 0 or kind == "extend":
            prompt = held + fresh(max(1, a))
        elif kind == "cut":
            keep = min(a, len(prompts[-1]) - 1)
            first = (held[keep] % 239_999) + 1  # differs from the held id at `keep`
            prompt = held[:keep] + [first] + fresh(b)
        else:  # short: a prefix of what is held, longer than the previous prompt, shorter than prompt + output
            prompt = held[: len(prompts[-1]) + min(a, max(0, len(held) - len(prompts[-1]) - 1))]
        output = fresh(out)
        prev = prompts[-1] if prompts else []
        shared = 0
        while shared < min(len(prev), len(prompt)) and prev[shared] == prompt[shared]:
            shared += 1
        decode_s = out / 20.0
        recs.append(UsageRecord(session="s", arrival_s=t, first_token_s=t + 0.05, end_s=t + 0.05 + decode_s,
                                prompt_tokens=len(prompt), shared_prefix_tokens=shared, output_tokens=out))
        prompts.append(prompt)
        outputs.append(output)
        held = prompt + output
        t += 0.05 + decode_s + [0.0, 0.1, 0.35, 1.5][k % 4]
    return prompts, outputs, recs


def _mirror(tiny_engine, turns, seed: int, checkpoints: int, recent: int = 0, divergence: int = 0):
    from qse.shadow.reader import ShadowReader

    prompts, outputs, recs = _build(turns, seed)
    opt = SimOptions.of(grid=GRID, checkpoints=checkpoints, estimator_bucket_tokens=64, recent_checkpoints=recent,
                     divergence_checkpoints=divergence)
    sim = Simulator(MODEL, opt, record_decisions=True)
    replay = _SessionReplay(sim, "s")
    replay.run(recs)
    starts = sim.result.turn_starts
    decisions = sim.result.decisions

    longest = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    reader = ShadowReader(tiny_engine, grid=GRID, max_checkpoints=checkpoints, recent_checkpoints=recent,
                          divergence_checkpoints=divergence, pool_bytes=tiny_engine.state_bytes_per_token() * (longest + 4 * GRID) + (1 << 20))

    def carry_out(turn: int, windows: set[Window]) -> None:
        for d in decisions:
            if d.turn != turn or d.window not in windows:
                continue
            for i in range(d.num_chunks):
                report = reader.read_step("s")
                assert report is not None and report.context == d.start_row + i * GRID, (turn, d)

    for k, (prompt, output) in enumerate(zip(prompts, outputs)):
        carry_out(k, {Window.IDLE})
        fed = reader.feed("s", prompt, len(prompt))
        session = reader.get("s")
        start = starts[k]
        assert session.committed == start.kept_tokens - start.behind_tokens, (k, start, fed)
        assert (fed.rolled_back_to is not None) == (start.rolled_back_tokens > 0), (k, start, fed)
        reader.feed("s", prompt + output)  # the output, as the ration's slices and the turn's end feed it
        carry_out(k, {Window.RATION, Window.PREFILL})
    carry_out(len(prompts), {Window.IDLE})
    assert reader.get("s").committed == replay.committed
    # the same rules (one book) fed the same: the same held rows, kind by kind
    for kind in (PROMPT, RECENT, DIVERGENCE, None):
        assert reader.get("s").checkpoint_positions(kind) == replay.book.positions(kind), kind
    assert reader.get("s").divergence_lines == replay.book.divergence_lines
    reader.close("s")
    return starts


TURNS = [("extend", 40, 0, 30), ("short", 10, 0, 20), ("extend", 50, 0, 25), ("cut", 20, 30, 10),
         ("cut", 45, 12, 40), ("extend", 33, 0, 5)]


def test_rollbacks_and_checkpoints_as_the_reader(tiny_engine):
    # read into the output, a re-render below it, a cut below every checkpoint, then the same place again
    starts = _mirror(tiny_engine, TURNS, seed=1, checkpoints=2)
    assert any(s.rolled_back_tokens for s in starts)


def test_recent_and_divergence_checkpoints_as_the_reader(tiny_engine):
    """With the reader's optional checkpoints on (the newest lines read, the re-render places) it still
    stands where the simulator says at every turn start and holds the same checkpoints."""
    _mirror(tiny_engine, TURNS, seed=1, checkpoints=2, recent=2, divergence=2)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["extend", "extend", "cut", "short"]), st.integers(1, 70),
                                st.integers(0, 40), st.integers(1, 50)), min_size=2, max_size=5),
       seed=st.integers(0, 1000), checkpoints=st.sampled_from([1, 2, 6]), recent=st.sampled_from([0, 2]),
       divergence=st.sampled_from([0, 1, 3]))
def test_rollbacks_and_checkpoints_as_the_reader_on_random_sessions(tiny_engine, turns, seed, checkpoints, recent,
                                                                   divergence):
    _mirror(tiny_engine, turns, seed, checkpoints, recent, divergence)
