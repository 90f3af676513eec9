"""The refactor gate: a tiny model's run, every logit and every byte of state, must not move by one bit.

`gate_run.run` takes a tiny model through a prefill, a decode, the reader's read on the grid, a question and
a summary on forks (and their put-back), a rollback, and a park and restore through the disk tier; this
test compares the sha256 of every tensor it produced with `refactor_gate.safetensors`, on the naive twins
and on the Triton kernels (run by Triton's interpreter on the CPU, so that any machine checks them).

The bytes are the same on every x86-64 host because the run never lets the CPU choose its arithmetic: it runs
in a process of its own under a pinned profile (`gate_run.PROFILES`: torch's CPU capability, MKL's and
OpenBLAS's code paths, numpy's SIMD level, one thread). Two profiles are recorded, the baseline every x86-64
CPU runs and AVX2, and both are checked: two capabilities, each held to its own record.

A change that is meant to move arithmetic (a kernel's reduction order, a fused op, a torch, numpy or Triton
upgrade) re-records the fixture and says why in its commit:

    QSE_GATE_RECORD=1 python -m pytest -q tests/gates/test_refactor_gate.py

(the fixture's metadata names the versions and the arithmetic path each profile was recorded with).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import gate_run

FIXTURE = Path(__file__).with_name("refactor_gate.safetensors")
RECORD = os.environ.get("QSE_GATE_RECORD", "") == "1"
KERNELS = ["naive", "triton"]
PERTURBED = [f"{k}:{op}" for k, ops in gate_run.PERTURBABLE.items() for op in ops]
# how torch names the capability each profile pins (torch.backends.cpu.get_cpu_capability())
CAPABILITY_NAMES = {"default": "DEFAULT", "avx2": "AVX2"}

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason=f"the gate's record is x86-64's; this machine is {platform.machine()}")


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _start_pinned(profile: str, out: Path, perturb: list[str]) -> subprocess.Popen:
    """gate_run's main in a fresh process under `profile`, writing its digests and arithmetic path to `out`."""
    import qse_kernels

    kernels = KERNELS if qse_kernels.triton_version() else ["naive"]
    cmd = [sys.executable, str(Path(gate_run.__file__)), "--profile", profile, "--out", str(out),
           "--kernels", *kernels, "--perturb", *perturb]
    return subprocess.Popen(cmd, env=gate_run.pinned_env(profile), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish_pinned(profile: str, proc: subprocess.Popen, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the gate's run under {profile!r} did not end in 600 s")
    if proc.returncode != 0:
        pytest.fail(f"the gate's run under {profile!r} failed ({proc.returncode}):\n{stderr[-4000:]}")
    with safe_open(out, "pt") as f:
        meta = dict(f.metadata() or {})
    return load_file(out), meta


@pytest.fixture(scope="module")
def pinned_runs(tmp_path_factory) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Each profile's run (the baseline with every perturbation too), once for the module, side by side; avx2
    only on a CPU that has it. Under QSE_GATE_RECORD=1 the fixture takes the unperturbed digests first."""
    root = tmp_path_factory.mktemp("gate")
    wanted = {"baseline": PERTURBED, **({"avx2": []} if _cpu_has_avx2() else {})}
    started = {name: _start_pinned(name, root / f"{name}.safetensors", perturb) for name, perturb in wanted.items()}
    runs = {name: _finish_pinned(name, proc, root / f"{name}.safetensors") for name, proc in started.items()}
    if RECORD:
        _record(runs)
    return runs


def _record(runs) -> None:
    kept = dict(load_file(FIXTURE)) if FIXTURE.exists() else {}
    meta = _metadata()
    for profile, (digests, path) in runs.items():
        for kernels in KERNELS:
            fresh = {n: t for n, t in digests.items() if n.startswith(kernels + ".")}
            if fresh:
                kept = {n: t for n, t in kept.items() if not n.startswith(f"{profile}.{kernels}.")}
                kept.update({f"{profile}.{n}": t for n, t in fresh.items()})
        meta.update({f"{profile}.{k}": v for k, v in path.items()})
    save_file(dict(sorted(kept.items())), FIXTURE, metadata=meta)


def _metadata() -> dict[str, str]:
    if not FIXTURE.exists():
        return {}
    with safe_open(FIXTURE, "pt") as f:
        return dict(f.metadata() or {})


def _section(digests: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {n[len(prefix) + 1:]: t for n, t in digests.items() if n.startswith(prefix + ".")}


def _recorded(profile: str, kernels: str) -> dict[str, torch.Tensor]:
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing: record it with QSE_GATE_RECORD=1 (see this module's docstring)")
    recorded = _section(load_file(FIXTURE), f"{profile}.{kernels}")
    if not recorded:
        pytest.fail(f"{FIXTURE} holds no {profile}.{kernels} record: record it with QSE_GATE_RECORD=1")
    return recorded


def _profile_run(pinned_runs, profile: str):
    if profile not in pinned_runs:
        pytest.skip(f"this CPU has no AVX2: the {profile!r} profile cannot run here")
    return pinned_runs[profile]


def _need_triton(kernels: str) -> None:
    import qse_kernels

    if kernels == "triton" and not qse_kernels.triton_version():
        pytest.skip("Triton is not installed: the gate's Triton bytes are its interpreter's")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("profile", sorted(gate_run.PROFILES))
def test_not_a_byte_moves(profile, kernels, pinned_runs):
    _need_triton(kernels)
    digests, path = _profile_run(pinned_runs, profile)
    now = _section(digests, kernels)
    moved = gate_run.moved(now, _recorded(profile, kernels))
    meta = _metadata()
    recorded_with = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith(profile + ".")}
    assert not moved, (f"the refactor gate ({profile}, {kernels}): {len(moved)} of {len(now)} results moved "
                       f"(recorded with {recorded_with}; this run {path}). A change meant to move arithmetic "
                       f"re-records with QSE_GATE_RECORD=1 and says why in its commit:\n  " + "\n  ".join(moved))


@pytest.mark.parametrize("profile", sorted(gate_run.PROFILES))
def test_the_gate_process_runs_the_pinned_path(profile, pinned_runs):
    """The pins took: torch reports the profile's capability, and one thread computes."""
    _, path = _profile_run(pinned_runs, profile)
    pins = gate_run.PROFILES[profile]
    assert path["aten_capability"] == CAPABILITY_NAMES[pins["ATEN_CPU_CAPABILITY"]]
    assert (path["mkl_cbwr"], path["openblas_coretype"]) == (pins["MKL_CBWR"], pins["OPENBLAS_CORETYPE"])
    assert path["threads"] == "1"


def test_the_two_capabilities_compute_differently(pinned_runs):
    """Each profile holds its own record: were the pins not taking effect, both would produce the same bytes and
    the second record would check nothing the first does not."""
    baseline, _ = pinned_runs["baseline"]
    avx2, _ = _profile_run(pinned_runs, "avx2")
    for kernels in KERNELS:
        a, b = _section(baseline, kernels), _section(avx2, kernels)
        if a:
            assert a.keys() == b.keys()
            assert gate_run.moved(a, b), f"{kernels}: the baseline and AVX2 profiles produced the same bytes"


def test_a_process_not_started_under_the_profile_is_refused(tmp_path):
    env = {k: v for k, v in gate_run.pinned_env("baseline").items() if k != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run([sys.executable, str(Path(gate_run.__file__)), "--profile", "baseline", "--out",
                           str(tmp_path / "x.safetensors")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "ATEN_CPU_CAPABILITY" in done.stderr and not (tmp_path / "x.safetensors").exists()


def test_the_run_covers_every_verb_and_puts_forks_back(cache_dir, one_thread):
    """What the gate records: each verb's results are there, and a fork leaves the state as it found it."""
    results = gate_run.run("naive")
    verbs = {name.split(".state.")[0] for name in results if ".state." in name}
    assert {"served.prefill", "served.decode", "reader.read", "reader.ask.put_back", "reader.summary.put_back",
            "reader.rollback", "reader.restore"} <= verbs
    assert results["served.prefill.logits"].shape == (gate_run.GRID + 21, gate_run.VOCAB)
    reads = {n.split(".state.")[1]: t for n, t in results.items() if n.startswith("reader.read.state.")}
    assert reads and any(n.startswith("kv.") for n in reads) and any(n.endswith(".recurrent") for n in reads)
    for fork in ("reader.ask.put_back", "reader.summary.put_back"):
        assert all(torch.equal(results[f"{fork}.state.{n}"], t) for n, t in reads.items())
    # the rollback went back to the prompt's checkpoint, and the restore brought back the rolled-back state
    assert results["reader.rollback.rows"].tolist() == [gate_run.GRID, 2 * gate_run.GRID + 7]
    after = {n.split(".state.")[1]: t for n, t in results.items() if n.startswith("reader.rollback.state.")}
    assert all(torch.equal(results[f"reader.restore.state.{n}"], t) for n, t in after.items())


@pytest.mark.parametrize("spec", PERTURBED)
def test_the_gate_fails_when_one_op_moves_by_one_part_in_1024(spec, pinned_runs):
    """The gate itself: one op's result scaled by 1 + 2**-10 moves recorded bytes, and the gate says which."""
    kernels, _, op = spec.partition(":")
    _need_triton(kernels)
    digests, _ = pinned_runs["baseline"]
    moved = gate_run.moved(_section(digests, spec), _recorded("baseline", kernels))
    assert moved and all(m.endswith("bytes moved") for m in moved)
    assert "reader.ask.distribution: bytes moved" in moved
    if op != "paged_attention":  # the reader's paged attention alone: the served prefill and the KV do not use it
        assert {"served.prefill.logits: bytes moved", "reader.read.state.kv.0.k: bytes moved"} <= set(moved)
