"""The HTTP API: the routes (one table, from which the OpenAPI document is built too), the
JSON error and auth middlewares, and the encoding of responses straight from the
shared-memory arena.

Every route is served under `/v1` and without it (as infinity does), below the
configured `url_prefix`. A route's handler gets its request body decoded into the route's
request type and returns an instance of its response type.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import msgspec
import numpy as np
from aiohttp import hdrs, web
from msgspec import UNSET, Struct

from infinity import openapi
from infinity.config import Config
from infinity.connections import BODY, track_request
from infinity.errors import APIError, error_response
from infinity.pipeline import Pipeline, Result, ServedModel, StartupError
from infinity.shared.protocol import ModelSpec
from infinity.quantize import encode
from infinity.schemas import (ApiVersion, BilledUnits, ClassifyRequest, ClassifyResponse, CohereEmbedRequest,
                              CohereEmbedResponse, CohereMeta, EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                              Health, InputTokens, LabelScore, ModelCard, ModelInputs, ModelList, ModelStats,
                              ReplicaCard, RerankDocument, RerankRequest, RerankResponse, RerankResult, Usage,
                              decode_body, output_types, rerank_inputs, text_inputs, text_or_token_inputs)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PIPELINE = web.AppKey("pipeline", Pipeline)
CONFIG = web.AppKey("config", Config)
EXIT_CODE = web.AppKey("exit_code", list)
START_TASK = web.AppKey("start_task", asyncio.Task)
OPENAPI = web.AppKey("openapi", bytes)
DOCS = web.AppKey("docs", str)
MAX_INPUT_CHARS = web.AppKey("max_input_chars", int)  # the most any served model reads of one text


@dataclass(frozen=True)
class Route:
    """One operation of the API and the function that serves it: `serve(request, body)`
    returns the operation's answer type (`body` is None for routes without one)."""

    operation: openapi.Operation
    serve: Callable[[web.Request, Any], Awaitable[Struct]]


def create_app(config: Config, specs: list[ModelSpec]) -> web.Application:
    server = config.server
    app = web.Application(
        client_max_size=server.max_request_bytes,
        middlewares=[_json_errors, _authorization(server.api_key), track_request],
    )
    app[CONFIG] = config
    app[PIPELINE] = Pipeline(server, specs)
    app[EXIT_CODE] = [0]
    app[MAX_INPUT_CHARS] = max(spec.max_input_chars for spec in specs)
    for route in ROUTES:
        op = route.operation
        for path in (op.path, *op.aliases):
            app.router.add_route(op.method.upper(), server.url_prefix + path, _handler(route))
    names: dict[str, list[str]] = {}  # the served models of each kind
    for spec in specs:
        if spec.name not in names.setdefault(spec.kind, []):
            names[spec.kind].append(spec.name)
    document = openapi.document([route.operation for route in ROUTES], "infinity-serve", version("infinity-serve"),
                                names, server.url_prefix, api_key=server.api_key is not None)
    app[OPENAPI] = msgspec.json.encode(document)
    app[DOCS] = openapi.render_html(document)
    app.router.add_get(f"{server.url_prefix}/openapi.json", _serve_openapi)
    app.router.add_get(f"{server.url_prefix}/docs", _serve_docs)
    app.on_startup.append(_start_pipeline)
    app.on_cleanup.append(_stop_pipeline)
    return app


def _handler(route: Route) -> Handler:
    """The aiohttp handler of `route`: decode the body, serve, encode the answer."""
    op = route.operation

    async def handle(request: web.Request) -> web.Response:
        body = await _read(request, op.body) if op.body is not None else None
        answer = await route.serve(request, body)
        assert isinstance(answer, op.answer), f"{op.path} answered {type(answer).__name__}"
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    return handle


async def _serve_openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


async def _serve_docs(request: web.Request) -> web.Response:
    return web.Response(text=request.app[DOCS], content_type="text/html")


# --- middlewares ------------------------------------------------------------------------

