"""Score routes: rerank (Cohere v1/v2, Jina: documents sorted by relevance) and classify
(every label's score per input), with the model's activation unless raw scores are
asked."""

from __future__ import annotations

import time
import uuid

import numpy as np
from aiohttp import web
from msgspec import UNSET

from infinity import openapi
from infinity.routes.common import MODEL_ERRORS, PIPELINE, Route, max_items, served_model, usage
from infinity.schemas import (ApiVersion, BilledUnits, ClassifyRequest, ClassifyResponse, CohereMeta, InputTokens,
                              LabelScore, RerankDocument, RerankRequest, RerankResponse, RerankResult, rerank_inputs,
                              text_or_token_inputs)


async def rerank(request: web.Request, body: RerankRequest) -> RerankResponse:
    model = served_model(request, body.model, "rerank")
    inputs = rerank_inputs(body, max_items(request))
    result = await request.app[PIPELINE].run(model, inputs)
    try:
        scores = np.array([row[0] for row in result.rows()], dtype=np.float32)
    finally:
        result.release()
    if not body.raw_scores:
        scores = activate(scores, result.activation)
    order = np.argsort(-scores, kind="stable")[:body.top_n or None]
    documents = inputs.texts or []
    results = [RerankResult(index=int(i), relevance_score=float(scores[i]),
                            document=RerankDocument(documents[i]) if body.return_documents else UNSET)
               for i in order]
    return RerankResponse(
        id=uuid.uuid4().hex, created=int(time.time()), results=results, model=model.spec.name, usage=usage(result),
        meta=CohereMeta(ApiVersion("2"), BilledUnits(search_units=1), InputTokens(result.prompt_tokens)))


async def classify(request: web.Request, body: ClassifyRequest) -> ClassifyResponse:
    model = served_model(request, body.model, "classify")
    inputs = text_or_token_inputs(body.input, max_items(request))
    result = await request.app[PIPELINE].run(model, inputs)
    try:
        logits = np.stack(list(result.rows()))
    finally:
        result.release()
    scores = logits if body.raw_scores else activate(logits, result.activation)
    labels = result.labels
    data = [[LabelScore(labels[j], float(row[j])) for j in np.argsort(-row, kind="stable")] for row in scores]
    return ClassifyResponse(id=uuid.uuid4().hex, created=int(time.time()), data=data, model=model.spec.name,
                            usage=usage(result))


def activate(scores: np.ndarray, activation: str) -> np.ndarray:
    """Raw head outputs -> relevance (sigmoid) or label probabilities (softmax on the last axis)."""
    scores = scores.astype(np.float64)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-scores))
    if activation == "softmax":
        exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return exp / exp.sum(axis=-1, keepdims=True)
    return scores


ROUTES = [
    Route(openapi.Operation("post", "/v1/rerank", ("/rerank", "/v2/rerank"),
                            "Score documents against a query, best first (Cohere v1 and v2, Jina)",
                            RerankRequest, RerankResponse, MODEL_ERRORS, ("rerank",)), rerank),
    Route(openapi.Operation("post", "/v1/classify", ("/classify",), "Every label's score for each input",
                            ClassifyRequest, ClassifyResponse, MODEL_ERRORS, ("classify",)), classify),
]
