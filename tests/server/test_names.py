"""/tokenize and /detokenize (vLLM's shapes), --served-model-name aliases, the context length on /v1/models, and
`model` left out, on a real server started with two aliases."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def aliased(launcher, tmp_path_factory):
    srv = launcher.start(tmp_path_factory.mktemp("aliased"), ["--served-model-name", "coder", "coder-v2"])
    yield srv
    launcher.stop(srv)


@pytest.fixture
def client(aliased):
    with httpx.Client(base_url=aliased.url, headers=aliased.headers, timeout=60) as c:
        yield c


def test_aliases_and_context_length(aliased, client):
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["coder", "coder-v2"]
    assert all(c["max_model_len"] > 0 and c["root"] == cards[0]["root"] != "coder" for c in cards)
    for model in ("coder-v2", None):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if model:
            body["model"] = model
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "coder"
    r = client.post("/v1/chat/completions", json={"model": cards[0]["root"], "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenize_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and "".join(r["token_strs"]) == "hello world"
    assert r["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hello world"}]}).json()
    assert chat["count"] > r["count"]
    bad = client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400