@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error, whoever raised it, in the one JSON shape."""
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_http_error(request, exc))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "internal server error"))


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


def _authorization(api_key: str | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and not request.path.endswith("/health"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    return check


# --- lifecycle ---------------------------------------------------------------------------

async def _start_pipeline(app: web.Application) -> None:
    async def start() -> None:
        try:
            await app[PIPELINE].start()
            log.info("all models loaded; serving")
        except StartupError as exc:
            log.error("cannot start: %s", exc)
            app[EXIT_CODE][0] = 1
            os.kill(os.getpid(), signal.SIGTERM)

    app[START_TASK] = asyncio.create_task(start())


async def _stop_pipeline(app: web.Application) -> None:
    app[START_TASK].cancel()
    await app[PIPELINE].stop()


# --- routes ------------------------------------------------------------------------------

async def health(request: web.Request, _: None) -> Health:
    if not request.app[PIPELINE].ready:
        raise APIError(503, "models are loading", code="not_ready", headers={"Retry-After": "1"})
    return Health("ok", time.time())


async def models(request: web.Request, _: None) -> ModelList:
    return ModelList(data=[_model_card(model) for model in request.app[PIPELINE].models.values()])


def _model_card(model: ServedModel) -> ModelCard:
    info, spec = model.info, model.spec
    queued = model.pool.capacity - model.pool.free
    return ModelCard(
        id=spec.name,
        created=int(time.time()),
        kind=spec.kind,  # type: ignore[arg-type]
        capabilities=[spec.kind],
        backend=info.engine if info else spec.engine,
        stats=ModelStats(queue_fraction=queued / model.pool.capacity, queue_absolute=queued,
                         results_pending=sum(replica.outstanding for replica in model.replicas),
                         batch_size=spec.max_batch_size),
        ready=model.ready,
        dimensions=info.dim if info else None,
        max_length=spec.max_length,
        devices=[replica.device for replica in model.replicas],
        # Each replica's readiness and the inputs it has computed (how the load spreads).
        replicas=[ReplicaCard(replica.device, replica.ready, replica.served,
                              replica.info.engine if replica.info else None) for replica in model.replicas],
    )


async def embeddings(request: web.Request, body: EmbeddingRequest) -> EmbeddingResponse:
    """OpenAI embeddings; with `embedding_types`, each item holds `embeddings` by type
    instead of `embedding`."""
    types = body.output_types(request.app[CONFIG].server.embedding_type)
    model = _served_model(request.app[PIPELINE], body.model, "embed")
    inputs = text_or_token_inputs(body.input, _max_items(request))
    # 0 asks for every dimension, as in infinity (its generated client sends 0 by default).
    result, rows = await _embed(request, model, inputs, body.dimensions or None, "dimensions")
    encoded = {t: encode(rows, t, body.encoding_format == "base64") for t in types}
    if body.embedding_types is None:
        data = [EmbeddingData(index=i, embedding=value) for i, value in enumerate(encoded[types[0]])]
    else:
        data = [EmbeddingData(index=i, embeddings={t: encoded[t][i] for t in types}) for i in range(len(rows))]
    return EmbeddingResponse(data=data, model=model.spec.name, usage=_usage(result))


async def cohere_embed(request: web.Request, body: CohereEmbedRequest) -> CohereEmbedResponse:
    """Cohere v1/v2 embed. v1 without `embedding_types` (and a float server default)
    answers `embeddings_floats`; otherwise `embeddings_by_type`, where Cohere's `base64`
    type is the base64 of the float32 values."""
    default = request.app[CONFIG].server.embedding_type
    types = output_types(body.embedding_types, default)
    model = _served_model(request.app[PIPELINE], body.model, "embed")
    inputs = text_inputs(body.texts, _max_items(request), "texts")
    result, rows = await _embed(request, model, inputs, body.output_dimension, "output_dimension")
    version = "2" if request.path.endswith("/v2/embed") else "1"
    by_type = version == "2" or body.embedding_types is not None or default != "float"
    embeddings = ({t: encode(rows, "float", True) if t == "base64" else encode(rows, t) for t in types}
                  if by_type else encode(rows, "float"))
    tokens = result.prompt_tokens
    return CohereEmbedResponse(
        id=uuid.uuid4().hex, embeddings=embeddings, texts=body.texts,  # type: ignore[arg-type]
        meta=CohereMeta(ApiVersion(version), BilledUnits(input_tokens=tokens), InputTokens(tokens)),
        response_type="embeddings_by_type" if by_type else "embeddings_floats")


async def rerank(request: web.Request, body: RerankRequest) -> RerankResponse:
    pipeline = request.app[PIPELINE]
    model = _served_model(pipeline, body.model, "rerank")
    inputs = rerank_inputs(body, _max_items(request))
    result = await pipeline.run(model, inputs)
    try:
        scores = np.array([row[0] for row in result.rows()], dtype=np.float32)
    finally:
        result.release()
    if not body.raw_scores:
        scores = _activate(scores, result.activation)
    order = np.argsort(-scores, kind="stable")[:body.top_n or None]
    documents = inputs.texts or []
    results = [RerankResult(index=int(i), relevance_score=float(scores[i]),
                            document=RerankDocument(documents[i]) if body.return_documents else UNSET)
               for i in order]
    return RerankResponse(
        id=uuid.uuid4().hex, created=int(time.time()), results=results, model=model.spec.name, usage=_usage(result),
        meta=CohereMeta(ApiVersion("2"), BilledUnits(search_units=1), InputTokens(result.prompt_tokens)))


async def classify(request: web.Request, body: ClassifyRequest) -> ClassifyResponse:
    pipeline = request.app[PIPELINE]
    model = _served_model(pipeline, body.model, "classify")
    inputs = text_or_token_inputs(body.input, _max_items(request))
    result = await pipeline.run(model, inputs)
    try:
        logits = np.stack(list(result.rows()))
    finally:
        result.release()
    scores = logits if body.raw_scores else _activate(logits, result.activation)
    labels = result.labels
    data = [[LabelScore(labels[j], float(row[j])) for j in np.argsort(-row, kind="stable")] for row in scores]
    return ClassifyResponse(id=uuid.uuid4().hex, created=int(time.time()), data=data, model=model.spec.name, usage=_usage(result))


_MODEL_ERRORS = (400, 404, 408, 413, 415, 422, 429, 503)
ROUTES = [
    Route(openapi.Operation("post", "/v1/embeddings", ("/embeddings",), "Embed texts or token ids (OpenAI)",
                            EmbeddingRequest, EmbeddingResponse, _MODEL_ERRORS, "embed"), embeddings),
    Route(openapi.Operation("post", "/v1/embed", ("/embed", "/v2/embed"), "Embed texts (Cohere v1 and v2)",
                            CohereEmbedRequest, CohereEmbedResponse, _MODEL_ERRORS, "embed"), cohere_embed),
    Route(openapi.Operation("post", "/v1/rerank", ("/rerank", "/v2/rerank"),
                            "Score documents against a query, best first (Cohere v1 and v2, Jina)",
                            RerankRequest, RerankResponse, _MODEL_ERRORS, "rerank"), rerank),
    Route(openapi.Operation("post", "/v1/classify", ("/classify",), "Every label's score for each input",
                            ClassifyRequest, ClassifyResponse, _MODEL_ERRORS, "classify"), classify),
    Route(openapi.Operation("get", "/v1/models", ("/models",), "The served models, their replicas and queues",
                            None, ModelList, ()), models),
    Route(openapi.Operation("get", "/health", ("/v1/health",),
                            "200 once every model is loaded on every device; 503 before", None, Health, (503,)),
          health),
]
# The model name infinity's generated client sends when its caller names none.
UNNAMED_MODEL = "default/not-specified"
# The route that serves each model kind.
KIND_ROUTES = {"embed": "/v1/embeddings", "rerank": "/v1/rerank", "classify": "/v1/classify"}


async def _read(request: web.Request, request_type: type[Struct]) -> Any:
    """The JSON body of `request` (already read by `track_request`), decoded into
    `request_type`; a body of another declared type is 415 (see `decode_body` for the rest)."""
    if hdrs.CONTENT_TYPE in request.headers and not _is_json(request.content_type):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                            f"not {request.content_type}", code="unsupported_media_type")
    return decode_body(request[BODY], request_type, request.app[MAX_INPUT_CHARS])


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/")
                                                and media_type.endswith("+json"))


def _usage(result: Result) -> Usage:
    return Usage(result.prompt_tokens, result.prompt_tokens, result.truncated)


def _max_items(request: web.Request) -> int:
    """Items one request may carry: never more than a model's whole queue, since such a
    request could never be admitted."""
    server = request.app[CONFIG].server
    return min(server.max_items_per_request, server.max_queued_items)


def _activate(scores: np.ndarray, activation: str) -> np.ndarray:
    """Raw head outputs -> relevance (sigmoid) or label probabilities (softmax on the last axis)."""
    scores = scores.astype(np.float64)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-scores))
    if activation == "softmax":
        exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return exp / exp.sum(axis=-1, keepdims=True)
    return scores


def _served_model(pipeline: Pipeline, name: str | None, kind: str) -> ServedModel:
    """The model a request names, which must be of `kind`; without a name, the only
    model of that kind."""
    if name is None or name == UNNAMED_MODEL:
        of_kind = [m for m in pipeline.models.values() if m.spec.kind == kind]
        if len(of_kind) == 1:
            return of_kind[0]
        raise APIError(422, f"model is required: this server serves {len(of_kind)} models of kind '{kind}'",
                       param="model")
    model = pipeline.models.get(name)
    if model is None:
        served = ", ".join(pipeline.models)
        raise APIError(404, f"model '{name}' is not served here; served models: {served}",
                       param="model", code="model_not_found")
    if model.spec.kind != kind:
        raise APIError(400, f"model '{name}' is of kind '{model.spec.kind}'; it serves "
                            f"POST {KIND_ROUTES[model.spec.kind]}, not the {kind} route", param="model",
                       code="wrong_model_kind")
    return model


async def _embed(request: web.Request, model: ServedModel, inputs: ModelInputs, dimensions: int | None,
                 dimensions_param: str) -> tuple[Result, np.ndarray]:
    """Run `inputs` through an embedder; return the (released) result and its vectors as
    one (n, dim) float32 array, truncated to `dimensions` and re-normalised."""
    dim = model.info.dim if model.info else None
    if dimensions is not None and dim is not None and not 0 < dimensions <= dim:
        raise APIError(422, f"{dimensions_param} must be between 1 and {dim} for model '{model.spec.name}'",
                       param=dimensions_param)
    result = await request.app[PIPELINE].run(model, inputs)
    try:
        rows = np.stack(list(result.rows()))
    finally:
        result.release()
    if dimensions is not None and dimensions < rows.shape[1]:
        rows = rows[:, :dimensions]
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return result, rows
