"""SageMaker's inference path, `POST /invocations`, which the images of vLLM and TEI both
serve: one path for every body, told apart by its keys and answered by the route that
body belongs to. TEI's bodies (`inputs`, or `query` with `texts`) as TEI's `POST /`;
vLLM's as vLLM's `/invocations` tries its request types (score, rerank, pooling, then
embeddings or classification by the kind of the model the body names, or of the only one)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import ErrorResponse, TEIErrorResponse
from infinity.api.routes import embeddings, scores, tei, vllm
from infinity.api.routes.common import ENGINE_CLIENT, MODEL_ERRORS, RawAnswer, Route, UNNAMED_MODEL, body_members
from infinity.api.types.embeddings import EmbeddingRequest, EmbeddingResponse
from infinity.api.types.scores import ClassifyRequest, RerankRequest, RerankResponse
from infinity.api.types.tei import (SimilarityResponse, TEIEmbedRequest, TEIEmbedResponse, TEIPredictionBatch,
                                    TEIPredictions, TEIPredictRequest, TEIRerankRequest, TEIRerankResponse,
                                    TEISimilarityRequest)
from infinity.api.types.vllm import (PoolingRequest, PoolingResponse, ScoreRequest, ScoreResponse,
                                     VllmClassifyResponse)

_TEI_BODIES = (TEIEmbedRequest, TEIRerankRequest, TEISimilarityRequest, TEIPredictRequest)
_VLLM_BODIES = (ScoreRequest, RerankRequest, PoolingRequest, ClassifyRequest, EmbeddingRequest)


def invocation_body_of(request: web.Request, body: bytes) -> type[msgspec.Struct]:
    """The body's type, by its keys: TEI's where it holds `inputs` or `texts` (as `POST /`
    tells them); vLLM's score (`text_1`, `text_2`, `queries`), rerank (`query` with
    `documents`), pooling (`task`); else (`input`) a classifier's body where the model it
    names, or the only model of an embedding or classifying kind, classifies, and an
    embeddings body otherwise (whose route then says what is wrong with it)."""
    members = body_members(body)
    if members is None:
        return EmbeddingRequest
    if members.keys() & {"inputs", "texts"}:
        return tei.root_body_of(request, body)
    if members.keys() & {"text_1", "text_2", "queries"}:
        return ScoreRequest
    if "query" in members:
        return RerankRequest
    if "task" in members:
        return PoolingRequest
    kind = _kind_of_named_model(request, members.get("model"))
    return ClassifyRequest if kind in scores.CLASSIFY_KINDS else EmbeddingRequest


def _kind_of_named_model(request: web.Request, named: msgspec.Raw | None) -> str | None:
    """The kind of the model a body's `model` names, or without a name of the only model
    that embeds or classifies; None where there is no such one model."""
    models = request.app[ENGINE_CLIENT].models
    try:
        name = None if named is None else msgspec.json.decode(named, type=str | None)
    except msgspec.ValidationError:
        return None
    if name is not None and name != UNNAMED_MODEL:
        model = models.get(name)
        return None if model is None else model.spec.kind
    kinds = [m.spec.kind for m in models.values() if m.spec.kind in (*embeddings.OPENAI_KINDS, *scores.CLASSIFY_KINDS)]
    return kinds[0] if len(kinds) == 1 else None


async def invocations(request: web.Request, body: msgspec.Struct) -> msgspec.Struct | list | RawAnswer:
    """The route of the body `invocation_body_of` told apart; a classifier's and a
    reranker's answers in vLLM's shapes."""
    if isinstance(body, _TEI_BODIES):
        return await tei.root(request, body)
    if isinstance(body, ScoreRequest):
        return await vllm.score(request, body)
    if isinstance(body, RerankRequest):
        return await scores.rerank(request, body)
    if isinstance(body, PoolingRequest):
        return await vllm.pooling(request, body)
    if isinstance(body, ClassifyRequest):
        return await scores.classes(request, body, vllm_shaped=True)
    assert isinstance(body, EmbeddingRequest)
    return await embeddings.embeddings(request, body)


ROUTES = [
    Route(openapi.Operation("post", "/invocations", (), "SageMaker's inference path (vLLM's and TEI's images): "
                            "the body's keys choose TEI's POST / or vLLM's score, rerank, pooling, classify or "
                            "embeddings", (*_TEI_BODIES, *_VLLM_BODIES),
                            (TEIEmbedResponse, TEIRerankResponse, TEIPredictions, TEIPredictionBatch,
                             SimilarityResponse, ScoreResponse, RerankResponse, PoolingResponse, VllmClassifyResponse,
                             EmbeddingResponse), MODEL_ERRORS, binary=True,
                            error_answer=(ErrorResponse, TEIErrorResponse), forwards=True),
          invocations, invocation_body_of),
]
