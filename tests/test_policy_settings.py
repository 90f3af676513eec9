"""The policy: read once from the settings at an entry point, its defaults the registry's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qse.policy import Policy
from qse.settings import REGISTRY, EngineSettings


def test_each_field_s_default_is_its_setting_s_default():
    for f in dataclasses.fields(Policy):
        if f.metadata:
            assert f.default == REGISTRY[f.metadata["setting"]].default, f.name
    assert Policy() == dataclasses.replace(Policy.from_settings(EngineSettings({})), journal_dir=None)


def test_the_switches_reach_the_policy_and_overrides_win_where_given(tmp_path):
    env = {"QSE_SHADOW_RATION_AFTER_S": "2.5", "QSE_NARRATOR_SHARE": "0.05", "QSE_SHADOW_DIVERGENCE_CHECKPOINTS": "3",
           "QSE_KERNELS": "naive", "QSE_PDL": "off", "QSE_CACHE_DIR": str(tmp_path)}
    policy = Policy.from_settings(EngineSettings(env), ration=0.04, slice_ms=None)
    assert (policy.ration_after_s, policy.narrator_share, policy.kernels, policy.pdl) == (2.5, 0.05, "naive", False)
    assert (policy.ration, policy.slice_ms) == (0.04, 150.0)  # None: a flag not given
    assert policy.reader_checkpoints() == dict(max_checkpoints=6, recent_checkpoints=4, divergence_checkpoints=3)
    assert policy.journal_dir == tmp_path / "shadow"
    shadow_dir = tmp_path / "j"
    assert Policy.from_settings(EngineSettings({"QSE_SHADOW_DIR": str(shadow_dir)})).journal_dir == Path(shadow_dir)


def test_a_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Policy().ration = 0.5  # type: ignore[misc]


def test_the_replay_runs_the_conductor_s_policy_object():
    from qse.replay.simulator import SimOptions

    opt = SimOptions.of(ration_after_s=0.0, idle_wake=False, prefill_share=0.02)
    assert opt.policy == dataclasses.replace(Policy(), ration_after_s=0.0, idle_wake=False)
    assert opt.prefill_share == 0.02
    assert SimOptions().policy == Policy()
    with pytest.raises(TypeError, match="'rations'"):
        SimOptions.of(rations=0.1)


def test_the_served_round_switches_reach_the_books_and_bad_values_are_named(tiny_engine):
    """QSE_SERVED_CHUNK_GROUP sizes the served book's launches and QSE_DECODE_YIELD_MS the scheduler's rounds;
    a value neither can take is an error that names the switch."""
    from qse.core.ledger import GpuLedger
    from qse.core.chunk_cost import ChunkCostEstimator
    from qse.core.scheduler import Scheduler
    from qse.runtime.conductor import served_sessions

    policy = Policy.from_settings(EngineSettings({"QSE_SERVED_CHUNK_GROUP": "4", "QSE_DECODE_YIELD_MS": "150",
                                                  "QSE_SERVED_KV_GB": "0.01", "QSE_SERVED_GRAPHS": "0"}))
    assert served_sessions(tiny_engine, policy).book.chunk_group == 4
    assert Scheduler(policy, ChunkCostEstimator(1.0), GpuLedger()).rounds.decode_yield_ms == 150.0
    with pytest.raises(ValueError, match=r"QSE_SERVED_CHUNK_GROUP\).*got 0"):
        served_sessions(tiny_engine, dataclasses.replace(policy, served_chunk_group=0))
    with pytest.raises(ValueError, match=r"QSE_DECODE_YIELD_MS\).*got -1"):
        Scheduler(dataclasses.replace(policy, decode_yield_ms=-1.0), ChunkCostEstimator(1.0), GpuLedger())
