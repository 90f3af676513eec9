"""Decode rounds on the whole model over qse's Triton kernels (interpreted on CPU, the graph path's static
form): where every op is row-invariant (QSE_KERNELS=invariant, whose batched head is its own GEMM) a
sequence's logits are the same bits decoded in a round of two sequences of different lengths (a bucket of
three: one padding row) and alone in a round of one, and so is the state the round leaves (GDN state and
every KV row: what the next round reads); on the triton op set a round of one is the single-sequence path
bit for bit (one row takes the same GEMVs either way)."""

from __future__ import annotations

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.kv import PagedKV
from qse.engine.rounds import DecodeRounds
from qse.models import resolve
from rounds_rig import PAGE_ROWS, PROMPTS, decode_rounds, make_engine, make_pool, prefill, same_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("few_programs")]


def test_invariant_rounds_give_every_row_the_bits_it_gets_alone(small_model_dir, cache_dir):
    engine = make_engine("invariant", small_model_dir, cache_dir)
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS) > 1  # rows of different lengths
    starts = prefill(small_model_dir, cache_dir, PROMPTS)
    # two rows in the bucket of three: one padding row
    together, together_states, bucket = decode_rounds(engine, starts, max_running=3, buckets=(1, 3))
    assert bucket > len(starts)
    assert max(state.length for state in together_states) > PAGE_ROWS  # a row written past a page line
    for i, start in enumerate(starts):
        [alone], [alone_state], one = decode_rounds(engine, [start], max_running=1)
        assert one == 1
        assert len(alone) == len(together[i]) and all(torch.equal(a, b) for a, b in zip(together[i], alone))
        assert same_state(together_states[i], alone_state)
    # (the single-sequence path against a round of one: test_a_round_of_one_is_the_single_sequence_path; its
    # head is torch's, not row-invariant, so this set is compared there only through the triton kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton", "invariant"])
def test_rounds_under_cuda_graphs_equal_the_static_flow(cache_dir, kernels):
    """The same script of rounds (sequences joining and leaving, buckets 1 to 4, device tokens launched
    ahead, a page line crossed) captured and uncaptured: the same logits bit for bit, and each graph
    captured once."""
    torch.manual_seed(0)
    engine = Engine(resolve("", torch.device("cuda"), torch.bfloat16, cache_dir), kernels=kernels)
    prompts = [list(range(300, 300 + n)) for n in (60, 130, 7, 200)]
    out = {}
    for graphs in (True, "static"):
        pool = make_pool(engine)
        rounds = DecodeRounds(engine, pool, max_running=4, graphs=graphs)
        assert rounds.capture == (graphs is True)
        rounds.warm()
        live, rows = {}, []

        def join(i):
            cache = engine.new_cache(kv=PagedKV(pool))
            logits, _ = engine.forward(cache, engine.ids_tensor(prompts[i]), "last")
            live[i] = (rounds.admit(cache), logits[-1].argmax().view(1))

        for step, event in enumerate([("join", 0), ("join", 1), None, ("join", 2), ("join", 3), None,
                                      ("leave", 1), None, ("leave", 0), None, None]):
            if event and event[0] == "join":
                join(event[1])
            elif event:
                rounds.release(live.pop(event[1])[0]).kv.release_all()
            names = sorted(live)
            ids = torch.cat([live[n][1] for n in names])  # on the device: never read back between rounds
            logits = rounds.run([live[n][0] for n in names], ids)
            rows.append(logits.clone())
            for row, name in enumerate(names):
                live[name] = (live[name][0], logits[row].argmax().view(1))
        out[graphs] = rows
        if graphs is True:
            assert rounds.num_graphs == len(rounds.buckets)
    assert all(torch.equal(a, b) for a, b in zip(out[True], out["static"]))


@pytest.mark.gpu
def test_verify_under_cuda_graphs_equals_the_static_flow(cache_dir):
    """Verifies of every width up to the rounds' verify width (the narrower ones replay graphs of their own),
    kept at varying accepted rows, captured and uncaptured: the same logits and states bit for bit. Between
    the rounds the allocator is churned, so a graph that kept the address of a tensor it does not own (the
    rows' offsets in their window once were) reads garbage and fails here."""
    torch.manual_seed(0)
    engine = Engine(resolve("", torch.device("cuda"), torch.bfloat16, cache_dir), kernels="triton")
    prompts = [list(range(300, 300 + n)) for n in (60, 130)]
    script = [(2, [1, 0]), (4, [3, 2]), (3, [0, 2]), (1, None), (2, [1, 1]), (4, [0, 0]), (3, [2, 1])]
    out = {}
    for graphs in (True, "static"):
        pool = make_pool(engine)
        rounds = DecodeRounds(engine, pool, max_running=2, graphs=graphs, verify_width=4)
        slots, tokens = [], []
        for prompt in prompts:
            cache = engine.new_cache(kv=PagedKV(pool))
            logits, _ = engine.forward(cache, engine.ids_tensor(prompt), "last")
            slots.append(rounds.admit(cache))
            tokens.append(int(logits[-1].argmax()))
        rows = []
        for width, accepted in script:
            churn = [torch.randn(4096, device="cuda") for _ in range(8)]  # reuse what was freed
            del churn
            if accepted is None:
                logits = rounds.run(slots, tokens)
                tokens = logits.argmax(-1).tolist()
            else:
                drafts = [[(t + 7 * j) % 300 for j in range(1, width)] for t in tokens]
                logits = rounds.verify(slots, [[t] + d for t, d in zip(tokens, drafts)])
                rounds.keep(slots, accepted)
                tokens = [int(logits[i, a].argmax()) for i, a in enumerate(accepted)]
            rows.append(logits.clone())
        rows.append(torch.cat([rounds.states.recurrent[:, slots].flatten(), rounds.states.conv[:, slots].float().flatten()]))
        out[graphs] = rows
    assert all(torch.equal(a, b) for a, b in zip(out[True], out["static"]))
