"""Where a benchmark's JSON goes: <out>/<name>-<date>-<device tag>.json, announced on stdout."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path


def device_tag(device_name: str) -> str:
    return "h200" if "H200" in device_name else ("cuda" if device_name.startswith("NVIDIA") else "cpu")


def write_result(result: dict, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dt.date.today().isoformat()}-{device_tag(str(result.get('device', '')))}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"written": str(path)}))
    return path
