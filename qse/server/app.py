"""The Starlette app: OpenAI routes, the shadow's routes, /metrics and /healthz.

    RootPath -> RequestContext (X-Request-Id, timing, the request event) -> Cors (QSE_ALLOWED_ORIGINS)
             -> ApiKeys (the tenant) -> routes

CORS sits outside the keys: a browser's preflight (OPTIONS) never carries the key, and a 401 must still carry
the CORS headers for the page to read it.

Routes are thin: read the body (size limit), decode it into a wire Struct, hand it to the Service,
encode what comes back. Every error a client meets is JSON in OpenAI's shape (errors.py).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from ..settings import EngineSettings, SettingError
from . import wire
from .admission import ABORT, Admission, Ticket
from .errors import ApiError, internal_error
from .metrics import CONTENT_TYPE
from .service import Service
from .sse import EventStream
from .tenants import LONE, Keyring, Tenant

log = structlog.get_logger("qse.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = frozenset({"/health", "/healthz"})
TENANT = "qse.tenant"  # the scope key ApiKeys sets: the caller's Tenant
# what a browser page may send and read (the session and request ids it needs to follow a conversation)
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_HEADERS = ("Authorization", "Content-Type", "X-Session-Id", "X-Request-Id", "X-Router-Class")
CORS_EXPOSED = ("X-Session-Id", "X-Request-Id")
# scheme://host[:port], no path: what a browser sends in Origin (a trailing slash would never match)
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.\-]*://[^/\s]+$", re.I)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(wire.encode(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status, err.headers)


def tenant_of(request: Request) -> Tenant:
    """The caller's tenant (the lone tenant where no key is configured)."""
    return request.scope.get(TENANT, LONE)


def _info(request: Request) -> dict[str, Any]:
    """What the request event will carry; handlers add to it."""
    return request.scope.setdefault("qse", {})


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes, over the limit of {limit} (QSE_MAX_BODY_BYTES)",
                       code="request_too_large")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes (QSE_MAX_BODY_BYTES)",
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client left before the request body ended", code="client_disconnected") from None
    return b"".join(chunks)


