"""`qse serve`: bind the port, then load the served model (and the reader's) and build the conductor while the
app answers /health 503 "loading"; serve under uvicorn; on SIGTERM drain, then stop.

    qse serve                          the embedded default model on 127.0.0.1:8000, profile 'default'
    qse serve --model DIR --profile coding --port 8001 --env-file config/serve.env

Flags win over QSE_* switches; --env-file fills switches the environment does not set.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections import ChainMap
from pathlib import Path
from typing import Mapping

import structlog
import uvicorn

from ..core.sizing import ServedMemory, check_size, check_utilization
from ..settings import SETTINGS, EngineSettings, SettingError, load_env_file
from .profiles import ProfileError, load_profile
from .service import Service
from .tenants import Keyring


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qse serve", description="Serve the model over an OpenAI-compatible API, "
                                "with the shadow reader beside it. Unset flags fall back to the QSE_* switches.")
    p.add_argument("--host", help="address to bind (QSE_HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (QSE_PORT, 8000)")
    p.add_argument("--model", help="checkpoint dir or preset; empty: the embedded default (QSE_MODEL)")
    p.add_argument("--shadow-model", help="the reader's model: a dir, a preset or embedded; empty: no reader "
                   "(QSE_SHADOW_MODEL)")
    p.add_argument("--profile", help="profile name in config/profiles, or a path to a .yaml (QSE_PROFILE)")
    p.add_argument("--grid", type=int, help="reader grid rows (QSE_SHADOW_GRID)")
    p.add_argument("--root-path", help="prefix the app is served under behind a proxy (QSE_ROOT_PATH)")
    p.add_argument("--api-key", help="the one key every route but /health and /healthz needs (QSE_API_KEY); other "
                   "users of the machine can read a flag in the process list: prefer the switch or --env-file")
    p.add_argument("--allowed-origins", help="origins a browser may call the API from, comma list of "
                   "scheme://host[:port], * for any (QSE_ALLOWED_ORIGINS; default: none, no CORS headers)")
    p.add_argument("--device", help="torch device (QSE_DEVICE)")
    p.add_argument("--dtype", help="compute dtype (QSE_DTYPE)")
    p.add_argument("--log-level", help="log level (QSE_LOG_LEVEL)")
    p.add_argument("--served-model-name", nargs="+", help="the names clients use for the model; the first is the "
                   "one answers carry (default: the model's own name)")
    p.add_argument("--chat-template", type=Path, help="a jinja chat template file that replaces the checkpoint's "
                   "(default: its chat_template.jinja, else tokenizer_config.json's chat_template, else the "
                   "family's built-in template)")
    p.add_argument("--env-file", type=Path, help="a serve.env file (KEY=VALUE) of QSE_* switches, checked first")
    return p


# flags that set a switch as such: they reach every reader of the settings (the app reads these two)
SWITCH_FLAGS = {"api_key": "QSE_API_KEY", "allowed_origins": "QSE_ALLOWED_ORIGINS"}


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EngineSettings:
    """The switches qse serve runs with: `env` (the process environment by default) under the flags of
    SWITCH_FLAGS that were given, so that a flag wins over its switch."""
    given = {SWITCH_FLAGS[name]: value for name, value in vars(args).items()
             if name in SWITCH_FLAGS and value is not None}
    if given.get("QSE_API_KEY") == "":
        raise SettingError("--api-key is empty: give the key, or leave the flag out (QSE_API_KEY)")
    settings = EngineSettings(ChainMap(given, os.environ if env is None else env))
    if "QSE_API_KEY" in given and settings.get("QSE_API_KEYS_FILE") is not None:
        raise SettingError("--api-key and QSE_API_KEYS_FILE are both set: set one (the keys file holds every "
                           "tenant's key)")
    return settings


def apply_env_file(path: Path) -> dict[str, str]:
    """Set the file's switches that the environment does not set already; returns what was set."""
    applied = {}
    for key, value in load_env_file(path).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


log = structlog.get_logger("qse.serve")


def check_memory_switches(settings: EngineSettings) -> None:
    """QSE_GPU_MEMORY_UTILIZATION in (0, 1], QSE_SERVED_KV_GB and QSE_SERVED_CACHE_GB 0 (auto) or a size: a bad
    one stops qse serve before it binds or loads, naming the switch and its value."""
    check_utilization(settings.get("QSE_GPU_MEMORY_UTILIZATION"))
    for name in ("QSE_SERVED_KV_GB", "QSE_SERVED_CACHE_GB"):
        check_size(name, settings.get(name))


