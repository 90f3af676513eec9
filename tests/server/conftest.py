"""Fixtures of the server tests: one real server process per test session, and in-process apps.

The real server runs `python -m qse.server` on a free loopback port with the embedded model, grid 64,
a small pool, an API key, a root path and small limits, so the bad-input tests can reach each limit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-qse"
GRID = 64


@dataclass
class RunningServer:
    url: str  # without the root path: the proxy in front strips it
    root_path: str
    proc: subprocess.Popen
    log_path: Path
    ledger_path: Path
    journal_dir: Path
    model: str
    api_key: str = API_KEY
    grid: int = GRID

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def ledger(self) -> list[dict]:
        if not self.ledger_path.exists():
            return []
        return [json.loads(line) for line in self.ledger_path.read_text().splitlines() if line.strip()]

    def caught_up(self, http: httpx.Client, sessions: list[str], timeout_s: float = 30.0) -> dict[str, dict]:
        """Poll the shadow status until the reader has no whole chunk left in `sessions`."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = http.get("/v1/conductor/shadow/status").json()
            by_id = {s["session"]: s for s in status["sessions"]}
            if all(sid in by_id and by_id[sid]["backlog"] == 0 for sid in sessions):
                return by_id
            if time.monotonic() > deadline:
                raise AssertionError(f"the reader did not catch up in {timeout_s} s: {status}")
            time.sleep(0.05)

    def log_events(self) -> list[dict]:
        events = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(cache_dir: Path, work: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        "QSE_CACHE_DIR": str(cache_dir),
        "QSE_DEVICE": "cpu",
        "QSE_DTYPE": "float32",
        "QSE_API_KEY": API_KEY,
        "QSE_MAX_BODY_BYTES": str(256 * 1024),
        "QSE_MAX_OUTPUT_TOKENS": "64",
        "QSE_MAX_QUESTION_TOKENS": "200",
        "QSE_SHADOW_GB": "0.25",
        "QSE_SHADOW_IDLE_POLL_S": "0.05",
        "QSE_SHADOW_DIR": str(work / "shadow"),
        "QSE_SHADOW_DISK": str(work / "disk"),
        "QSE_LEDGER": str(work / "usage.jsonl"),
        "QSE_ROOT_PATH": "/qse",
        "QSE_LOG_LEVEL": "info",
    })
    env.update(extra)
    return env


def start_server(cache_dir: Path, work: Path, args: list[str] = (), **extra: str) -> RunningServer:
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = work / f"server-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "qse.server", "--port", str(port), "--grid", str(GRID), *args],
                            cwd=REPO, env=server_env(cache_dir, work, **extra), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            r = httpx.get(url + "/healthz", timeout=1.0)
            if r.status_code == 200:
                model = r.json()["model"]
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not answer /healthz in 90 s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    wait_for_reader(url, proc, log_path, extra.get("QSE_API_KEY", API_KEY), deadline)
    return RunningServer(url, "/qse", proc, log_path, work / "usage.jsonl", work / "shadow", model)


def wait_for_reader(url: str, proc: subprocess.Popen, log_path: Path, key: str, deadline: float) -> None:
    """The server answers before its reader loads (the first idle window after the start): tests that ask the
    reader start once the planner has settled it (loaded, off, refused or failed)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while True:
        r = httpx.get(url + "/v1/conductor/shadow/status", headers=headers, timeout=5.0)
        roles = (r.json().get("residency") or {}).get("roles", {}) if r.status_code == 200 else {}
        if r.status_code != 200 or roles.get("reader", {}).get("state") not in ("planned", "loading"):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the reader did not load:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.05)


def stop_server(server: RunningServer, timeout_s: float = 30.0) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


class Launcher:
    """Start and stop server processes over the session's cache dir (the embedded model is written once)."""

    repo = REPO

    def __init__(self, cache_dir: Path):
        self.cache_dir = cache_dir

    def env(self, work: Path, **extra: str) -> dict[str, str]:
        return server_env(self.cache_dir, work, **extra)

    def start(self, work: Path, args: list[str] = (), **extra: str) -> RunningServer:
        return start_server(self.cache_dir, work, args, **extra)

    def stop(self, server: RunningServer) -> int:
        return stop_server(server)


@pytest.fixture(scope="session")
def launcher(cache_dir) -> Launcher:
    return Launcher(cache_dir)


@pytest.fixture(scope="session")
def server(cache_dir, tmp_path_factory):
    srv = start_server(cache_dir, tmp_path_factory.mktemp("server"), ["--profile", "coding"])
    yield srv
    stop_server(srv)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


@pytest.fixture
def oai(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    client.close()
