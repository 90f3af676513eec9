"""A planned stop parks every session on disk; the next start finds them and a question restores one exactly
where it was. `qse serve` with a bad profile stops at once with one line naming it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow  # real servers started and stopped


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


CRASH_ENV = {"QSE_SERVED_GRID": "64", "QSE_HOST_CACHE_GB": "0",  # evictions go straight to disk
             # the reader's device cap holds two sessions of three or four grid chunks (0.66 MB at three), not three
             "QSE_SHADOW_GB": "0.0017"}
CRASH_TEXT = "Remember the number forty-two for later, and the colour blue. " * 14  # ~195 ids: 3 chunks of 64


def test_a_server_killed_mid_turn_comes_back_as_a_fresh_prefill(launcher, tmp_path):
    """SIGKILL mid-stream with a session resident, one parked on disk and one restored from disk then fed.
    After the restart every session is known with the ids it was fed (the one in flight: its prompt), and a
    question about each gets exactly the probabilities of a fresh server fed the same ids."""
    from concurrent.futures import ThreadPoolExecutor

    def chat(server, turns, **extra):
        messages = []
        for i, (user, answer) in enumerate(turns):
            messages.append({"role": "user", "content": user})
            if i < len(turns) - 1:
                messages.append({"role": "assistant", "content": answer})
        return {"model": server.model, "max_tokens": 2, "temperature": 0, "messages": messages, **extra}

    def feed(server, http, sid, turns, **extra):
        r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=chat(server, turns, **extra))
        assert r.status_code == 200, r.text
        server.caught_up(http, [sid])
        return r.json()["choices"][0]["message"].get("content") or "ok"

    def status(http):
        s = http.get("/v1/conductor/shadow/status").json()
        return s, {x["session"]: x for x in s["sessions"]}, {p["session"] for p in s["parked"]}

    def ask(http, sid, at):
        r = http.post("/v1/conductor/shadow/ask", json={"session": sid, "question": "Which number? A: 42, B: 7, C: 0",
                                                        "choices": ["A", "B", "C"], "at": at})
        assert r.status_code == 200, r.text
        return r.json()

    # the server that is killed, and a fresh one (its own dirs) fed the same requests beside it
    with ThreadPoolExecutor(2) as pool:
        first, fresh = pool.map(lambda w: launcher.start(w, ["--profile", "default"], **CRASH_ENV),
                                [tmp_path / "killed", tmp_path / "fresh"])
    second = None
    clients = [httpx.Client(base_url=s.url, headers=s.headers, timeout=120) for s in (first, fresh)]
    try:
        turn1 = {sid: [(f"{sid}: {CRASH_TEXT}", None)] for sid in ("restored", "parked", "resident")}
        answers = {}
        for sid in ("restored", "parked", "resident"):  # least recently fed first: "restored" goes to disk
            answers[sid] = [feed(s, h, sid, turn1[sid]) for s, h in zip((first, fresh), clients)]
            assert answers[sid][0] == answers[sid][1]
        _, sessions, parked = status(clients[0])
        assert parked == {"restored"} and sessions["parked"]["resident"] and sessions["resident"]["resident"]
        # the second turn crosses the next grid line, so the reader reads it: restored from disk, then extended
        turn2 = [(f"restored: {CRASH_TEXT}", answers["restored"][0]), ("And now, which colour was it? " * 10, None)]
        for s, h in zip((first, fresh), clients):  # and "parked", now the least recently fed, goes to disk
            feed(s, h, "restored", turn2)
        st, sessions, parked = status(clients[0])
        assert parked == {"parked"} and st["store"]["restores"] == 1, st["store"]
        assert sessions["restored"]["resident"] and sessions["resident"]["resident"]
        assert not sessions["parked"]["resident"]
        known = {sid: v["known"] for sid, v in sessions.items()}
        assert known["restored"] > known["parked"]

        # a second turn of "resident", streamed; the process is killed once its first token has arrived
        in_flight = chat(first, [(f"resident: {CRASH_TEXT}", answers["resident"][0]),
                                                         ("And the number?", None)], max_tokens=64, stream=True)
        done = False
        with clients[0].stream("POST", "/v1/chat/completions", headers={"X-Session-Id": "resident"},
                               json=in_flight) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: ") and any(c["delta"].get("content") or c["delta"].get("reasoning_content")
                                                     for c in json.loads(line[6:])["choices"]):
                    first.proc.kill()
                    break
        first.proc.wait()
        assert not done, "the turn ended before the kill"
    except BaseException:
        first.proc.kill()
        launcher.stop(fresh)
        for c in clients:
            c.close()
        raise

    try:
        second = launcher.start(tmp_path / "killed", ["--profile", "default"], **CRASH_ENV)
        with httpx.Client(base_url=second.url, headers=second.headers, timeout=120) as http:
            _, after, parked = status(http)
            assert set(after) == {"restored", "parked", "resident"}
            assert parked == {"parked"}  # its file was good; "restored" comes back from its ids alone
            # the fresh server is fed the turn in flight's prompt (and one output id: the questions stop at the prompt)
            r = clients[1].post("/v1/chat/completions", headers={"X-Session-Id": "resident"},
                                json={**in_flight, "stream": False, "max_tokens": 1})
            assert r.status_code == 200
            prompt = r.json()["usage"]["prompt_tokens"]
            # the journal holds what each feed gave: the session in flight has its new prompt, not yet its output
            assert {sid: v["known"] for sid, v in after.items()} == {**known, "resident": prompt}
            answers = {}
            for sid in ("restored", "parked", "resident"):
                at = after[sid]["known"]
                got, want = ask(http, sid, at), ask(clients[1], sid, at)
                assert got["position"] == want["position"]
                assert got["distribution"] == want["distribution"], (sid, got, want)  # exact, not approx
                answers[sid] = got["distribution"]
            assert len({tuple(d.values()) for d in answers.values()}) == 3  # three different states were compared
            st, _, _ = status(http)
            # "parked" came back from its file written before the kill (no file was a miss)
            restores = [e for e in second.log_events() if e.get("event") == "store_restore"]
            assert restores[0]["session"] == "parked" and restores[0]["tier"] == "disk"
            assert st["store"]["misses"] == {}
    finally:
        for c in clients:
            c.close()
        if second is not None:
            assert launcher.stop(second) in (0, -signal.SIGTERM)
        assert launcher.stop(fresh) in (0, -signal.SIGTERM)