def build_service(model: str = "", shadow_model: str | None = None, profile: str = "default", grid: int | None = None,
                  device: str = "auto", dtype: str = "auto", settings: EngineSettings = SETTINGS,
                  served_names: list[str] | None = None, chat_template: Path | None = None,
                  reader_load: str = "start") -> Service:
    """Models, store and conductor, as the profile asks, and the residency planner that loads the reader.
    shadow_model None: QSE_SHADOW_MODEL; empty: no reader (its model, store and disk tier are not loaded). The
    reader reuses the served Engine when it would load the same weights. chat_template: a template file over
    the checkpoint's (--chat-template). reader_load: "start" loads the reader before this returns; "idle"
    leaves it to the planner, in the first idle window after the service starts (qse serve's default).
    The served model's KV pool and session cache are sized here, once, before its sessions are built
    (served_memory)."""
    import dataclasses

    from ..engine.engine import Engine
    from ..models import pick_device, pick_dtype, resolve, same_spec
    from ..models.segments import chars_for_mib
    from ..policy import Policy
    from ..runtime.conductor import Conductor, ShadowOptions, served_sessions
    from ..runtime.planner import DeviceMemory, ResidencyPlanner
    from ..store import GIB, ShadowStore

    if reader_load not in ("start", "idle"):
        raise SettingError(f"QSE_SHADOW_LOAD={reader_load!r}: expected idle or start")
    check_memory_switches(settings)
    prof = load_profile(profile)
    policy = Policy.from_settings(settings)  # the one read of the switches below this point
    shadow_model = settings.get("QSE_SHADOW_MODEL") if shadow_model is None else shadow_model
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    cache = settings.cache_dir()
    memory = DeviceMemory(dev, int(settings.get("QSE_DEVICE_MEMORY_GB") * GIB))
    at_start = memory.total_and_free()  # before the served weights load: what is in use without them (None: a CPU)
    token_cache_mib = settings.get("QSE_TOKEN_CACHE_MB")
    if token_cache_mib < 0:
        raise SettingError(f"QSE_TOKEN_CACHE_MB={token_cache_mib}: expected a size in MiB >= 0 (0: encode every "
                           "prompt whole)")
    served = Engine(resolve(model, dev, dt, cache, chat_template=chat_template), kernels=policy.kernels,
                    pdl=policy.pdl)
    # a resent conversation's earlier messages are looked up, not encoded again (qse/models/segments.py)
    tokenizer = served.chat.tokenizer
    if not tokenizer.keep_stretches(chars_for_mib(token_cache_mib)):
        log.info("token_cache_off", why=getattr(tokenizer, "segments_off_because", "") or "the specials overlap")
    else:
        log.info("token_cache" if token_cache_mib else "token_cache_off", mib=token_cache_mib)
    wants_reader = prof.shadow.mode == "on" and shadow_model != ""
    s = prof.shadow
    options = ShadowOptions(mode=s.mode if wants_reader else "off", narrator=s.narrator, router=s.router,
                            router_min_tokens=s.router_min_tokens, narrator_max_tokens=s.narrator_max_tokens)
    loader = None
    if wants_reader:
        from ..core.plan import check_group

        # the chunk groups the idle window may launch are captured by the reader's warm(), with the single
        # chunk's graph (none beyond it at the default of one chunk a launch)
        check_group(policy.idle_group, "the idle window's chunk group (QSE_SHADOW_IDLE_GROUP)")
        shared = same_spec(shadow_model, model)
        loader = reader_loader(settings, policy, shadow_model, served if shared else None, dev, dt, grid,
                               "served:" + served.name if shared else "reader:" + (shadow_model or "embedded"))
    # the served pools, sized once: every reader below sees the sizes chosen (the policy, the store, the claim)
    sized = served_memory(settings, policy, served, loader, at_start, memory.budget_nbytes)
    log.info("served_memory_sized", **sized.report())
    if sized.left_nbytes is not None and sized.left_nbytes < 0:
        log.warning("served_memory_over_budget", over_gib=round(-sized.left_nbytes / GIB, 3),
                    hint="QSE_SERVED_KV_GB and QSE_SERVED_CACHE_GB as set claim more than QSE_GPU_MEMORY_UTILIZATION "
                         "leaves them; the reader's claim may be refused")
    policy = dataclasses.replace(policy, served_kv_gb=sized.kv_pool_gb)
    settings = settings.with_decided({"QSE_SERVED_KV_GB": sized.kv_pool_gb,
                                      "QSE_SERVED_CACHE_GB": sized.session_cache_gb})
    # the served sessions' own store: device cap, host tier, disk tier (the reader's is separate)
    served_store = ShadowStore.for_served(settings)
    serving = served_sessions(served, policy, residency=served_store)
    served_store.attach(serving.book)
    conductor = Conductor(served, None, options, policy, serving=serving)
    # capture the served decode step's graphs before the first request, not in it
    conductor.serving.warm()
    planner = ResidencyPlanner(conductor, memory, served_claim(served, policy, settings), loader,
                               narrator=s.narrator == "on", served_memory=sized.report())
    if loader is not None and reader_load == "start":
        planner.load_reader_now()  # nothing runs yet: no lock to take
    service = Service(conductor, served.chat, served.name, prof, settings, served_store=served_store,
                      max_context_tokens=served.cfg.max_position_embeddings, served_names=served_names or (),
                      planner=planner)
    service.reader_load = reader_load
    return service


