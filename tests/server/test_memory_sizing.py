"""`qse serve` sizes the served model's KV pool and session cache once at start (build_service): from the
device's memory where there is a GPU (here scripted: DeviceMemory.total_and_free), the fixed 8 and 6 GiB on a
CPU; the sizes reach the served sessions, their store, the claim, the start's log event and the status; a switch
set wins; a start with too little memory, or a bad QSE_GPU_MEMORY_UTILIZATION, is refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
import structlog

from qse.cli import main
from qse.core.residency import GIB
from qse.core.sizing import SizingError, activation_reserve
from qse.runtime.planner import DeviceMemory
from qse.server.app import create_app
from qse.server.cli import build_service, serve_main
from qse.settings import REGISTRY, EngineSettings


def _settings(cache_dir, tmp_path, **env):
    return EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
                           "QSE_LEDGER": str(tmp_path / "usage.jsonl"), "QSE_HOST_CACHE_GB": "0", **env})


def _device(monkeypatch, total_gib: float, free_gib: float) -> None:
    """A GPU's figures for the sizing alone (the device stays the CPU: admission reads the machine's memory)."""
    monkeypatch.setattr(DeviceMemory, "total_and_free", lambda self: (int(total_gib * GIB), int(free_gib * GIB)))


def _sizes(service) -> tuple[int, int]:
    """The KV pool and session cache the service runs with: the policy's pool, the served store's cap, and the
    served claim's pools say the same."""
    conductor = service.conductor
    kv, cache = int(conductor.policy.served_kv_gb * GIB), service.served_store.cap_nbytes
    pools = service.planner.book.roles["served"].claim.pools
    assert dict(pools)["kv_pool"] == kv and dict(pools)["session_cache"] == cache
    assert conductor.serving.book.pool.num_pages * conductor.serving.book.pool.page_nbytes <= kv
    return kv, cache


def test_on_a_cpu_auto_keeps_the_fixed_8_and_6_gib(cache_dir, tmp_path):
    assert REGISTRY["QSE_SERVED_KV_GB"].default == 0.0 and REGISTRY["QSE_SERVED_CACHE_GB"].default == 0.0
    with structlog.testing.capture_logs() as logs:
        service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                                settings=_settings(cache_dir, tmp_path))
    assert _sizes(service) == (8 * GIB, 6 * GIB)
    event = next(e for e in logs if e["event"] == "served_memory_sized")
    assert event["kv_pool_gib"] == 8.0 and event["session_cache_gib"] == 6.0
    assert event["kv_pool_from"] == event["session_cache_from"] == "fixed"
    assert service.planner.status()["served_memory"]["kv_pool_from"] == "fixed"


async def test_on_a_gpu_the_pools_fill_what_the_device_leaves_60_40_and_the_status_shows_it(cache_dir, tmp_path,
                                                                                            monkeypatch):
    _device(monkeypatch, total_gib=4.0, free_gib=3.9)
    with structlog.testing.capture_logs() as logs:
        service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                                settings=_settings(cache_dir, tmp_path, QSE_GPU_MEMORY_UTILIZATION="0.8"))
    served, policy = service.conductor.served, service.conductor.policy
    assert service.conductor.reader.engine is served  # the reader reads the served weights: its pools alone
    cfg = served.cfg
    activations = activation_reserve(policy.round_token_budget, policy.served_grid, policy.max_running,
                                     cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, 4)
    # the decode slots: one a running turn and one for padding rows (no speculation: no verify scratch)
    budget = (int(4.0 * GIB * 0.8) - (int(4.0 * GIB) - int(3.9 * GIB)) - served.model.weights_nbytes()
              - 2 * int(0.02 * GIB) - (policy.max_running + 1) * served.cost(0) - activations)
    kv, cache = _sizes(service)
    assert abs(kv - int(budget * 0.6)) <= 1 and abs(kv + cache - budget) <= 1  # the policy holds GiB as a float
    event = next(e for e in logs if e["event"] == "served_memory_sized")
    assert (event["kv_pool_from"], event["session_cache_from"]) == ("auto", "auto")
    assert (event["total_gib"], event["free_at_start_gib"], event["utilization"]) == (4.0, 3.9, 0.8)
    assert event["reader_gib"] == round(2 * int(0.02 * GIB) / GIB, 3) and event["budget_gib"] == round(budget / GIB, 3)
    for term in ("ceiling_gib", "in_use_at_start_gib", "weights_gib", "state_slots_gib", "activations_gib"):
        assert term in event
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                     base_url="http://test", timeout=60) as client:
            residency = (await client.get("/v1/conductor/shadow/status")).json()["residency"]
    finally:
        await service.stop()
    shown = residency["served_memory"]
    assert shown["kv_pool_gib"] == round(kv / GIB, 3) and shown["session_cache_gib"] == round(cache / GIB, 3)
    assert shown["kv_pool_from"] == "auto" and residency["roles"]["served"]["pools"]["kv_pool"] == kv


