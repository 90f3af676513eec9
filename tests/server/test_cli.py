"""`qse serve`'s wiring: one Engine when the reader reads the served weights, no reader when the profile says
off, a serve.env that fills only what the environment leaves unset, and the flags that win over their switches
(--api-key, --allowed-origins)."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from qse.server.cli import apply_env_file, build_parser, build_service, serve_main, serve_settings, serve_url
from qse.server.profiles import Profile, ShadowBlock
from qse.server.service import Service
from qse.settings import EngineSettings, SettingError
from test_app import ScriptedConductor, serving


def test_the_reader_reuses_the_served_engine(cache_dir, tmp_path):
    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
                               "QSE_LEDGER": str(tmp_path / "usage.jsonl")})
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32", settings=settings)
    conductor = service.conductor
    assert conductor.reader.engine is conductor.served  # one copy of the weights
    assert conductor.reader.grid == 64 and conductor.options.router == "shadow"
    assert service.store is not None and service.store.disk_dir is None
    assert service.max_context_tokens == conductor.served.cfg.max_position_embeddings
    # QSE_TOKEN_CACHE_MB (256 by default): the served chat format keeps its prompts' encoded stretches
    assert service.chat.tokenizer.segments.max_chars == 256 * (1 << 20) // 2


def test_a_negative_token_cache_is_refused_by_name_before_the_model_loads(cache_dir, tmp_path):
    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir), "QSE_TOKEN_CACHE_MB": "-3"})
    with pytest.raises(SettingError, match=r"QSE_TOKEN_CACHE_MB=-3: expected a size in MiB >= 0"):
        build_service(profile="coding", grid=64, device="cpu", dtype="float32", settings=settings)


def test_the_idle_group_reaches_the_reader_and_the_conductor_and_a_bad_one_is_named(cache_dir, tmp_path):
    """QSE_SHADOW_IDLE_GROUP: the conductor's idle launches and the reader's captured group sizes (warm)."""
    base = {"QSE_CACHE_DIR": str(cache_dir), "QSE_SHADOW_DISK": "off", "QSE_SHADOW_GB": "0.02",
            "QSE_LEDGER": str(tmp_path / "usage.jsonl")}
    service = build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                            settings=EngineSettings({**base, "QSE_SHADOW_IDLE_GROUP": "4"}))
    assert service.conductor.runner.idle_group == 4 and service.conductor.reader.chunk_group == 4
    with pytest.raises(ValueError, match=r"QSE_SHADOW_IDLE_GROUP\) must be a whole number of chunks >= 1, got 0"):
        build_service(profile="coding", grid=64, device="cpu", dtype="float32",
                      settings=EngineSettings({**base, "QSE_SHADOW_IDLE_GROUP": "0"}))


def test_a_profile_with_the_shadow_off_builds_no_reader(cache_dir, tmp_path):
    path = tmp_path / "quiet.yaml"
    path.write_text("shadow:\n  mode: off\n")
    settings = EngineSettings({"QSE_CACHE_DIR": str(cache_dir)})
    service = build_service(profile=str(path), device="cpu", dtype="float32", settings=settings)
    assert service.conductor.reader is None and service.store is None and not service.shadow_on


def test_env_file_fills_only_unset_switches(tmp_path, monkeypatch):
    path = tmp_path / "serve.env"
    path.write_text("# comment\nQSE_PORT=9001\nQSE_HOST=0.0.0.0\n")
    monkeypatch.setenv("QSE_HOST", "127.0.0.2")
    monkeypatch.setenv("QSE_PORT", "1")  # so that monkeypatch restores QSE_PORT whatever apply_env_file sets
    monkeypatch.delenv("QSE_PORT")
    applied = apply_env_file(path)
    assert applied == {"QSE_PORT": "9001"}
    assert os.environ["QSE_PORT"] == "9001" and os.environ["QSE_HOST"] == "127.0.0.2"


async def test_a_fine_tune_serves_with_its_own_tokenizer_template_and_defaults(finetune_dir, finetune_token,
                                                                                tmp_path):
    """--model DIR of a fine-tune: its tokenizer.json (an added token stays one id), --chat-template over its
    template, and generation_config.json's sampling values below the profile's."""
    import httpx

    from qse.server.app import create_app

    profile = tmp_path / "tuned.yaml"
    profile.write_text("shadow:\n  mode: off\ngeneration:\n  temperature: 0.3\n")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "<|im_start|>assistant\n")
    settings = EngineSettings({"QSE_CACHE_DIR": str(tmp_path), "QSE_LEDGER": str(tmp_path / "usage.jsonl")})
    service = build_service(model=str(finetune_dir), profile=str(profile), device="cpu", dtype="float32",
                            settings=settings, chat_template=template)
    assert service.chat.template.source == str(template)
    g, sources = service.generation, service.generation_sources
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty, g.min_p) == (0.3, 0.8, 20, 1.05, 0.0)
    assert sources == {"temperature": "profile", "top_p": "generation_config.json", "top_k": "generation_config.json",
                       "repetition_penalty": "generation_config.json", "min_p": "default",
                       "presence_penalty": "default", "frequency_penalty": "default"}
    tok = service.chat.tokenizer
    added = tok.specials[finetune_token]
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                     base_url="http://test", timeout=60) as client:
            content = f"call {finetune_token} now"
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            prompt = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant"  # jinja drops a last newline
            assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt))
            r = await client.post("/tokenize", json={"prompt": content})
            assert r.json()["tokens"].count(added) == 1
            r = await client.post("/v1/chat/completions", json={  # a grammar over this vocabulary
                "messages": [{"role": "user", "content": content}], "max_tokens": 32, "seed": 1,
                "response_format": {"type": "json_object"}})
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
    finally:
        await service.stop()


def test_the_api_key_and_origins_flags_win_over_their_switches():
    env = {"QSE_API_KEY": "k-env", "QSE_ALLOWED_ORIGINS": "https://env.example"}
    flagged = serve_settings(build_parser().parse_args(["--api-key", "k-flag", "--allowed-origins",
                                                        "https://flag.example"]), env)
    assert flagged.get("QSE_API_KEY") == "k-flag" and flagged.get("QSE_ALLOWED_ORIGINS") == "https://flag.example"
    plain = serve_settings(build_parser().parse_args([]), env)
    assert plain.get("QSE_API_KEY") == "k-env" and plain.get("QSE_ALLOWED_ORIGINS") == "https://env.example"
    assert env == {"QSE_API_KEY": "k-env", "QSE_ALLOWED_ORIGINS": "https://env.example"}  # the flags overlay it


async def test_a_server_built_with_the_api_key_flag_needs_that_key(tiny_engine, tmp_path):
    args = build_parser().parse_args(["--api-key", "k-flag"])
    settings = serve_settings(args, {"QSE_API_KEY": "k-env", "QSE_CACHE_DIR": str(tmp_path),
                                     "QSE_LEDGER": str(tmp_path / "usage.jsonl")})
    service = Service(ScriptedConductor(tiny_engine.chat.tokenizer.encode("hi")), tiny_engine.chat, "scripted",
                      Profile(shadow=ShadowBlock(mode="off")), settings)
    async with serving(service) as client:
        for headers in ({}, {"Authorization": "Bearer k-env"}):
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.get("/v1/models", headers={"Authorization": "Bearer k-flag"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"


def test_an_empty_api_key_flag_or_one_beside_a_keys_file_is_refused(tmp_path, capsys):
    assert serve_main(["--api-key", ""]) == 2  # an unset variable in `--api-key "$KEY"` must not open the server
    assert capsys.readouterr().err == ("qse serve: error: --api-key is empty: give the key, or leave the flag out "
                                       "(QSE_API_KEY)\n")
    keys = tmp_path / "keys"
    keys.write_text("team k-team\n")
    with pytest.raises(SettingError, match="--api-key and QSE_API_KEYS_FILE are both set"):
        serve_settings(build_parser().parse_args(["--api-key", "k"]), {"QSE_API_KEYS_FILE": str(keys)})


def test_a_bad_allowed_origin_stops_qse_serve_before_it_binds(monkeypatch, capsys):
    monkeypatch.setattr("qse.server.logs.configure_logging", lambda level: None)  # this process's logging stays
    monkeypatch.setattr("qse.server.cli.bind_socket", lambda host, port: pytest.fail("bound a port"))
    for name in ("QSE_API_KEY", "QSE_API_KEYS_FILE", "QSE_ALLOWED_ORIGINS"):
        monkeypatch.delenv(name, raising=False)
    assert serve_main(["--allowed-origins", "https://app.example.com, app.example.com"]) == 2
    assert "'app.example.com' is not an origin; expected scheme://host[:port]" in capsys.readouterr().err


def test_qse_serve_takes_the_api_key_and_origins_flags(launcher, tmp_path):
    """The flags through the real `qse serve`: the key the flag gives guards the routes, and a browser's
    preflight is answered without one."""
    srv = launcher.start(tmp_path, ["--api-key", "k-flag", "--allowed-origins", "https://app.example.com"],
                         QSE_API_KEY="k-env")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.get("/v1/models", headers={"Authorization": "Bearer k-env"}).status_code == 401
            r = http.get("/v1/models", headers={"Authorization": "Bearer k-flag", "Origin": "https://app.example.com"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
            r = http.options("/v1/chat/completions", headers={
                "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    finally:
        assert launcher.stop(srv) in (0, -signal.SIGTERM)  # a drained stop raises the signal again


@pytest.mark.parametrize("host,port,root,url", [
    ("127.0.0.1", 8000, "", "http://127.0.0.1:8000"),
    ("0.0.0.0", 8001, "/qse/", "http://127.0.0.1:8001/qse"),
    ("::", 9000, "", "http://[::1]:9000"),
    ("fe80::1", 9000, "/p", "http://[fe80::1]:9000/p"),
], ids=["loopback", "any-address-root-path", "any-v6", "v6"])
def test_the_url_qse_serve_prints(host, port, root, url):
    assert serve_url(host, port, root) == url


def test_qse_serve_prints_the_url_it_listens_on(launcher, tmp_path):
    srv = launcher.start(tmp_path)
    try:
        port = srv.url.rsplit(":", 1)[1]
        line = next(line for line in srv.log_path.read_text().splitlines() if line.startswith("qse serve: listening"))
        assert f"http://127.0.0.1:{port}/qse (OpenAI base URL http://127.0.0.1:{port}/qse/v1)" in line
    finally:
        launcher.stop(srv)