def served_memory(settings: EngineSettings, policy, served, loader, at_start: tuple[int, int] | None,
                  cap_nbytes: int = 0) -> ServedMemory:
    """The served model's KV pool and session cache (qse/core/sizing.py's contract): QSE_SERVED_KV_GB and
    QSE_SERVED_CACHE_GB where > 0, else sized from the device's (total, free) at start (`at_start`, measured
    before the served weights loaded; None on a CPU: the fixed sizes), less the served weights, the reader's claim
    (its weights unless it reads the served ones, its pools), the decode slots' state and the activations of a
    round of QSE_ROUND_TOKEN_BUDGET prompt ids. cap_nbytes: QSE_DEVICE_MEMORY_GB (0: none)."""
    import torch

    from ..core.sizing import DeviceTerms, activation_reserve, size_served_memory
    from ..engine.rounds import slot_states_for

    terms = None
    if at_start is not None:
        total, free = at_start
        reader = 0
        if loader is not None:
            shares = loader.claim.model == "served:" + served.name  # the reader reads the served weights
            reader = loader.claim.pools_nbytes + (0 if shares else loader.claim.weights_nbytes or 0)
            if not shares and loader.claim.weights_nbytes is None:
                log.warning("reader_weights_unknown", hint="the reader's weights are not known before it loads: the "
                            "served pools are sized without them (set QSE_SERVED_KV_GB and QSE_SERVED_CACHE_GB to "
                            "leave them room)")
        cfg = served.cfg
        activations = activation_reserve(policy.round_token_budget, policy.served_grid,
                                         policy.max_running * max(1, policy.verify_width),  # a round's decode rows
                                         cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                                         torch.empty((), dtype=served.dtype).element_size())
        terms = DeviceTerms(total, free, settings.get("QSE_GPU_MEMORY_UTILIZATION"), served.model.weights_nbytes(),
                            reader, slot_states_for(policy.max_running, policy.verify_width) * served.cost(0),
                            activations, cap_nbytes)
    return size_served_memory(terms, settings.get("QSE_SERVED_KV_GB"), settings.get("QSE_SERVED_CACHE_GB"))


def served_claim(served, policy, settings: EngineSettings):
    """The served model's claim: its weights as loaded, its KV pool, its decode slots' state, its sessions'
    device cap (an upper bound: the cap also counts KV that lives in the pool)."""
    from ..core.residency import Claim
    from ..engine.rounds import slot_states_for
    from ..store import GIB

    pools = (("kv_pool", int(policy.served_kv_gb * GIB)),
             ("state_slots", slot_states_for(policy.max_running, policy.verify_width) * served.cost(0)),
             ("session_cache", int(settings.get("QSE_SERVED_CACHE_GB") * GIB)))
    return Claim("served", "served:" + served.name, served.model.weights_nbytes(), pools)


def reader_loader(settings: EngineSettings, policy, shadow_model: str, shared_engine, dev, dt, grid: int | None, model_key: str):
    """The reader's RoleLoader: its claim (weights from the checkpoint's headers before the load, none of its
    own when it reads the served Engine; its KV pool and its sessions' cap, QSE_SHADOW_GB each) and how to build
    it (its Engine unless shared, its store, its ShadowReader)."""
    from ..core.residency import Claim
    from ..engine.engine import Engine
    from ..models import resolve
    from ..runtime.planner import RoleLoader
    from ..shadow.reader import ShadowReader
    from ..store import GIB, ShadowStore

    pool_nbytes = int(policy.reader_gb * GIB)
    weights = 0 if shared_engine is not None else _weights_estimate(shadow_model, dt, settings.cache_dir())
    claim = Claim("reader", model_key, weights if shared_engine is None else shared_engine.model.weights_nbytes(),
                  (("kv_pool", pool_nbytes), ("session_cache", pool_nbytes)))

    def build():
        engine = shared_engine or Engine(resolve(shadow_model, dev, dt, settings.cache_dir()), kernels=policy.kernels,
                                         pdl=policy.pdl)
        store = ShadowStore.from_settings(settings)
        reader = ShadowReader(engine, grid=grid or policy.grid, pool_bytes=pool_nbytes, residency=store,
                              chunk_group=policy.idle_group, graphs=None if policy.reader_graphs else False,
                              **policy.reader_checkpoints())
        store.attach(reader)
        return reader

    def weights_nbytes(reader) -> int:
        return reader.engine.model.weights_nbytes()

    return RoleLoader(claim, build, lambda reader: reader.warm(), weights_nbytes)


