"""The HTTP application: the routes of `infinity.api.routes` (one table, from which the
OpenAPI document is built too) served under `/v1` and without it (as infinity does),
below the configured `url_prefix`; the JSON error and auth middlewares; the engine
client's start and stop. A route's handler gets its request body decoded into the
route's request type and returns an instance of its response type; it runs at the
request's priority: the body's `priority`, else its API key's.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import signal
import types
import typing
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import hdrs, web
from msgspec import UNSET, Struct

from infinity.api import explorer, openapi
from infinity.config import Config
from infinity.api.connections import BODY, Handler, track_request
from infinity.api.errors import ENCODERS, ERROR_BODY, APIError, ServingError, error_body, error_response, from_kind
from infinity.client.engine_client import EngineClient, StartupError, at_priority
from infinity.api.routes import ROUTES, Route
from infinity.api.media_fetch import MediaFetcher
from infinity.api.metrics import METRICS, MODEL, PRIORITY, Metrics, record_request, serve_metrics
from infinity.api.routes.common import CONFIG, ENGINE_CLIENT, FETCHER, KIND_ROUTES, RawAnswer
from infinity.api.routes.status import DIGESTS, FolderDigests
from infinity.api.decode import decode_body
from infinity.api.types.common import ModelRequest
from infinity.shared import tracing
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec
from infinity.client.supervisor import Launch, spawn_process

log = logging.getLogger(__name__)

EXIT_CODE = web.AppKey("exit_code", list)
START_TASK = web.AppKey("start_task", asyncio.Task)
OPENAPI = web.AppKey("openapi", bytes)
# The paths that `GET` serves without the API key: the explorer, its assets, the redirect to it.
KEYLESS_PAGES = web.AppKey("keyless_pages", frozenset)
MAX_INPUT_CHARS = web.AppKey("max_input_chars", int)  # the most any served model reads of one text


def package_version() -> str:
    """The installed package's version, or pyproject.toml's in a source tree run without
    installing it (as the GPU checks run it: the checkout on the PYTHONPATH)."""
    try:
        return version("infinity-serve")
    except PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def create_app(config: Config, specs: list[ModelSpec], launch: Launch = spawn_process) -> web.Application:
    """The application serving `specs`; `launch` starts its children (processes, but in
    the fast tests)."""
    server = config.server
    client = EngineClient(server, specs, launch, config.media)
    served_version = package_version()
    metrics = Metrics(client, served_version)
    middlewares = [record_request(metrics), _json_errors, _authorization(config.key_priorities()), track_request]
    app = web.Application(client_max_size=server.max_request_bytes,
                          middlewares=[_traced, *middlewares] if tracing.tracer() is not None else middlewares)
    app[CONFIG] = config
    app[ENGINE_CLIENT] = client
    app[METRICS] = metrics
    app[FETCHER] = MediaFetcher(config.media)
    app[DIGESTS] = FolderDigests()
    app[EXIT_CODE] = [0]
    app[MAX_INPUT_CHARS] = max(spec.max_input_chars for spec in specs)
    for route in ROUTES:
        op = route.operation
        for path in (op.path, *op.aliases):
            app.router.add_route(op.method.upper(), server.url_prefix + path, _handler(route))
    app[KIND_ROUTES] = {kind: [f"{op.method.upper()} {op.path}" for op in (route.operation for route in ROUTES)
                               if kind in op.kinds] for kind in KINDS}
    names: dict[str, list[str]] = {}  # the served models of each kind
    for spec in specs:
        if spec.name not in names.setdefault(spec.kind, []):
            names[spec.kind].append(spec.name)
    document = explorer.api_document(served_version, names, server.url_prefix, api_key=bool(config.key_priorities()))
    app[OPENAPI] = msgspec.json.encode(document)
    app.router.add_get(f"{server.url_prefix}/openapi.json", _serve_openapi)
    app[KEYLESS_PAGES] = explorer.add_routes(app, server.url_prefix, document)
    app.router.add_get(f"{server.url_prefix}/metrics", serve_metrics)
    app.on_startup.append(_start_engine_client)
    app.on_cleanup.append(_stop_engine_client)
    return app


def _handler(route: Route) -> Handler:
    """The aiohttp handler of `route`: decode the body, serve, encode the answer."""
    op = route.operation
    answer_classes = _answer_classes(op.answer)

    async def handle(request: web.Request) -> web.Response:
        request_type = route.body_of(request, bytes(request[BODY])) if route.body_of is not None else op.body
        # On a path of several dialects, a dialect's body answers its errors in its shape (TEI's).
        encode_error = getattr(request_type, "error_body", None)
        if encode_error is not None:
            request[ERROR_BODY] = encode_error
        body = await _read(request, request_type, op.media) if request_type is not None else None
        if isinstance(body, ModelRequest):
            request[PRIORITY] = request.get(KEY_PRIORITY, 0) if body.priority is UNSET else body.priority
        with at_priority(request.get(PRIORITY, 0)):
            answer = await route.serve(request, body)
        if isinstance(answer, RawAnswer) and op.binary:
            return web.Response(body=answer.body, content_type=answer.content_type, headers=answer.headers)
        assert isinstance(answer, answer_classes), f"{op.path} answered {type(answer).__name__}"
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    handle.error_body = ENCODERS.get(op.error_answer, error_body)  # type: ignore[attr-defined]
    return handle


def _answer_classes(answer: Any) -> tuple[type, ...]:
    """The classes an operation's answers are instances of: a Struct's, or for a NewType
    (an answer of another shape) those of the type it names, each member's of a union or of
    a tuple (an operation answering in the shape its body asks)."""
    if isinstance(answer, tuple):
        return tuple(cls for each in answer for cls in _answer_classes(each))
    named = getattr(answer, "__supertype__", answer)
    members = typing.get_args(named) if isinstance(named, types.UnionType) else (named,)
    return tuple(typing.get_origin(member) or member for member in members)


async def _serve_openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


# --- middlewares ------------------------------------------------------------------------

@web.middleware
async def _traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware where tracing is on: the request's server span, a child of
    the client's `traceparent` if it sent one, current while the request is served."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    tracer = tracing.tracer()
    assert tracer is not None
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else None
    with tracer.start_as_current_span(f"{request.method} {route}" if route else request.method,
                                      tracing.parent_context(request.headers), kind=SpanKind.SERVER,
                                      attributes={"http.request.method": request.method, "url.path": request.path,
                                                  **({"http.route": route} if route else {})}) as span:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            tracing.encoded(span)
            span.set_attribute("http.response.status_code", status)
            for key, attribute in ((MODEL, "infinity.model"), (PRIORITY, "infinity.priority")):
                if key in request:
                    span.set_attribute(attribute, request[key])
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error, whoever raised it, in the one JSON shape (a dialect's own where
    the route set one: `ERROR_BODY`)."""
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc, _error_encoder(request))
    except ServingError as exc:
        return error_response(from_kind(exc), _error_encoder(request))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_http_error(request, exc), _error_encoder(request))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "internal server error"))


