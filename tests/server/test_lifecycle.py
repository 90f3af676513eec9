"""A real `qse serve` across its life: the port is bound before the model loads (/health 503 "loading", then 200;
a port in use fails at once), /metrics can be public, and SIGTERM ends the turns in flight cleanly: a stream with
an OpenAI-shaped error event and [DONE], a waiting non-streaming request with a JSON 503."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_while_loading_then_ready_and_public_metrics(launcher, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "qse.server", "--port", str(port), "--grid", "64"],
                            cwd=launcher.repo, env=launcher.env(tmp_path, QSE_METRICS_PUBLIC="1"),
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    seen = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            while not seen or seen[-1] != (200, "ok"):
                assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.02)  # pacing the polls, not ordering anything
                try:
                    r = http.get("/health")
                except httpx.TransportError:  # not bound yet
                    continue
                if not seen or seen[-1] != (r.status_code, r.json()["status"]):
                    seen.append((r.status_code, r.json()["status"]))
                if r.status_code == 503:
                    r = http.post("/v1/chat/completions", json={"model": "m", "messages": []})
                    assert r.status_code in (503, 401)  # loading, or ready by now (the key is needed then)
            assert seen == [(503, "loading"), (200, "ok")]
            assert http.get("/healthz").status_code == 200
            assert http.get("/metrics").status_code == 200  # no key needed with QSE_METRICS_PUBLIC
            assert http.get("/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)


def test_a_port_in_use_fails_before_loading(launcher, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "qse.server", "--port", str(port)], cwd=launcher.repo,
                             env=launcher.env(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"qse serve: error: cannot listen on 127.0.0.1:{port}") and "in use" in last
    assert "server_ready" not in out.stdout + out.stderr  # nothing was loaded


def test_sigterm_ends_a_stream_and_a_waiting_request_cleanly(launcher, tmp_path):
    srv = launcher.start(tmp_path, ["--profile", "default"], QSE_MAX_OUTPUT_TOKENS="100000",
                         QSE_STOP_GRACE_S="0.2", QSE_MAX_RUNNING="1")
    body = {"model": srv.model, "max_tokens": 50_000, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    answer = {}

    def waiting_request() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as http:
            answer["response"] = http.post("/v1/chat/completions", json=body)

    frames = []
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: ") and "reasoning_content" in line:
                    break  # the stream's turn runs
            waiter = threading.Thread(target=waiting_request)
            waiter.start()
            while "waiting" not in answer:  # until the request waits behind the stream's turn
                time.sleep(0.02)
                if http.get("/v1/conductor/shadow/status").json()["queue"]["waiting"] or "response" in answer:
                    answer["waiting"] = True
            srv.proc.send_signal(signal.SIGTERM)
            frames = [line for line in lines if line.startswith("data: ")]
        waiter.join(120)
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "server_stopping" and set(error) == {"message", "type", "param", "code"}
    r = answer["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_stopping"
    events = srv.log_events()
    turns = [e for e in events if e.get("event") == "request" and e.get("path") == "/v1/chat/completions"]
    assert {e["status"] for e in turns} == {200, 503}
    assert any(e.get("event") == "server_drained" for e in events)
    assert "Application shutdown complete." in {e.get("event") for e in events}
