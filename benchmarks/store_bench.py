"""Park and restore times of the shadow store for long sessions (bytes, seconds, GB/s).

    python benchmarks/store_bench.py                 # cuda: the qwen3.5-0.8b preset in bf16, 8k/40k/100k tokens
    python benchmarks/store_bench.py --quick         # cpu: the embedded tiny model, small sessions (a smoke run)

A session's state is not read through the model: its KV pages, recurrent and conv state and its
checkpoints are filled with random data of the model's shapes (the store's cost depends on bytes,
not values), and the JSON says so. Each rep parks the session (export, write, fsync, rename) and
brings it back (read, checksum, restore into the pool); the page cache is dropped for the file
between the two (POSIX_FADV_DONTNEED) unless --cache warm. Every restore is checked bit for bit.
Results go to benchmarks/results/store_bench-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qse.engine.engine import Engine  # noqa: E402
from qse.models import resolve  # noqa: E402
from qse.settings import SETTINGS  # noqa: E402
from qse.shadow.reader import ShadowReader  # noqa: E402
from qse.sessions.session import Checkpoint, GridSession as ShadowSession  # noqa: E402
from qse.store import ShadowStore, disk  # noqa: E402

NOTE = ("state filled with random data of the model's shapes (KV rows, GDN recurrent and conv state, "
        "checkpoints); no tokens were read through the model")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="cpu, embedded tiny model, 1k/4k tokens, 2 reps")
    p.add_argument("--model", default=None, help="preset or checkpoint dir (default qwen3.5-0.8b; --quick: embedded)")
    p.add_argument("--device", default=None, help="default cuda if present, else cpu (--quick: cpu)")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tokens", default=None, help="comma-separated session lengths (default 8192,40960,102400)")
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--checkpoints", type=int, default=6, help="checkpoints per session")
    p.add_argument("--reps", type=int, default=None, help="park/restore cycles per size (default 3; --quick: 2)")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold", help="page cache for the file at restore")
    p.add_argument("--disk-dir", type=Path, default=None, help="where files go (default <cache>/shadow-disk-bench)")
    p.add_argument("--no-read-check", action="store_true", help="skip reading a short session through the model")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="directory for the JSON")
    return p.parse_args(argv)


def fill_session(reader: ShadowReader, session_id: str, tokens: int, num_checkpoints: int, seed: int) -> ShadowSession:
    """A resident session holding `tokens` committed rows of random state, as if read."""
    device = reader.engine.device
    gen = torch.Generator(device=device).manual_seed(seed)

    def noise(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=gen, device=device).to(like.dtype)

    session = reader.open(session_id)
    cache = session.cache
    assert cache is not None
    ids_gen = torch.Generator().manual_seed(seed)
    session.ids = torch.randint(0, reader.engine.cfg.vocab_size, (tokens,), generator=ids_gen).tolist()
    if not session.kv.ensure(tokens):
        raise SystemExit(f"the pool ({reader.pool.num_pages} pages) cannot hold {tokens} rows")
    for buf in (reader.pool.k, reader.pool.v):
        for page in session.kv.pages:
            buf[page].copy_(noise(buf[page]))
    for t in (*cache.recurrent, *cache.conv):
        t.copy_(noise(t))
    cache.length = session.committed = tokens
    lines = [reader.grid * max(1, (tokens // reader.grid) * (i + 1) // num_checkpoints) for i in range(num_checkpoints)]
    session.checkpoints = [Checkpoint(position, [noise(t) for t in cache.recurrent], [noise(t) for t in cache.conv])
                           for position in sorted(set(lines))]
    session.checkpoint_lines |= set(lines)
    return session


def snapshot(reader: ShadowReader, session: ShadowSession):
    assert session.cache is not None
    return (reader.engine.cache_state(session.cache),
            [(c.position, [t.clone() for t in c.recurrent], [t.clone() for t in c.conv]) for c in session.checkpoints])


def same(reader: ShadowReader, session: ShadowSession, snap) -> bool:
    state, ckpts = snapshot(reader, session)
    if not state.equal(snap[0]) or [c[0] for c in ckpts] != [c[0] for c in snap[1]]:
        return False
    return all(torch.equal(x, y) for a, b in zip(ckpts, snap[1]) for x, y in zip(a[1] + a[2], b[1] + b[2]))


def reading_goes_on(engine: Engine, grid: int, disk_dir: Path) -> dict:
    """Read a short session through the model, park it, bring it back, read on: equal to a fresh prefill?"""
    store = ShadowStore(cap_nbytes=1 << 50, disk_dir=disk_dir)
    reader = ShadowReader(engine, grid=grid, pool_bytes=16 * grid * engine.state_bytes_per_token(), residency=store)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, engine.chat.tokenizer.vocab_size, (5 * grid + 17,), generator=gen).tolist()
    reader.feed("check", ids[: 3 * grid + 5], prompt_end=2 * grid + 1)
    reader.read_all("check")
    parked = store.park(reader, reader.get("check"))
    reader.feed("check", ids)
    reader.read_all("check")
    fresh = reader.fresh_prefill(ids)
    equal = reader.state_equal(reader.get("check"), fresh)
    return {"tokens": len(ids), "parked": parked, "restores": store.counts.restores, "equal_to_fresh_prefill": equal,
            "exact": parked and store.counts.restores == 1 and all(equal.values())}


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def versions() -> dict:
    import safetensors

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        rev = rev + ("+dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "safetensors": safetensors.__version__, "qse": rev, "file_format": disk.VERSION}


def device_info(device: torch.device) -> dict:
    out = {"type": device.type, "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        out["capability"] = "sm%d%d" % torch.cuda.get_device_capability(device)
    return out


def filesystem_of(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model = args.model if args.model is not None else ("" if args.quick else "qwen3.5-0.8b")
    tokens = [int(t) for t in (args.tokens or ("1024,4096" if args.quick else "8192,40960,102400")).split(",")]
    grid = 64 if args.quick and args.grid == 512 else args.grid
    tokens = [max(grid, t // grid * grid) for t in tokens]
    reps = args.reps or (2 if args.quick else 3)
    cache_dir = SETTINGS.cache_dir()
    disk_dir = args.disk_dir or cache_dir / "shadow-disk-bench"
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=_mkdir(disk_dir)))

    t0 = time.perf_counter()
    engine = Engine(resolve(model, device, dtype, cache_dir))
    build_s = time.perf_counter() - t0
    store = ShadowStore(cap_nbytes=1 << 50, disk_dir=run_dir, disk_cap_nbytes=1 << 50)
    pool_bytes = (max(tokens) + grid) * engine.state_bytes_per_token()
    reader = ShadowReader(engine, grid=grid, pool_bytes=pool_bytes, residency=store)

    results = []
    try:
        reading = None if args.no_read_check else reading_goes_on(engine, grid, run_dir)
        if reading is not None:
            print(f"read, park, restore, read on: exact={reading['exact']}", flush=True)
        for n in tokens:
            session = fill_session(reader, f"bench-{n}", n, args.checkpoints, seed=n)
            engine.synchronize()
            snap = snapshot(reader, session)
            state_nbytes = session.nbytes
            park_s, restore_s, parks, restores, exact = [], [], [], [], True
            for _ in range(reps):
                engine.synchronize()
                t = time.perf_counter()
                if not store.park(reader, session):
                    raise SystemExit(f"park failed: {store.stats()['misses']}")
                park_s.append(time.perf_counter() - t)
                parks.append(dict(store.counts.last_park_ms))
                path = store.parked[session.session_id].path
                file_nbytes = path.stat().st_size
                if args.cache == "cold":
                    drop_page_cache(path)
                t = time.perf_counter()
                if not store.bring_back(reader, session):
                    raise SystemExit(f"restore failed: {store.stats()['misses']}")
                engine.synchronize()
                restore_s.append(time.perf_counter() - t)
                restores.append(dict(store.counts.last_restore_ms))
                exact = exact and same(reader, session, snap)
            row = {
                "tokens": n,
                "state_bytes": state_nbytes,
                "file_bytes": file_nbytes,
                "park_s_median": statistics.median(park_s),
                "park_s_min": min(park_s),
                "restore_s_median": statistics.median(restore_s),
                "restore_s_min": min(restore_s),
                "park_GBps": file_nbytes / statistics.median(park_s) / 1e9,
                "restore_GBps": file_nbytes / statistics.median(restore_s) / 1e9,
                "park_parts_ms": _median_parts(parks),
                "restore_parts_ms": _median_parts(restores),
                "park_s": park_s,
                "restore_s": restore_s,
                "exact": exact,
            }
            results.append(row)
            print(f"{n:>7} tokens  {file_nbytes / 1e9:7.3f} GB  park {row['park_s_median']:.3f} s "
                  f"({row['park_GBps']:.2f} GB/s)  restore {row['restore_s_median']:.3f} s "
                  f"({row['restore_GBps']:.2f} GB/s)  exact={exact}", flush=True)
            reader.close(session.session_id)
            del snap
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    out = {
        "benchmark": "store_bench",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else "store_bench.main(" + repr(argv) + ")",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_info(device),
        "versions": versions(),
        "model": engine.name,
        "dtype": str(dtype).replace("torch.", ""),
        "grid": grid,
        "checkpoints_per_session": args.checkpoints,
        "reps": reps,
        "page_cache_at_restore": args.cache,
        "disk_dir": str(disk_dir),
        "filesystem": filesystem_of(disk_dir),
        "model_build_s": build_s,
        "state": NOTE,
        "reading_goes_on": reading,
        "GB": "1e9 bytes",
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = device.type if device.type == "cpu" else device_info(device)["name"].split()[-1].lower()
    path = args.out / f"store_bench-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    out["path"] = str(path)
    return out


def _median_parts(parts: list[dict]) -> dict:
    keys = parts[0].keys() if parts else ()
    return {k: statistics.median(p[k] for p in parts) for k in keys if k != "nbytes"}


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    result = main()
    reading_ok = result["reading_goes_on"] is None or result["reading_goes_on"]["exact"]
    sys.exit(0 if reading_ok and all(r["exact"] for r in result["results"]) else 1)