def endpoint(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """ApiError -> its JSON; anything else -> a logged 500 in the same shape (the server keeps serving)."""

    async def wrapped(request: Request):
        try:
            return await fn(request)
        except ApiError as exc:
            return error_response(exc)
        except Exception as exc:
            request_id = _info(request).get("request_id")
            log.exception("request_failed", error=repr(exc), request_id=request_id)
            return error_response(internal_error(request_id))

    wrapped.__name__ = fn.__name__
    return wrapped


def allowed_origins(settings: EngineSettings) -> list[str]:
    """QSE_ALLOWED_ORIGINS as a list (empty: no CORS); checked, so that a typo fails at start, not in a browser."""
    raw = settings.get("QSE_ALLOWED_ORIGINS")
    origins = [o.strip() for o in raw.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise SettingError(f"QSE_ALLOWED_ORIGINS={raw!r}: {origin!r} is not an origin; expected "
                               "scheme://host[:port] with no path (e.g. https://app.example.com), or * for any")
    return origins


def keepalive_s(settings: EngineSettings) -> float:
    seconds = settings.get("QSE_SSE_KEEPALIVE_S")
    if seconds < 0:
        raise SettingError(f"QSE_SSE_KEEPALIVE_S={seconds}: expected seconds >= 0 (0: no keep-alive comments)")
    return seconds


def check_settings(settings: EngineSettings) -> None:
    """The app's own switches, read as create_app will: qse serve calls this before it loads the model."""
    allowed_origins(settings)
    keepalive_s(settings)


def create_app(service: Service, root_path: str | None = None) -> Starlette:
    """The ASGI app over `service`; root_path defaults to QSE_ROOT_PATH."""
    settings = service.settings
    body_limit = settings.get("QSE_MAX_BODY_BYTES")
    stream_keepalive_s = keepalive_s(settings)

    def openai_route(kind, prepare, chunks, answer):
        """A chat or completions route: decode, admit, prepare the plan, then stream it or answer whole."""

        async def route(request: Request):
            req = _decode_openai(await read_body(request, body_limit), kind, _info(request))
            info, tenant = _info(request), tenant_of(request)
            async with admitted(service.admission, info["request_id"]) as turn:
                plan = await prepare(req, info["request_id"],
                                     wire.session_header(request.headers.get("x-session-id")),
                                     request.headers.get("x-router-class") or None, tenant=tenant)
                plan.ticket = turn.ticket
                info.update(session=plan.session_id, prompt_tokens=len(plan.prompt_ids), stream=req.stream)
                headers = {"x-session-id": tenant.shown(plan.session_id)}
                if req.stream:
                    include_usage = bool(req.stream_options and req.stream_options.include_usage)
                    return turn.stream(_note_output(chunks(plan, include_usage), plan, info), headers,
                                       stream_keepalive_s)
                whole = await turn.answer(request, answer(plan))
                info.update(output_tokens=plan.output_tokens, finish_reason=whole.choices[0].finish_reason)
                return json_response(whole, headers=headers)

        return route

    chat_completions = openai_route(wire.ChatCompletionRequest, service.prepare_chat, service.chat_chunks,
                                    service.chat_answer)
    completions = openai_route(wire.CompletionRequest, service.prepare_completion, service.completion_chunks,
                               service.completion_answer)

    def model_card(name: str) -> wire.ModelCard:
        return wire.ModelCard(id=name, object="model", created=service.created_s, owned_by="qse",
                              root=service.root_name, max_model_len=service.max_context_tokens)

    async def models(request: Request):
        return json_response(wire.ModelList(object="list", data=[model_card(name) for name in service.model_names]))

    async def model(request: Request):
        name = request.path_params["model_id"]  # a :path parameter: served names may hold "/"
        service.check_model(name)  # 404 model_not_found, naming the id and the served names
        return json_response(model_card(name))

    async def tokenize(request: Request):
        return json_response(await service.tokenize(wire.decode(await read_body(request, body_limit),
                                                                wire.TokenizeRequest)))

    async def detokenize(request: Request):
        return json_response(await service.detokenize(wire.decode(await read_body(request, body_limit),
                                                                  wire.DetokenizeRequest)))

    async def shadow_ask(request: Request):
        req = wire.decode(await read_body(request, body_limit), wire.AskRequest)
        _info(request)["session"] = req.session
        return json_response(await service.ask(req, tenant_of(request)))

    async def shadow_summarize(request: Request):
        req = wire.decode(await read_body(request, body_limit), wire.SummarizeRequest)
        _info(request)["session"] = req.session
        return json_response(await service.summarize(req, tenant_of(request)))

    async def shadow_reader(request: Request):
        req = wire.decode(await read_body(request, body_limit), wire.ReaderAction)
        return json_response(await service.reader_action(req.action, tenant_of(request)))

    async def shadow_status(request: Request):
        return json_response(service.status(tenant_of(request)))

    async def metrics(request: Request):
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    async def health(request: Request):
        status, body = service.health()
        return json_response(body, status)

    routes = [
        Route("/health", endpoint(health), methods=["GET"]),
        Route("/healthz", endpoint(health), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/v1/conductor/shadow/ask", endpoint(shadow_ask), methods=["POST"]),
        Route("/v1/conductor/shadow/status", endpoint(shadow_status), methods=["GET"]),
        Route("/v1/conductor/shadow/summarize", endpoint(shadow_summarize), methods=["POST"]),
        Route("/v1/conductor/shadow/reader", endpoint(shadow_reader), methods=["POST"]),
        Route("/metrics", endpoint(metrics), methods=["GET"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, message, code=code))

    @asynccontextmanager
    async def lifespan(app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.service = service
    keyring = Keyring.from_settings(settings)
    open_paths = OPEN_PATHS | ({"/metrics"} if settings.get("QSE_METRICS_PUBLIC") else set())
    inner: Any = app if keyring.is_open else ApiKeys(app, keyring, open_paths)
    origins = allowed_origins(settings)
    if origins:
        inner = Cors(inner, allow_origins=origins, allow_methods=CORS_METHODS, allow_headers=CORS_HEADERS,
                     expose_headers=CORS_EXPOSED)
    root = settings.get("QSE_ROOT_PATH") if root_path is None else root_path
    return RootPath(RequestContext(inner, service, route_labels(routes)), root)  # type: ignore[return-value]


def route_labels(routes: list[Route]) -> Callable[[str], str]:
    """A request's path -> its route's path (the template of a route with parameters), or "other": the request
    metric's route label takes a few values whatever paths clients send."""
    exact = frozenset(r.path for r in routes if not r.param_convertors)
    templated = [r for r in routes if r.param_convertors]

    def label(path: str) -> str:
        if path in exact:
            return path
        return next((r.path for r in templated if r.path_regex.match(path)), "other")

    return label


def _decode_openai(body: bytes, kind: type, info: dict[str, Any]):
    """An OpenAI request: fields outside the schema are ignored with one warning (as vLLM does); the
    client's own labels (user, safety_identifier, metadata) go into the request event."""
    req = wire.decode(body, kind)
    ignored = wire.unknown_fields(body, kind)
    if ignored:
        log.warning("request_fields_ignored", fields=ignored, request_id=info.get("request_id"))
        info["ignored_fields"] = ignored
    for name in ("user", "safety_identifier", "metadata"):
        value = getattr(req, name, None)
        if value:
            info[name] = value
    return req


class AdmittedTurn:
    """One request's place in admission, from the route to the end of its response (`admitted`)."""

    def __init__(self, admission: Admission, ticket: Ticket):
        self.admission = admission
        self.ticket = ticket
        self.is_handed_over = False  # a stream releases the ticket when it is over, not the route

    def stream(self, events, headers: dict[str, str], keepalive_s: float = 0.0) -> EventStream:
        self.is_handed_over = True
        ticket, admission = self.ticket, self.admission
        return EventStream(events, headers, on_gone=lambda: admission.end(ticket, ABORT),
                           on_close=lambda: admission.release(ticket), keepalive_s=keepalive_s)

    async def answer(self, request: Request, work: Awaitable[Any]) -> Any:
        """A non-streaming turn: a client that disconnects ends it at its next decode step (or in the queue)."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            _info(request)["client_gone"] = True  # before the answer was done: the request event says abort
            self.admission.end(self.ticket, ABORT)

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            return await work
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


@asynccontextmanager
async def admitted(admission: Admission, request_id: str):
    """A ticket (429 past the queue, 503 while stopping), released when the route is done with it."""
    turn = AdmittedTurn(admission, admission.admit(request_id))
    try:
        yield turn
    finally:
        if not turn.is_handed_over:
            admission.release(turn.ticket)


async def _note_output(chunks, plan, info: dict[str, Any]):
    """Pass the chunks through; note the turn's outcome for the request event when they end. Closed before their
    end (the client left), the finish reason is "abort", and no output count: the plan's are those it started
    with until a choice ends (the turn's own event and the ledger count what was generated)."""
    ended = False
    try:
        async for chunk in chunks:
            yield chunk
        ended = True
    finally:
        await chunks.aclose()
        if ended:
            info.update(output_tokens=plan.output_tokens, finish_reason=plan.finish_reason)
        else:
            info["finish_reason"] = ABORT


def route_path(scope) -> str:
    root = scope.get("root_path", "")
    path = scope["path"]
    return path[len(root):] if root and path.startswith(root) else path


class RootPath:
    """Serve under QSE_ROOT_PATH whether the proxy strips the prefix or passes it on."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root = root_path.rstrip("/")

    def __getattr__(self, name: str):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if self.root and scope["type"] in ("http", "websocket"):
            scope = dict(scope)
            path = scope["path"]
            if not (path == self.root or path.startswith(self.root + "/")):
                scope["path"] = self.root + path
                scope["raw_path"] = self.root.encode() + (scope.get("raw_path") or path.encode())
            scope["root_path"] = self.root
        await self.app(scope, receive, send)


class RequestContext:
    """X-Request-Id in and out, the request's latency metric, and one 'request' event per request."""

    def __init__(self, app, service: Service, route_label: Callable[[str], str]):
        self.app = app
        self.service = service
        self.route_label = route_label

    def __getattr__(self, name: str):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        asked = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = asked if _REQUEST_ID.match(asked) else uuid.uuid4().hex
        info = scope.setdefault("qse", {})
        info["request_id"] = request_id
        status = {"code": 500}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - t0
            path = route_path(scope)
            self.service.metrics.observe_request(self.route_label(path), status["code"], seconds)
            client = scope.get("client")
            log.info("request", method=scope["method"], path=path, status=status["code"], ms=round(seconds * 1e3, 3),
                     client=client[0] if client else None, scheme=scope.get("scheme"),
                     outcome=outcome(info, status["code"]), **{k: v for k, v in info.items()})


def outcome(info: dict[str, Any], status: int) -> str:
    """The request event's outcome: "abort" where the client left before the end (streamed or not), "error"
    for a 4xx or 5xx or a stream that ended on an error event, else "ok"."""
    if info.get("client_gone"):
        return ABORT
    if status >= 400 or info.get("stream_error"):
        return "error"
    return "ok"


class Cors(CORSMiddleware):
    """Starlette's CORS middleware, with attribute reads passed on to the app below (as the other layers do)."""

    def __getattr__(self, name: str):
        app = self.__dict__.get("app")
        if app is None:
            raise AttributeError(name)
        return getattr(app, name)


class ApiKeys:
    """Authorization: Bearer <key> on every route but the open ones; the key's tenant goes into the scope."""

    def __init__(self, app, keyring: Keyring, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.keyring = keyring
        self.open_paths = open_paths

    def __getattr__(self, name: str):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) in self.open_paths:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        tenant = self.keyring.tenant(token.strip()) if token.strip() else None
        if scheme.lower() != b"bearer" or not token.strip():
            err = ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        elif tenant is None:
            err = ApiError(401, "the API key is not valid", code="invalid_api_key")
        else:
            scope[TENANT] = tenant
            scope.setdefault("qse", {})["tenant"] = tenant.name or None
            return await self.app(scope, receive, send)
        await error_response(err)(scope, receive, send)


class LoadingApp:
    """The server while the model loads, then the app over it: the port is bound before the model loads.

    Loading: /health and /healthz answer 503 {"status": "loading"}, every other route a 503 in OpenAI's shape
    (code "loading"). `load` runs on a worker thread once the server runs; then the service starts and every
    request goes to create_app's app. A failed load is kept in `error` and `on_failure` is called (qse serve
    stops). The lifespan is this object's: it starts and stops the service itself.
    """

    def __init__(self, load: Callable[[], Service], root_path: str | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.load = load
        self.root_path = root_path
        self.on_failure = on_failure
        self.service: Service | None = None
        self.app: Any = None
        self.error: BaseException | None = None
        self._loading: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        if scope["path"].rstrip("/").endswith(("/health", "/healthz")):
            body = {"status": "error" if self.error else "loading"}
            return await json_response(body, 503)(scope, receive, send)
        err = ApiError(503, "the model is still loading; /health answers 200 once it is ready", code="loading")
        await error_response(err)(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loading = asyncio.get_running_loop().create_task(self._load(), name="qse-load")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._loading is not None:
                    await asyncio.gather(self._loading, return_exceptions=True)
                if self.service is not None:
                    await self.service.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        try:
            service = await asyncio.to_thread(self.load)
            await service.start()
        except Exception as exc:
            self.error = exc
            log.error("load_failed", error=repr(exc))
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        self.service = service
        self.app = create_app(service, root_path=self.root_path)
