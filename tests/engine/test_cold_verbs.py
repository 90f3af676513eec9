"""The engine's cold verbs over the adapter's StateManifest: cache_state lists what the manifest lists,
cost() is the bytes of an actual state, a restore is bit exact, and a foreign state is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qse.engine.engine import Engine
from qse.engine.kv import KVPool, PagedKV
from qse.models import ResolvedModel
from qse.models.linear import DenseLinear
from qse.models.qwen3_5.config import parse_config
from qse.models.qwen3_5.layout import LoadedWeights, expected_shapes, is_linear
from qse.models.qwen3_5.model import Qwen35Model
from qse.models.qwen3_5.presets import preset_config_dict
from qse.models.state import SECTION, VIEW, ModelState, StateManifest, StateMismatch


def read(engine: Engine, length: int, kv=None, seed: int = 0):
    """A cache that has read `length` random ids (in two pieces, so the KV rows span more than one write)."""
    ids = torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(seed))
    cache = engine.new_cache(kv=kv)
    engine.prefill(cache, ids, chunk=48)
    return cache


def assert_lists(manifest: StateManifest, state: ModelState) -> None:
    """The state holds exactly the manifest's tensors, of its shapes and dtypes, and costs what it says."""
    assert set(state.sections) == {t.name for t in manifest.sections}
    assert set(state.views) == {t.name for t in manifest.views}
    for t in manifest.sections:
        assert (tuple(state.sections[t.name].shape), state.sections[t.name].dtype) == (t.shape, t.dtype)
    for t in manifest.views:
        assert (tuple(state.views[t.name].shape), state.views[t.name].dtype) == ((state.length, *t.shape), t.dtype)
    assert state.signature() == manifest.signature()
    assert manifest.cost(state.length) == state.nbytes


@pytest.mark.parametrize("length", [0, 1, 100], ids=["empty", "one-token", "100-tokens"])
def test_the_embedded_models_manifest_lists_what_cache_state_holds(tiny_engine, length):
    manifest = tiny_engine.manifest()
    cfg = tiny_engine.cfg
    assert len(manifest.sections) == 2 * len(cfg.gdn_layers) and len(manifest.views) == 2 * len(cfg.attention_layers)
    cache = read(tiny_engine, length) if length else tiny_engine.new_cache()
    state = tiny_engine.cache_state(cache)
    assert state.length == length
    assert_lists(manifest, state)
    assert tiny_engine.cost(length) == state.nbytes
    assert tiny_engine.cost(length + 1) - tiny_engine.cost(length) == tiny_engine.state_bytes_per_token()


def meta_engine(preset: str, dtype: torch.dtype) -> Engine:
    """A preset's model with weights on the meta device (shapes only, no memory), behind an Engine."""
    cfg = parse_config(preset_config_dict(preset))
    tensors = {n: torch.empty(s, device="meta", dtype=dtype) for n, s in expected_shapes(cfg).items()}
    weights = LoadedWeights(tensors={n: t for n, t in tensors.items() if not is_linear(n)},
                            linears={n: DenseLinear(t) for n, t in tensors.items() if is_linear(n)})
    model = Qwen35Model(cfg, weights, "meta", dtype)
    return Engine(ResolvedModel(model, None, preset, "preset", "qwen3_5", preset), kernels="naive")


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3.5-27b"])
def test_a_presets_manifest_lists_what_cache_state_holds(preset):
    engine = meta_engine(preset, torch.bfloat16)
    manifest, length = engine.manifest(), 1000
    cache = engine.new_cache()
    for t in manifest.views:  # rows written as a forward writes them: a slot's keys and values together
        if t.part == 0:
            rows = torch.empty((length, *t.shape), dtype=t.dtype, device="meta")
            cache.kv.write(t.index, 0, rows, rows)
    cache.length = length
    state = engine.cache_state(cache)
    assert_lists(manifest, state)
    # GDN recurrent state in fp32 whatever the model dtype; conv state and KV rows in the model dtype
    assert {t.dtype for t in manifest.sections} == {torch.float32, torch.bfloat16}
    assert {t.dtype for t in manifest.views} == {torch.bfloat16}
    assert engine.restore_cache(state, engine.new_cache().kv).length == length


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_state_restore_cache_round_trip_is_bit_exact(tiny_engine, paged):
    cfg = tiny_engine.cfg
    pool = KVPool(16, 32, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, tiny_engine.dtype, "cpu")
    source = read(tiny_engine, 100, kv=PagedKV(pool) if paged else None, seed=1)
    state = tiny_engine.cache_state(source)
    restored = tiny_engine.restore_cache(state, PagedKV(pool))
    assert restored is not None and restored.length == 100
    assert tiny_engine.cache_state(restored).equal(state)
    # the restored cache reads on exactly as the one it came from
    more = torch.randint(0, 4000, (20,), generator=torch.Generator().manual_seed(2))
    a, _ = tiny_engine.forward(source, more)
    b, _ = tiny_engine.forward(restored, more)
    assert torch.equal(a, b)
    assert tiny_engine.cache_state(restored).equal(tiny_engine.cache_state(source))


