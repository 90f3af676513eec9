"""The served model's memory at start (qse/core/sizing.py): the KV pool and the session cache fill what the
device leaves them, 60/40; a switch set wins; too little memory and a bad utilization are refused by name; with
no device figures (a CPU) auto is the fixed 8 and 6 GiB."""

import math

import pytest

from qse.core.residency import GIB
from qse.core.sizing import (ACTIVATION_SAFETY, FIXED_KV_POOL_GB, FIXED_SESSION_CACHE_GB, KV_POOL_SHARE,
                             LIVE_ACTIVATIONS, MIN_KV_POOL_NBYTES, DeviceTerms, SizingError, activation_reserve,
                             check_utilization, size_served_memory)

MIB = 1 << 20
# an H200 with a 9B served model and a 0.8B reader of its own weights (1.6 GiB) and QSE_SHADOW_GB=4 (KV pool and
# session cache): 8 decode slots of 48 MiB of GDN state, the 9B's shape for the activations
WEIGHTS = int(17.9 * GIB)
READER = int(1.6 * GIB) + 4 * GIB + 4 * GIB
SLOTS = 8 * 48 * MIB
ACTIVATIONS = activation_reserve(token_budget=2048, grid=512, max_running=8, hidden=4096, intermediate=12288,
                                 vocab=248320, dtype_nbytes=2)


def h200(**changes) -> DeviceTerms:
    values = dict(total_nbytes=139 * GIB, free_nbytes=138 * GIB, utilization=0.9, weights_nbytes=WEIGHTS,
                  reader_nbytes=READER, state_slots_nbytes=SLOTS, activation_nbytes=ACTIVATIONS)
    return DeviceTerms(**{**values, **changes})


def test_the_activation_reserve_is_the_documented_formula():
    # a round's rows: the token budget, at least one grid chunk; the logits of a chunk's rows in fp32
    assert LIVE_ACTIVATIONS * ACTIVATION_SAFETY == 8
    assert ACTIVATIONS == 8 * 2048 * (4096 + 12288) * 2 + 512 * 248320 * 4
    assert activation_reserve(256, 512, 8, 64, 192, 1000, 4) == 8 * 512 * 256 * 4 + 512 * 1000 * 4
    assert activation_reserve(2048, 512, 1024, 64, 192, 1000, 4) == 8 * 2048 * 256 * 4 + 1024 * 1000 * 4


def test_an_h200_s_budget_is_filled_by_the_kv_pool_and_the_session_cache_60_40():
    sized = size_served_memory(h200())
    ceiling = int(139 * GIB * 0.9)
    budget = ceiling - 1 * GIB - WEIGHTS - READER - SLOTS - ACTIVATIONS
    assert sized.terms.ceiling_nbytes == ceiling and sized.terms.in_use_nbytes == 1 * GIB
    assert sized.terms.budget_nbytes == budget
    assert sized.kv_pool_nbytes == int(budget * KV_POOL_SHARE) and KV_POOL_SHARE == 0.6
    assert sized.kv_pool_nbytes + sized.session_cache_nbytes == budget  # every byte of the budget, none twice
    assert sized.left_nbytes == 0
    assert math.isclose(sized.session_cache_nbytes / budget, 0.4, abs_tol=1e-9)
    assert (sized.kv_pool_from, sized.session_cache_from) == ("auto", "auto")
    # the 9B's 100 GiB are in the pools now, not the 14 GiB of the fixed sizes
    assert 57 * GIB < sized.kv_pool_nbytes < 58 * GIB and 38 * GIB < sized.session_cache_nbytes < 39 * GIB
    report = sized.report()
    assert report["total_gib"] == 139.0 and report["free_at_start_gib"] == 138.0 and report["utilization"] == 0.9
    assert report["ceiling_gib"] == 125.1 and report["in_use_at_start_gib"] == 1.0
    assert report["weights_gib"] == 17.9 and report["reader_gib"] == 9.6 and report["state_slots_gib"] == 0.375
    assert report["activations_gib"] == round(ACTIVATIONS / GIB, 3) and report["budget_gib"] == round(budget / GIB, 3)
    assert report["kv_pool_gib"] == round(sized.kv_pool_nbytes / GIB, 3) and report["cap_gib"] is None


def test_memory_in_use_at_start_and_a_device_budget_come_off_the_ceiling():
    busy = size_served_memory(h200(free_nbytes=100 * GIB))  # another process holds 39 GiB
    assert busy.terms.budget_nbytes == size_served_memory(h200()).terms.budget_nbytes - 38 * GIB
    capped = size_served_memory(h200(cap_nbytes=80 * GIB))  # QSE_DEVICE_MEMORY_GB=80 under 0.9 x 139
    assert capped.terms.ceiling_nbytes == 80 * GIB
    assert capped.kv_pool_nbytes + capped.session_cache_nbytes == 80 * GIB - 1 * GIB - WEIGHTS - READER - SLOTS \
        - ACTIVATIONS
    assert capped.report()["cap_gib"] == 80.0