def _error_encoder(request: web.Request) -> Callable[[APIError], bytes]:
    """How `request`'s errors are encoded: as its body's dialect answers them, else as its
    route's operation declares (`_handler`), else in the one shape."""
    if ERROR_BODY in request:
        return request[ERROR_BODY]  # type: ignore[return-value]
    return getattr(request.match_info.handler, "error_body", error_body)


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, f"no route {request.method} {request.path}", code="not_found")
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ())))
        return APIError(405, f"method {request.method} is not allowed on {request.path}; use {allowed}",
                        code="method_not_allowed", headers={"Allow": allowed})
    if exc.status == 413:
        limit = request.app[CONFIG].server.max_request_bytes
        return APIError(413, f"request body is larger than the limit of {limit} bytes",
                        code="request_too_large")
    return APIError(exc.status, exc.reason)


# The priority of requests that name none, from the API key they were sent with.
KEY_PRIORITY = web.RequestKey("key_priority", int)


def _authorization(keys: dict[str, int]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Require one of `keys` (none: no key) and note its priority for the request."""
    expected = [(f"Bearer {key}".encode(), priority) for key, priority in keys.items()]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected and not request.path.endswith(openapi.KEYLESS_PATHS) and not (
                request.method in ("GET", "HEAD") and request.path in request.app[KEYLESS_PAGES]):
            given = request.headers.get("Authorization", "").encode()
            # Every key compared in full, so the time taken tells nothing of which was close.
            matches = [priority for key, priority in expected if hmac.compare_digest(given, key)]
            if not matches:
                raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
            request[KEY_PRIORITY] = matches[0]
        return await handler(request)

    return check


# --- lifecycle ---------------------------------------------------------------------------

async def _start_engine_client(app: web.Application) -> None:
    async def start() -> None:
        try:
            await app[ENGINE_CLIENT].start()
            # What start-up made lives as long as the process: the collector need not scan
            # it again at every full collection while serving.
            gc.freeze()
            log.info("all models loaded; serving")
        except StartupError as exc:
            log.error("cannot start: %s", exc)
            app[EXIT_CODE][0] = 1
            os.kill(os.getpid(), signal.SIGTERM)

    app[START_TASK] = asyncio.create_task(start())


async def _stop_engine_client(app: web.Application) -> None:
    app[START_TASK].cancel()
    await app[ENGINE_CLIENT].stop()
    await app[FETCHER].close()
    await app[DIGESTS].close()


async def _read(request: web.Request, request_type: type[Struct], media: bool = False) -> Any:
    """The JSON body of `request` (already read by `track_request`), decoded into
    `request_type`; a body of another declared type is 415 (see `decode_body` for the rest;
    `media`: the route's inputs are media, never shortened)."""
    if hdrs.CONTENT_TYPE in request.headers and not _is_json(request.content_type):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                            f"not {request.content_type}", code="unsupported_media_type")
    return decode_body(request[BODY], request_type, None if media else request.app[MAX_INPUT_CHARS],
                       request.app[CONFIG].server.unknown_fields)


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/")
                                                and media_type.endswith("+json"))
