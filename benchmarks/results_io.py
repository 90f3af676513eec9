"""Where a benchmark's JSON goes: <out>/<name>-<date>-<device tag>.json, announced on stdout; and the header
(command, date, device, versions) every result records."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path


def versions(*packages: str) -> dict:
    """Python's and torch's versions, and each named package's (or why it could not be imported)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in packages:
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing peer package is recorded, not fatal
            out[name] = f"missing: {type(exc).__name__}"
    return out


def result_header(*packages: str, device: str | None = None) -> dict:
    """What every result opens with: the command that ran, when, on which device (default: the CUDA device's
    name), and the versions (versions(*packages))."""
    import sys

    import torch

    return {"command": " ".join([sys.executable, *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name() if device is None else device, "versions": versions(*packages)}


def device_tag(device_name: str) -> str:
    for chip in ("H200", "H100"):
        if chip in device_name:
            return chip.lower()
    return "cuda" if device_name.startswith("NVIDIA") else "cpu"


def write_result(result: dict, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dt.date.today().isoformat()}-{device_tag(str(result.get('device', '')))}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"written": str(path)}))
    return path