def test_on_a_gpu_the_switches_set_win(cache_dir, tmp_path, monkeypatch):
    _device(monkeypatch, total_gib=4.0, free_gib=3.9)
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                            settings=_settings(cache_dir, tmp_path, QSE_SERVED_KV_GB="0.05",
                                               QSE_SERVED_CACHE_GB="0.04"))
    assert _sizes(service) == (int(0.05 * GIB), int(0.04 * GIB))
    shown = service.planner.status()["served_memory"]
    assert (shown["kv_pool_from"], shown["session_cache_from"]) == ("set", "set")
    one = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                        settings=_settings(cache_dir, tmp_path, QSE_SERVED_CACHE_GB="0.04"))
    kv, cache = _sizes(one)
    assert cache == int(0.04 * GIB) and kv > 2 * GIB  # the pool takes the rest
    assert one.planner.status()["served_memory"]["kv_pool_from"] == "auto"


def test_a_start_with_too_little_memory_is_refused_naming_the_numbers(cache_dir, tmp_path, monkeypatch):
    _device(monkeypatch, total_gib=1.5, free_gib=1.4)
    with pytest.raises(SizingError, match=r"^the served model's memory does not fit: QSE_GPU_MEMORY_UTILIZATION=0.9 "
                                          r"of 1.50 GiB is 1.35 GiB; less 0.10 GiB in use at start, .* the KV pool "
                                          r"0.\d\d GiB is under its 1.00 GiB floor.*QSE_SERVED_KV_GB"):
        build_service(profile="coding", grid=64, device="cpu", dtype="float32", settings=_settings(cache_dir, tmp_path))


@pytest.mark.parametrize("raw, message", [
    ("1.5", "QSE_GPU_MEMORY_UTILIZATION=1.5: expected the share of the device's memory qse may use, in (0, 1]"),
    ("0", "QSE_GPU_MEMORY_UTILIZATION=0.0: expected the share of the device's memory qse may use, in (0, 1]"),
    ("most", "QSE_GPU_MEMORY_UTILIZATION='most' is not a valid float"),
])
def test_a_bad_utilization_stops_qse_serve_before_it_binds(raw, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("QSE_GPU_MEMORY_UTILIZATION", raw)
    monkeypatch.setenv("QSE_PORT", "1")  # a port it could not bind: the error comes before it tries
    monkeypatch.setenv("QSE_LEDGER", str(tmp_path / "usage.jsonl"))
    assert serve_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qse serve: error: {message}") and err.count("\n") == 1


def test_a_negative_size_stops_qse_serve_before_it_binds(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("QSE_SERVED_CACHE_GB", "-1")
    monkeypatch.setenv("QSE_PORT", "1")
    monkeypatch.setenv("QSE_LEDGER", str(tmp_path / "usage.jsonl"))
    assert serve_main([]) == 2
    assert capsys.readouterr().err.startswith("qse serve: error: QSE_SERVED_CACHE_GB=-1.0: expected 0 (auto")


def test_qse_settings_lists_the_utilization_and_the_auto_sizes(capsys):
    assert main(["settings"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["settings"]}
    utilization = rows["QSE_GPU_MEMORY_UTILIZATION"]
    assert (utilization["type"], utilization["default"]) == ("float", "0.9")
    assert "share of the GPU's total memory" in utilization["doc"]
    for name in ("QSE_SERVED_KV_GB", "QSE_SERVED_CACHE_GB"):
        assert rows[name]["default"] == "0.0" and "0: auto" in rows[name]["doc"]
    assert EngineSettings({}).get("QSE_GPU_MEMORY_UTILIZATION") == 0.9


def test_the_sizes_decided_at_start_stand_in_for_the_switches():
    """build_service hands the sizes it chose on as settings (the served store reads QSE_SERVED_CACHE_GB itself)."""
    from qse.settings import SettingError

    base = EngineSettings({"QSE_SERVED_CACHE_GB": "0", "QSE_SHADOW_GB": "2"})
    decided = base.with_decided({"QSE_SERVED_CACHE_GB": 38.5})
    assert decided.get("QSE_SERVED_CACHE_GB") == 38.5 and decided.get("QSE_SHADOW_GB") == 2.0
    assert base.get("QSE_SERVED_CACHE_GB") == 0.0  # the switches as given are not changed
    with pytest.raises(SettingError, match="unknown setting 'QSE_SERVED_CACHE'"):
        base.with_decided({"QSE_SERVED_CACHE": 1.0})