def test_restore_answers_none_when_the_kv_store_has_no_room(tiny_engine):
    cfg = tiny_engine.cfg
    state = tiny_engine.cache_state(read(tiny_engine, 100))
    small = KVPool(2, 32, len(cfg.attention_layers), cfg.num_key_value_heads, cfg.head_dim, tiny_engine.dtype, "cpu")
    assert tiny_engine.restore_cache(state, PagedKV(small)) is None


def _rename(state: ModelState) -> ModelState:
    name = next(iter(state.sections))
    sections = dict(state.sections)
    sections["other." + name] = sections.pop(name)
    return dataclasses.replace(state, sections=sections)


def _drop_view(state: ModelState) -> ModelState:
    return dataclasses.replace(state, views=dict(list(state.views.items())[1:]))


def _extra(state: ModelState) -> ModelState:
    return dataclasses.replace(state, sections={**state.sections, "extra": torch.zeros(3)})


def _dtype(state: ModelState) -> ModelState:
    return dataclasses.replace(state, sections={k: v.double() for k, v in state.sections.items()})


def _shape(state: ModelState) -> ModelState:
    return dataclasses.replace(state, views={k: v[:, :1] for k, v in state.views.items()})


def _rows(state: ModelState) -> ModelState:
    return dataclasses.replace(state, views={k: v[:-1] for k, v in state.views.items()})


@pytest.mark.parametrize("change", [_rename, _drop_view, _extra, _dtype, _shape, _rows],
                         ids=["renamed-section", "missing-view", "extra-tensor", "other-dtype", "other-shape", "rows-not-length"])
def test_a_state_the_manifest_does_not_list_is_refused(tiny_engine, change):
    foreign = change(tiny_engine.cache_state(read(tiny_engine, 40)))
    with pytest.raises(StateMismatch, match="state"):
        tiny_engine.restore_cache(foreign, tiny_engine.new_cache().kv)
    if change is not _rows:  # the signature covers names, shapes and dtypes (not the length)
        assert foreign.signature() != tiny_engine.manifest().signature()


def test_a_state_of_another_model_is_refused(tiny_engine):
    other = meta_engine("qwen3.5-0.8b", torch.bfloat16)
    empty = other.cache_state(other.new_cache())
    assert other.manifest().signature() != tiny_engine.manifest().signature()
    with pytest.raises(StateMismatch):
        tiny_engine.restore_cache(empty, tiny_engine.new_cache().kv)


def test_a_manifest_names_each_tensor_once_and_its_signature_ignores_order(tiny_engine):
    manifest = tiny_engine.manifest()
    assert StateManifest(tuple(reversed(manifest.tensors))).signature() == manifest.signature()
    with pytest.raises(ValueError, match="once"):
        StateManifest(manifest.tensors + manifest.tensors[:1])
    assert {t.kind for t in manifest.tensors} == {SECTION, VIEW}
    # sections in the cache's state_tensors() order: a checkpoint's tensors fit, another layout does not
    cache = tiny_engine.new_cache()
    assert manifest.fits_sections(cache.state_tensors())
    assert not manifest.fits_sections(list(reversed(cache.state_tensors())))
    assert not manifest.fits_sections(cache.state_tensors()[1:])
