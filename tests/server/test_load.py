"""Load on loopback: 8 sessions at once, each streaming turns and asking the reader between them.

Bounded in count (8 sessions x 3 turns, an ask after each) and in time (90 s for everything). No request may
fail, no session may be lost or mixed up: at the end the reader holds every session with exactly its last
prompt and output.
"""

from __future__ import annotations

import asyncio
import json

import httpx

NUM_SESSIONS = 8
NUM_TURNS = 3


async def one_session(client: httpx.AsyncClient, model: str, i: int, asks: list[dict]) -> dict:
    session = f"load-{i}"
    messages = [{"role": "system", "content": f"You are agent number {i}. Keep answers short."}]
    usage = None
    for turn in range(NUM_TURNS):
        messages.append({"role": "user", "content": f"Agent {i}, step {turn}: describe task {i * 10 + turn}."})
        reasoning = ""
        async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": session}, json={
                "model": model, "messages": messages, "stream": True, "max_tokens": 6 + i % 3, "temperature": 0.7,
                "seed": i, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["x-session-id"] == session
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    reasoning += event["choices"][0]["delta"].get("reasoning_content") or ""
                if event.get("usage"):
                    usage = event["usage"]
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        r = await client.post("/v1/conductor/shadow/ask", json={
            "session": session, "question": f"Is agent {i} done? A) yes B) no C) unsure", "choices": ["A", "B", "C"]})
        assert r.status_code == 200, r.text
        asks.append(r.json())
    return {"session": session, "known": usage["total_tokens"]}


async def test_eight_sessions_stream_and_ask_at_once(server):
    asks: list[dict] = []
    limits = httpx.Limits(max_connections=2 * NUM_SESSIONS)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60, limits=limits) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(one_session(client, server.model, i, asks) for i in range(NUM_SESSIONS))), timeout=90)
        status = (await client.get("/v1/conductor/shadow/status")).json()
    assert len(asks) == NUM_SESSIONS * NUM_TURNS
    assert all(abs(sum(a["distribution"].values()) - 1.0) < 1e-5 for a in asks)
    by_id = {s["session"]: s for s in status["sessions"]}
    for result in results:
        state = by_id[result["session"]]  # no session lost
        assert state["known"] == result["known"]  # and none mixed with another
    records = [r for r in server.ledger() if r["session"].startswith("load-")]
    assert len(records) == NUM_SESSIONS * NUM_TURNS