def test_a_size_a_switch_sets_wins_and_the_other_takes_the_rest():
    budget = h200().budget_nbytes
    both = size_served_memory(h200(), kv_gb=8.0, cache_gb=6.0)
    assert (both.kv_pool_nbytes, both.session_cache_nbytes) == (8 * GIB, 6 * GIB)
    assert (both.kv_pool_from, both.session_cache_from) == ("set", "set") and both.left_nbytes == budget - 14 * GIB
    kv_only = size_served_memory(h200(), kv_gb=20.0)
    assert (kv_only.kv_pool_nbytes, kv_only.session_cache_nbytes) == (20 * GIB, budget - 20 * GIB)
    assert (kv_only.kv_pool_from, kv_only.session_cache_from) == ("set", "auto")
    cache_only = size_served_memory(h200(), cache_gb=10.0)
    assert (cache_only.kv_pool_nbytes, cache_only.session_cache_nbytes) == (budget - 10 * GIB, 10 * GIB)
    # set sizes over the budget are kept as set (the start logs it): the operator asked for them
    over = size_served_memory(h200(), kv_gb=200.0, cache_gb=1.0)
    assert over.kv_pool_nbytes == 200 * GIB and over.left_nbytes < 0


def test_too_little_memory_is_refused_naming_the_numbers_and_the_switches():
    # a 24 GiB card: 0.9 x 24 = 21.6 GiB, less 0.5 in use, the 9B's 17.9, the reader's 9.6: nothing left
    with pytest.raises(SizingError) as caught:
        size_served_memory(h200(total_nbytes=24 * GIB, free_nbytes=int(23.5 * GIB)))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the served model's memory does not fit: QSE_GPU_MEMORY_UTILIZATION=0.9 of 24.00 GiB is "
                              "21.60 GiB; less 0.50 GiB in use at start, the served weights 17.90 GiB, the reader's "
                              "claim 9.60 GiB, the decode state slots 0.38 GiB, the activations 0.97 GiB leaves ")
    assert message.endswith("leaves -7.75 GiB: the KV pool -4.65 GiB is under its 1.00 GiB floor; the session "
                            "cache -3.10 GiB is under its 0.50 GiB floor. Raise "
                            "QSE_GPU_MEMORY_UTILIZATION, lower QSE_SHADOW_GB or QSE_MAX_RUNNING or "
                            "QSE_ROUND_TOKEN_BUDGET, or set QSE_SERVED_KV_GB and QSE_SERVED_CACHE_GB")
    for switch in ("QSE_GPU_MEMORY_UTILIZATION", "QSE_SHADOW_GB", "QSE_SERVED_KV_GB", "QSE_SERVED_CACHE_GB"):
        assert switch in message
    # both auto: a pool at its floor starts, one under it is refused (QSE_DEVICE_MEMORY_GB sets the ceiling exactly)
    taken = 1 * GIB + WEIGHTS + READER + SLOTS + ACTIVATIONS
    least = math.ceil(MIN_KV_POOL_NBYTES / KV_POOL_SHARE)
    assert size_served_memory(h200(cap_nbytes=taken + least)).kv_pool_nbytes == MIN_KV_POOL_NBYTES
    with pytest.raises(SizingError, match="is under its 1.00 GiB floor"):
        size_served_memory(h200(cap_nbytes=taken + least - 2))
    with pytest.raises(SizingError, match="leaves 1.50 GiB: the KV pool 0.90 GiB is under its 1.00 GiB floor"):
        size_served_memory(h200(cap_nbytes=taken + int(1.5 * GIB)))
    # one auto: it takes what the set one leaves, and is refused under its floor
    budget_gb = h200().budget_nbytes / GIB
    with pytest.raises(SizingError, match=r"session cache 4.00 GiB \(set\) leaves 0.99 GiB: the KV pool 0.99 GiB is "
                                          "under its 1.00 GiB floor"):
        size_served_memory(h200(cap_nbytes=taken + 4 * GIB + int(0.99 * GIB)), cache_gb=4.0)
    with pytest.raises(SizingError, match=r"the KV pool .* GiB \(set\) leaves 0.10 GiB: the session cache 0.10 GiB "
                                          "is under its 0.50 GiB floor"):
        size_served_memory(h200(), kv_gb=budget_gb - 0.1)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5, float("nan")])
def test_a_utilization_out_of_range_is_refused_naming_the_switch_and_the_value(utilization):
    with pytest.raises(SizingError, match=rf"QSE_GPU_MEMORY_UTILIZATION={utilization!r}: expected .* in \(0, 1\]"):
        check_utilization(utilization)
    with pytest.raises(SizingError, match="QSE_GPU_MEMORY_UTILIZATION"):
        size_served_memory(h200(utilization=utilization))


def test_a_whole_device_is_a_utilization_of_one():
    assert check_utilization(1.0) == 1.0
    assert size_served_memory(h200(utilization=1.0)).terms.ceiling_nbytes == 139 * GIB


def test_a_negative_size_is_refused_naming_its_switch():
    with pytest.raises(SizingError, match=r"QSE_SERVED_KV_GB=-1.0: expected 0 \(auto"):
        size_served_memory(h200(), kv_gb=-1.0)
    with pytest.raises(SizingError, match=r"QSE_SERVED_CACHE_GB=-2.0"):
        size_served_memory(None, cache_gb=-2.0)


def test_with_no_device_figures_auto_is_the_fixed_8_and_6_gib():
    sized = size_served_memory(None)
    assert (FIXED_KV_POOL_GB, FIXED_SESSION_CACHE_GB) == (8.0, 6.0)
    assert (sized.kv_pool_nbytes, sized.session_cache_nbytes) == (8 * GIB, 6 * GIB)
    assert (sized.kv_pool_from, sized.session_cache_from) == ("fixed", "fixed") and sized.terms is None
    assert sized.report() == {"kv_pool_gib": 8.0, "kv_pool_from": "fixed", "session_cache_gib": 6.0,
                              "session_cache_from": "fixed"}
    assert size_served_memory(None, kv_gb=0.05).kv_pool_nbytes == int(0.05 * GIB)
    assert size_served_memory(None, kv_gb=0.05).session_cache_from == "fixed"
