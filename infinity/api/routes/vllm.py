"""vLLM's own pooling routes: `/score` (a reranker's scores of text pairs, or an
embedder's cosine of theirs), `/pooling` (each input's pooled output: an embedder's
vector, a classifier's probabilities) and `/ping` (SageMaker's health check, which vLLM's
and TEI's images serve). Their bodies are read into the requests the other routes run, and answered
in vLLM's shapes."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import APIError
from infinity.api.inputs import keeping_last, kept_tokens, text_or_token_inputs, without_special_tokens
from infinity.api.routes.common import ENGINE_CLIENT, MODEL_ERRORS, Route, max_items, served_model
from infinity.api.routes.embeddings import embedder
from infinity.api.routes.scores import activate
from infinity.api.routes.status import health
from infinity.api.types.common import Usage
from infinity.api.types.status import Health
from infinity.api.types.vllm import (PoolingData, PoolingRequest, PoolingResponse, ScoreData, ScoreRequest,
                                     ScoreResponse)
from infinity.client.engine_client import ModelInputs, Result
from infinity.client.topology import ServedModel

# A reranker's pairs, or a text embedder's (the cosine of its vectors).
SCORE_KINDS = ("rerank", "embed")


def score_pairs(body: ScoreRequest, most: int) -> list[tuple[str, str]]:
    """The (first, second) text pairs `body` asks scored: one first text against every
    second one, or the two lists one to one, as vLLM pairs them."""
    forms = [(first, second, names) for first, second, names in (
        (body.text_1, body.text_2, ("text_1", "text_2")), (body.queries, body.documents, ("queries", "documents")))
             if first is not None or second is not None]
    if len(forms) != 1 or forms[0][0] is None or forms[0][1] is None:
        raise APIError(422, "give text_1 and text_2, or queries and documents", param="text_1")
    first, second, names = forms[0]
    sides = []
    for side, name in ((first, names[0]), (second, names[1])):
        texts = [side] if isinstance(side, str) else side
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
            raise APIError(422, f"{name} is a text or a non-empty list of texts", param=name)
        sides.append(texts)
    firsts, seconds = sides
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(422, f"{names[0]} holds one text or as many as {names[1]} ({len(firsts)} against "
                            f"{len(seconds)})", param=names[0])
    if len(seconds) > most:
        raise APIError(413, f"{len(seconds)} pairs; at most {most} in one request", param=names[1])
    return list(zip(firsts, seconds))


async def score(request: web.Request, body: ScoreRequest) -> ScoreResponse:
    model = served_model(request, body.model, SCORE_KINDS)
    kept_tokens(body.truncate_prompt_tokens, model.spec, pairs=True)
    for param in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(body, param):
            raise APIError(422, f"{param} is not served: texts are cut to the model's length "
                                f"({model.spec.max_length} tokens) together", param=param)
    pairs = score_pairs(body, max_items(request))
    if model.spec.kind == "rerank":
        scores, usage, activation = await _cross_encoded(request, model, pairs)
        if body.use_activation is not False:
            scores = activate(scores, activation)
    else:
        scores, usage = await _cosines(request, model, pairs)
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model.spec.name,
                         data=[ScoreData(index=i, score=float(value)) for i, value in enumerate(scores)], usage=usage)


async def _runs(request: web.Request, model: ServedModel, inputs: list[ModelInputs]) -> list[Result]:
    """Run every one of `inputs` at once; their results (the caller releases them)."""
    outcomes = await asyncio.gather(*(request.app[ENGINE_CLIENT].run(model, each) for each in inputs),
                                    return_exceptions=True)
    failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
    if failed is not None:
        for outcome in outcomes:
            if isinstance(outcome, Result):
                outcome.release()
        raise failed
    return list(outcomes)  # type: ignore[arg-type]


def _usage(results: list[Result]) -> Usage:
    tokens = sum(result.prompt_tokens for result in results)
    return Usage(tokens, tokens, sum(result.truncated for result in results))


async def _cross_encoded(request: web.Request, model: ServedModel, pairs: list[tuple[str, str]]
                         ) -> tuple[np.ndarray, Usage, str]:
    """Each pair's logit (the pairs of one first text in one run, each such run at once),
    and the model's activation of them."""
    by_query: dict[str, list[int]] = {}
    for index, (query, _) in enumerate(pairs):
        by_query.setdefault(query, []).append(index)
    results = await _runs(request, model, [ModelInputs(texts=[pairs[i][1] for i in indices], query=query)
                                           for query, indices in by_query.items()])
    scores = np.zeros(len(pairs), dtype=np.float32)
    try:
        for indices, result in zip(by_query.values(), results, strict=True):
            scores[indices] = [row[0] for row in result.rows()]
        activation = results[0].activation
    finally:
        for result in results:
            result.release()
    return scores, _usage(results), activation


async def _cosines(request: web.Request, model: ServedModel, pairs: list[tuple[str, str]]) -> tuple[np.ndarray, Usage]:
    """Each pair's cosine of its two texts' vectors (each distinct text embedded once)."""
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    (result,) = await _runs(request, model, [ModelInputs(texts=texts)])
    try:
        vectors = result.stacked().astype(np.float64)
    finally:
        result.release()
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {text: i for i, text in enumerate(texts)}
    return np.array([vectors[row[first]] @ vectors[row[second]] for first, second in pairs]), _usage([result])


# What `/pooling` answers for each kind, by vLLM's task names.
POOLING_TASKS = {"embed": "embed", "classify": "classify"}


async def pooling(request: web.Request, body: PoolingRequest) -> PoolingResponse:
    model = served_model(request, body.model, tuple(POOLING_TASKS))
    task = POOLING_TASKS[model.spec.kind]
    if body.task not in (None, task):
        raise APIError(422, f"model '{model.spec.name}' pools for task {task!r}, not {body.task!r}", param="task")
    inputs = keeping_last(text_or_token_inputs(body.input, max_items(request)),
                          kept_tokens(body.truncate_prompt_tokens, model.spec), "truncate_prompt_tokens", model.spec)
    inputs = without_special_tokens(inputs, body.add_special_tokens, model.spec)
    if task == "embed":
        result, rows = await embedder(request).vectors(
            model, inputs, None, "dimensions", "use_activation" if body.use_activation is False else None)
    else:
        result = await request.app[ENGINE_CLIENT].run(model, inputs)
        try:
            rows = result.stacked()
        finally:
            result.release()
        if body.use_activation is not False:
            rows = activate(rows, result.activation)
    return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=model.spec.name,
                           data=[PoolingData(index=i, data=row.tolist()) for i, row in enumerate(rows)],
                           usage=Usage.of(result))


async def ping(request: web.Request, body: None) -> Health:
    """POST /ping: as GET /ping, /health."""
    return await health(request, body)


ROUTES = [
    Route(openapi.Operation("post", "/score", ("/v1/score",),
                            "Score text pairs (vLLM): a reranker's relevance, or an embedder's cosine",
                            ScoreRequest, ScoreResponse, MODEL_ERRORS, SCORE_KINDS), score),
    Route(openapi.Operation("post", "/pooling", (), "Each input's pooled output (vLLM): an embedder's vector, a "
                            "classifier's probabilities", PoolingRequest, PoolingResponse, MODEL_ERRORS,
                            tuple(POOLING_TASKS)), pooling),
    Route(openapi.Operation("post", "/ping", (), "200 once every model is loaded on every device; 503 before "
                            "(SageMaker's health check, as GET /ping)", None, Health, (400, 413, 415, 422, 429, 503)), ping),
]
