"""Score routes: rerank (Cohere v1/v2, Jina: documents sorted by relevance, by a
cross-encoder, by a multi-vector model's late interaction or by a hybrid model's three
scores) and classify (every label's score per input), with the model's activation unless
raw scores are asked."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable

import msgspec
import numpy as np
from aiohttp import web
from msgspec import UNSET

from infinity.api import openapi
from infinity.api.errors import APIError
from infinity.api.inputs import (keeping_last, kept_tokens, page_documents, rerank_inputs, text_or_token_inputs,
                                 without_special_tokens)
from infinity.api.long_inputs import best_chunks, with_long_inputs
from infinity.api.media_fetch import media_bytes
from infinity.api.routes.common import (CONFIG, ENGINE_CLIENT, FETCHER, MODEL_ERRORS, Route, kinds_serving, max_items,
                                        served_model)
from infinity.api.types.common import ApiVersion, BilledUnits, CohereMeta, InputTokens, Usage
from infinity.api.types.scores import (ClassifyRequest, ClassifyResponse, LabelScore, RerankDocument, RerankRequest,
                                       RerankResponse, RerankResult)
from infinity.api.types.vllm import VllmClassData, VllmClassifyResponse
from infinity.client.engine_client import ModelInputs, Result
from infinity.client.topology import ServedModel

RERANK_KINDS = kinds_serving("rerank")  # the model kinds each route serves
# Where a returned document is Cohere's, Jina's and vLLM's object (`{"text"}`); on
# infinity's own path, `/rerank`, it is the text itself, as infinity's client and LiteLLM's
# infinity provider read it.
DOCUMENT_OBJECT_PATHS = ("/v1/rerank", "/v2/rerank", "/invocations")
CLASSIFY_KINDS = kinds_serving("classify")


async def rerank(request: web.Request, body: RerankRequest, refuse_cut: str | None = None) -> RerankResponse:
    """A cross-encoder's relevance (its activation unless raw scores are asked), or a
    multi-vector model's late-interaction score; a page-retrieval model's documents are
    page images. Long documents of a cross-encoder or of a multi-vector model of texts may
    be chunked (`max_chunks_per_doc`): each scores as its best chunk. `refuse_cut`: the
    request field that forbids cutting a document (TEI's `truncate: false`), where one does."""
    model = served_model(request, body.model, RERANK_KINDS)
    if refuse_cut is not None and not model.kind.chunks_documents:
        raise APIError(422, f"{refuse_cut}: false is not served by the {model.spec.kind} model '{model.spec.name}' "
                            "(its documents are read up to its length)", param=refuse_cut)
    kept_tokens(body.truncate_prompt_tokens, model.spec, pairs=True)
    raw_scores = body.raw_scores or body.use_activation is False
    if ((body.max_chunks_per_doc or 1) > 1 or body.chunk_overlap is not None) and not model.kind.chunks_documents:
        raise APIError(422, f"max_chunks_per_doc applies to cross-encoders and multi-vector models of texts; the "
                            f"{model.spec.kind} model '{model.spec.name}' reads each document whole up to its length",
                       param="max_chunks_per_doc")
    chunked: ModelInputs | None = None  # the documents as sent to be chunked as asked, where they may be
    chunks = None  # how many chunks each document made, where some made several
    if model.kind.late_interaction and model.kind.medium == "image":  # its documents are page images
        documents = page_documents(body, max_items(request))
        pages = await media_bytes(request.app[FETCHER], documents, request.app[CONFIG].media.max_image_bytes,
                                  max_items(request))
        scores, _, tokens = await _late_interaction(request, model, ModelInputs(texts=[body.query]),
                                                    ModelInputs(media=pages))
    else:
        inputs = rerank_inputs(body, max_items(request))
        documents = inputs.texts or []
        if model.kind.vector_types:
            every_type = model.kind.vector_types
            scores, _, tokens = await _scored(request, model, ModelInputs(texts=[inputs.query or ""],
                                                                          vector_types=every_type),
                                              ModelInputs(texts=documents, vector_types=every_type), hybrid_scores)
        elif model.kind.late_interaction:
            chunked = _chunked_as_asked(model, ModelInputs(texts=documents, task="document", refuse_cut=refuse_cut),
                                        body)
            scores, chunks, tokens = await _late_interaction(request, model, ModelInputs(texts=[inputs.query or ""],
                                                                                         task="query"), chunked)
        else:
            chunked = _chunked_as_asked(model, msgspec.structs.replace(inputs, refuse_cut=refuse_cut), body)
            result = await request.app[ENGINE_CLIENT].run(model, chunked)
            try:
                scores = np.array([row[0] for row in result.rows()], dtype=np.float32)
            finally:
                result.release()
            chunks = result.chunks
            if not raw_scores:
                scores = activate(scores, result.activation)
            tokens = Usage.of(result)
    scores, best = best_chunks(scores, chunks)
    chunk_indices = best if chunked is not None and (chunked.long_inputs or model.spec.long_inputs) == "chunk" else None
    order = np.argsort(-scores, kind="stable")[:body.top_n or None]
    as_text = not request.path.endswith(DOCUMENT_OBJECT_PATHS)
    results = [RerankResult(index=int(i), relevance_score=float(scores[i]),
                            document=(documents[i] if as_text else RerankDocument(documents[i]))
                            if body.return_documents else UNSET,
                            chunk_index=UNSET if chunk_indices is None else int(chunk_indices[i]))
               for i in order]
    return RerankResponse(
        id=uuid.uuid4().hex, created=int(time.time()), results=results, model=model.spec.name, usage=tokens,
        meta=CohereMeta(ApiVersion("2"), BilledUnits(search_units=1), InputTokens(tokens.prompt_tokens)))


def _chunked_as_asked(model: ServedModel, inputs: ModelInputs, body: RerankRequest) -> ModelInputs:
    """Documents to rerank (`inputs`), long ones taken as `body` asks: `max_chunks_per_doc`
    1 cuts them, more chunks them (none: as the model is set)."""
    most = body.max_chunks_per_doc
    long_inputs = None if most is None else "truncate" if most == 1 else "chunk"
    return with_long_inputs(model, inputs, long_inputs, body.chunk_overlap, most if long_inputs == "chunk" else None)


async def _late_interaction(request: web.Request, model: ServedModel, query: ModelInputs,
                            documents: ModelInputs) -> tuple[np.ndarray, list[int] | None, Usage]:
    """Each document's (or chunk's: `_scored`) MaxSim against the query, as the model scores
    (`maxsim_scores`)."""
    def score(query_result: Result, document_result: Result) -> np.ndarray:
        (query_rows,) = query_result.rows()
        return maxsim_scores(model.spec.similarity, query_rows, document_result.rows())

    return await _scored(request, model, query, documents, score)


async def _scored(request: web.Request, model: ServedModel, query: ModelInputs, documents: ModelInputs,
                  score: Callable[[Result, Result], np.ndarray]) -> tuple[np.ndarray, list[int] | None, Usage]:
    """Run the query and the documents at once; each document's score, `score(query's
    result, documents' result)` (each chunk's, where they were chunked), how many chunks
    each document made (`Result.chunks`), and the tokens both cost."""
    client = request.app[ENGINE_CLIENT]
    results = await asyncio.gather(client.run(model, query), client.run(model, documents),
                                   return_exceptions=True)
    try:
        for outcome in results:
            if isinstance(outcome, BaseException):
                raise outcome
        query_result, document_result = results
        scores = score(query_result, document_result)
    finally:
        for outcome in results:
            if isinstance(outcome, Result):
                outcome.release()
    tokens = query_result.prompt_tokens + document_result.prompt_tokens
    return scores, document_result.chunks, Usage(tokens, tokens, query_result.truncated + document_result.truncated)


def maxsim_scores(similarity: str, query: np.ndarray, documents: Iterable[np.ndarray]) -> np.ndarray:
    """Each document's MaxSim against the query (vectors per token), divided by the query's
    vectors for "meanmaxsim"."""
    scores = np.array([maxsim(query, rows) for rows in documents], dtype=np.float32)
    return scores / max(len(query), 1) if similarity == "meanmaxsim" else scores


def hybrid_scores(query: Result, documents: Result) -> np.ndarray:
    """Each document's hybrid score against the query, as FlagEmbedding's BGE-M3
    `compute_score` gives "colbert+sparse+dense" with its default weights: the mean of the
    dense vectors' dot product, the sparse weights' dot product (over the token ids both
    hold) and MaxSim divided by the query's vectors."""
    (dense,), (sparse,), (vectors,) = (query.rows_of(output) for output in ("dense", "sparse", "multivector"))
    dense_scores = np.stack(documents.rows_of("dense")) @ dense
    sparse_scores = np.array([sparse_dot(sparse, entries) for entries in documents.rows_of("sparse")],
                             dtype=np.float32)
    return (dense_scores + sparse_scores + maxsim_scores("meanmaxsim", vectors, documents.rows_of("multivector"))) / 3


def sparse_dot(first: np.ndarray, second: np.ndarray) -> float:
    """The dot product of two sparse vectors (`index`, `value` records, by index)."""
    _, in_first, in_second = np.intersect1d(first["index"], second["index"], assume_unique=True, return_indices=True)
    return float(first["value"][in_first] @ second["value"][in_second])


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Sum over the query's rows of the best dot product with any of the document's rows
    (0 for a document without rows)."""
    if not len(document):
        return 0.0
    return float((query @ document.T).max(axis=1).sum())


async def classify(request: web.Request, body: ClassifyRequest) -> ClassifyResponse | VllmClassifyResponse:
    """Every label's score for each input: infinity's answer (labels best first), or
    vLLM's (probabilities in label order) where the body is vLLM's (`vllm_shaped`)."""
    return await classes(request, body, body.vllm_shaped)


async def classes(request: web.Request, body: ClassifyRequest, vllm_shaped: bool
                  ) -> ClassifyResponse | VllmClassifyResponse:
    """`classify`'s answer, in vLLM's shape or infinity's as `vllm_shaped` says."""
    model = served_model(request, body.model, CLASSIFY_KINDS)
    inputs = keeping_last(text_or_token_inputs(body.input, max_items(request)),
                          kept_tokens(body.truncate_prompt_tokens, model.spec), "truncate_prompt_tokens", model.spec)
    inputs = without_special_tokens(inputs, body.add_special_tokens, model.spec)
    result = await request.app[ENGINE_CLIENT].run(model, inputs)
    try:
        logits = result.stacked()
    finally:
        result.release()
    scores = logits if body.raw_scores or body.use_activation is False else activate(logits, result.activation)
    labels, created = result.labels, int(time.time())
    if vllm_shaped:
        data = [VllmClassData(index=i, label=labels[int(np.argmax(row))], probs=row.astype(float).tolist(),
                              num_classes=len(labels)) for i, row in enumerate(scores)]
        return VllmClassifyResponse(id=f"classify-{uuid.uuid4().hex}", created=created, model=model.spec.name,
                                    data=data, usage=Usage.of(result))
    data = [[LabelScore(labels[j], float(row[j])) for j in np.argsort(-row, kind="stable")] for row in scores]
    return ClassifyResponse(id=uuid.uuid4().hex, created=created, data=data, model=model.spec.name,
                            usage=Usage.of(result))


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
    Route(openapi.Operation("post", "/v1/rerank", ("/v2/rerank",),
                            "Score documents against a query, best first (Cohere v1 and v2, Jina)",
                            RerankRequest, RerankResponse, MODEL_ERRORS, RERANK_KINDS), rerank),
    Route(openapi.Operation("post", "/v1/classify", ("/classify",), "Every label's score for each input "
                            "(infinity; vLLM's answer where the body holds vLLM's fields)", ClassifyRequest,
                            (ClassifyResponse, VllmClassifyResponse), MODEL_ERRORS, CLASSIFY_KINDS), classify),
]