def _weights_estimate(spec: str, dtype, cache_dir: Path) -> int | None:
    """A model's weights before loading them: a checkpoint's from its headers, a preset's from its shapes (None
    where the family cannot say: measured once loaded)."""
    import torch

    from ..models import checkpoint_dir, preset_weights_nbytes
    from ..runtime.planner import checkpoint_weights_nbytes

    size = torch.empty((), dtype=dtype).element_size()
    model_dir = checkpoint_dir(spec, cache_dir)
    if model_dir is not None:
        return checkpoint_weights_nbytes(model_dir, size)
    return preset_weights_nbytes(spec, dtype)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads: a port in use fails at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve_url(host: str, port: int, root_path: str = "") -> str:
    """The URL a client on this machine reaches the server at (an any-address bind: through loopback)."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}{root_path.rstrip('/')}"


class ServeError(Exception):
    """qse serve cannot start: one line for the user."""


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.env_file is not None:
            apply_env_file(args.env_file)
        settings = serve_settings(args)
        level = args.log_level or settings.get("QSE_LOG_LEVEL")
        from .logs import configure_logging, uvicorn_log_config

        configure_logging(level)
        profile = args.profile or settings.get("QSE_PROFILE")
        load_profile(profile)  # a bad profile or keys file stops qse serve before it binds or loads
        Keyring.from_settings(settings)
        from .app import check_settings

        check_settings(settings)  # the app's switches too: a bad one stops qse serve before the model loads
        check_memory_switches(settings)
        grace_s = settings.get("QSE_STOP_GRACE_S")
        host = args.host or settings.get("QSE_HOST")
        port = settings.get("QSE_PORT") if args.port is None else args.port
        sock = bind_socket(host, port)
    except (ProfileError, SettingError, ServeError, ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"qse serve: error: {exc}\n")
        return 2
    url = serve_url(host, sock.getsockname()[1], args.root_path if args.root_path is not None
                    else settings.get("QSE_ROOT_PATH"))
    # one plain line a person reads first (the JSON log events follow); port 0 names the port it got
    sys.stderr.write(f"qse serve: listening on {url} (OpenAI base URL {url}/v1); the model loads now, "
                     f"{url}/health answers 200 once it is ready\n")
    sys.stderr.flush()

    from .app import LoadingApp

    def load() -> Service:
        return build_service(
            model=settings.get("QSE_MODEL") if args.model is None else args.model,
            shadow_model=args.shadow_model, profile=profile, grid=args.grid, device=args.device or settings.get("QSE_DEVICE"),
            dtype=args.dtype or settings.get("QSE_DTYPE"), settings=settings, served_names=args.served_model_name,
            chat_template=args.chat_template, reader_load=settings.get("QSE_SHADOW_LOAD"))

    app = LoadingApp(load, root_path=args.root_path)
    config = uvicorn.Config(
        app, host=host, port=port, proxy_headers=True, forwarded_allow_ips=settings.get("QSE_FORWARDED_ALLOW_IPS"),
        log_config=uvicorn_log_config(level), access_log=False, lifespan="on", server_header=False,
        # a last resort: the drain ends every turn after grace_s, and each ends within one decode step
        timeout_graceful_shutdown=grace_s + 30,
    )
    server = DrainingServer(config, app, grace_s)
    app.on_failure = lambda exc: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if app.error is not None:
        sys.stderr.write(f"qse serve: error: {app.error}\n")
        return 2
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM (or Ctrl-C) drains first (Service.drain: /health says
    stopping, new turns get 503, the turns in flight end within the grace period), then shuts down as
    uvicorn does. A second signal, or one while the model loads, stops at once as uvicorn would."""

    def __init__(self, config, app, grace_s: float):
        super().__init__(config)
        self.qse_app = app
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        service = self.qse_app.service
        if self._draining or self.should_exit or self._loop is None or service is None:
            return super().handle_exit(sig, frame)
        self._draining = True
        self._captured_signals.append(sig)  # uvicorn raises it again once it has stopped
        self._loop.call_soon_threadsafe(self._drain, service)

    def _drain(self, service) -> None:
        task = self._loop.create_task(service.drain(self.grace_s), name="qse-drain")
        task.add_done_callback(lambda _: setattr(self, "should_exit", True))
