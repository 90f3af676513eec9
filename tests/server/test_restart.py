"""A planned stop parks every session on disk; the next start finds them and a question restores one exactly
where it was. `qse serve` with a bad profile stops at once with one line naming it."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx


def test_sessions_survive_a_restart(launcher, tmp_path):
    first = launcher.start(tmp_path, ["--profile", "default"])
    try:
        with httpx.Client(base_url=first.url, headers=first.headers, timeout=60) as http:
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": "keep"}, json={
                "model": first.model, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "Remember the number forty-two for later. " * 8}]})
            assert r.status_code == 200
            before = first.caught_up(http, ["keep"])["keep"]
    finally:
        # uvicorn shuts down gracefully, then raises the signal it caught again
        assert launcher.stop(first) in (0, -signal.SIGTERM)
    events = [e.get("event") for e in first.log_events()]
    assert "store_park_all" in events and "Application shutdown complete." in events

    second = launcher.start(tmp_path, ["--profile", "default"])
    try:
        with httpx.Client(base_url=second.url, headers=second.headers, timeout=60) as http:
            status = http.get("/v1/conductor/shadow/status").json()
            assert [p["session"] for p in status["parked"]] == ["keep"]
            assert status["parked"][0]["committed"] == before["position"]
            r = http.post("/v1/conductor/shadow/ask", json={"session": "keep", "question": "A or B?",
                                                            "choices": ["A", "B"]})
            assert r.status_code == 200 and r.json()["committed"] == before["position"]
            status = http.get("/v1/conductor/shadow/status").json()
            assert status["store"]["restores"] == 1 and status["parked"] == []
            assert 'qse_shadow_store{stat="restores"} 1.0' in http.get("/metrics").text
    finally:
        assert launcher.stop(second) in (0, -signal.SIGTERM)


def test_a_bad_profile_stops_the_server_with_one_line(launcher, tmp_path):
    out = subprocess.run([sys.executable, "-m", "qse.server", "--profile", "no-such-profile"], cwd=launcher.repo,
                         env=launcher.env(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("qse serve: error: profile 'no-such-profile' not found") and "known profiles" in last


def test_a_killed_server_still_knows_every_fed_session(launcher, tmp_path):
    """SIGKILL with sessions fed (no planned stop, nothing parked): the ids journal brings every session back,
    the reader's and the served model's, with the ids it was fed; its state is read again from them."""
    first = launcher.start(tmp_path, ["--profile", "default"], QSE_SERVED_GRID="64")
    text = "Remember the number forty-two for later, and the colour blue. " * 12
    try:
        with httpx.Client(base_url=first.url, headers=first.headers, timeout=120) as http:
            for sid in ("one", "two"):
                r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
                    "model": first.model, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": f"{sid}: {text}"}]})
                assert r.status_code == 200
                answer = r.json()["choices"][0]["message"]
            # the next turn of "one" resends the conversation: the served session reuses its state
            r = http.post("/v1/chat/completions", headers={"X-Session-Id": "one"}, json={
                "model": first.model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"one: {text}"},
                             {"role": "assistant", "content": answer.get("content") or "ok"},
                             {"role": "user", "content": "And now?"}]})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (
                r.json()["usage"], http.get("/v1/conductor/shadow/status").json()["served_cache"])
            status = http.get("/v1/conductor/shadow/status").json()
            known = {s["session"]: s["known"] for s in status["sessions"]}
            assert set(known) == {"one", "two"} and status["served_cache"]["sessions"] == 2
    finally:
        first.proc.kill()  # no drain, no park: the process is gone mid-flight
        first.proc.wait()

    second = launcher.start(tmp_path, ["--profile", "default"], QSE_SERVED_GRID="64")
    try:
        with httpx.Client(base_url=second.url, headers=second.headers, timeout=120) as http:
            status = http.get("/v1/conductor/shadow/status").json()
            assert {s["session"]: s["known"] for s in status["sessions"]} == known
            assert status["served_cache"]["sessions"] == 2
            r = http.post("/v1/conductor/shadow/ask", json={"session": "one", "question": "A or B?",
                                                            "choices": ["A", "B"]})
            assert r.status_code == 200 and r.json()["position"] > 0
    finally:
        assert launcher.stop(second) in (0, -signal.SIGTERM)
