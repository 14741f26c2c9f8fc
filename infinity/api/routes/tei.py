"""TEI's (text-embeddings-inference) native routes: `/embed`, `/embed_all`, `/rerank`,
`/predict`, `/similarity`, `/decode`, `/info` and `POST /`, as TEI documents them. Each decodes TEI's
body into the request our own routes serve and encodes their answer in TEI's shape; errors
on TEI's bodies are in TEI's shape (`infinity.api.errors.tei_error_body`).

TEI serves one model and its bodies name none: a TEI request goes to the only served model
of the kind it needs, else to the one of them marked `default = true` in models.toml, else
it is a 422 naming the models that could answer.

`/embed` and `/rerank` are Cohere's paths too; the body decides (`embed_body_of`,
`rerank_body_of`)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import APIError, ErrorResponse, TEIErrorResponse
from infinity.api.inputs import keeping_last, text_or_token_inputs
from infinity.api.metrics import MODEL
from infinity.api.prompts import with_prompt
from infinity.api.routes import embeddings, scores, tokens
from infinity.api.routes.common import CONFIG, ENGINE_CLIENT, MODEL_ERRORS, Route, body_members, max_items
from infinity.api.types.embeddings import CohereEmbedRequest, CohereEmbedResponse
from infinity.api.types.scores import RerankRequest, RerankResponse
from infinity.api.types.tei import (DecodeResponse, SimilarityResponse, TEIDecodeRequest, TEIEmbedAllRequest,
                                    TEIEmbedAllResponse, TEIEmbedRequest, TEIEmbedResponse, TEIInfo, TEIPrediction,
                                    TEIPredictionBatch, TEIPredictions, TEIPredictRequest, TEIRerankRequest,
                                    TEIRerankResponse, TEIRerankResult, TEISimilarityRequest)
from infinity.api.types.tokens import DetokenizeRequest
from infinity.client.engine_client import ModelInputs
from infinity.client.topology import ServedModel
from infinity.shared.protocol import TOKEN_STATES, ModelSpec


def tei_model(request: web.Request, kinds: tuple[str, ...]) -> ServedModel:
    """The model a TEI body (which names none) goes to: the only served one of `kinds`, else
    the one of them marked `default` in models.toml."""
    models = [m for m in request.app[ENGINE_CLIENT].models.values() if m.spec.kind in kinds]
    if len(models) != 1:
        marked = {entry.name for entry in request.app[CONFIG].models if entry.default}
        defaults = [m for m in models if m.spec.name in marked]
        if len(defaults) != 1:
            names = ", ".join(m.spec.name for m in models) or "none"
            raise APIError(422, f"TEI's bodies name no model and this server serves {len(models)} of kind "
                                f"{' or '.join(kinds)} ({names}): mark one `default = true` in models.toml, or "
                                "use a route whose body names its model")
        models = defaults
    request[MODEL] = models[0].spec.name
    return models[0]


# Models whose encoder's token states are what they pool: text embedders, not two-tower
# models (whose text tower answers its features) nor the others.
EMBED_ALL_KINDS = ("embed",)


def _cut(truncate: bool | None, inputs: ModelInputs, direction: str, spec: ModelSpec) -> ModelInputs:
    """`inputs` as TEI's `truncate` asks: true cuts a long input to the model's length
    (whatever the model's `long_inputs`), false refuses it naming the field, none leaves it
    to the model's setting; where they are cut, `truncation_direction` Left cuts their
    start (each keeps its last tokens)."""
    left = direction.lower() == "left"
    if truncate is None and left and spec.long_inputs == "truncate":
        truncate = True
    if truncate is None:
        return inputs
    cut = msgspec.structs.replace(inputs, long_inputs="truncate", refuse_cut=None if truncate else "truncate")
    return keeping_last(cut, spec.max_length, "truncation_direction", spec) if truncate and left else cut


async def tei_embed(request: web.Request, body: TEIEmbedRequest) -> TEIEmbedResponse:
    """TEI's `/embed`: a vector per input, L2-normalised unless `normalize` is false (then
    the vector before the model's final Normalize, or as it is where it ends with none)."""
    model = tei_model(request, embeddings.COHERE_KINDS)
    inputs = with_prompt(model, text_or_token_inputs(body.inputs, max_items(request), "inputs"), None,
                         body.prompt_name, None)
    _, rows = await embeddings.embedder(request).vectors(model, _cut(body.truncate, inputs, body.truncation_direction,
                                                                     model.spec), body.dimensions,
                                                         "dimensions", None if body.normalize else "normalize")
    if body.normalize and not model.spec.normalize:
        rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return TEIEmbedResponse(rows.tolist())


async def embed_all(request: web.Request, body: TEIEmbedAllRequest) -> TEIEmbedAllResponse:
    """TEI's `/embed_all`: each input's token states, the encoder's last hidden state of
    every token it reads (special and prompt tokens too), before pooling. A long input is
    cut to the model's length (never chunked: its tokens would not be one reading), unless
    `truncate` is false."""
    model = tei_model(request, EMBED_ALL_KINDS)
    inputs = with_prompt(model, text_or_token_inputs(body.inputs, max_items(request), "inputs"), None,
                         body.prompt_name, None)
    cut = _cut(body.truncate if body.truncate is not None else True, inputs, body.truncation_direction, model.spec)
    result = await request.app[ENGINE_CLIENT].run(model, msgspec.structs.replace(cut, vector_types=(TOKEN_STATES,)))
    try:
        return TEIEmbedAllResponse([np.asarray(rows, dtype=np.float32).tolist() for rows in result.rows()])
    finally:
        result.release()


def embed_body_of(_: web.Request, body: bytes) -> type[msgspec.Struct]:
    """`/embed`'s dialect: Cohere's where the body holds any of its own keys (`texts`,
    `images`, `embedding_types`, `input_type`) or `inputs` of objects (v2's content parts);
    TEI's otherwise (`inputs` as a text, texts or token ids)."""
    members = body_members(body)
    if members is None or {"texts", "images", "embedding_types", "input_type"} & members.keys():
        return CohereEmbedRequest
    inputs = members.get("inputs")
    if inputs is not None and bytes(inputs).lstrip(b"[ \t\r\n").startswith(b"{"):
        return CohereEmbedRequest
    return TEIEmbedRequest


def rerank_body_of(_: web.Request, body: bytes) -> type[msgspec.Struct]:
    """`/rerank`'s dialect: TEI's where the body holds `texts` and no `documents`;
    Cohere's and Jina's otherwise."""
    members = body_members(body)
    return TEIRerankRequest if members is not None and "texts" in members and "documents" not in members \
        else RerankRequest


async def embed(request: web.Request, body: TEIEmbedRequest | CohereEmbedRequest
                ) -> TEIEmbedResponse | CohereEmbedResponse:
    """`/embed`: TEI's or Cohere's, as `embed_body_of` told the body."""
    if isinstance(body, TEIEmbedRequest):
        return await tei_embed(request, body)
    return await embeddings.cohere_embed(request, body)


async def tei_rerank(request: web.Request, body: TEIRerankRequest) -> TEIRerankResponse:
    """TEI's rerank: every text with its score, best first; `truncate` true cuts a text too
    long to fit beside the query, false refuses it (none: as the model is set)."""
    if body.truncation_direction.lower() == "left":
        raise APIError(422, "truncation_direction Left is not served on /rerank: a pair longer than the model is cut "
                            "at the end of its text", param="truncation_direction")
    model = tei_model(request, scores.RERANK_KINDS)
    ranked = await scores.rerank(request, RerankRequest(
        query=body.query, documents=body.texts, model=model.spec.name, raw_scores=body.raw_scores,
        max_chunks_per_doc=None if body.truncate is None else 1), "truncate" if body.truncate is False else None)
    return TEIRerankResponse([TEIRerankResult(index=r.index, score=r.relevance_score,
                                              **({"text": body.texts[r.index]} if body.return_text else {}))
                              for r in ranked.results])


async def rerank(request: web.Request, body: TEIRerankRequest | RerankRequest
                 ) -> TEIRerankResponse | RerankResponse:
    """`/rerank`: TEI's or Cohere's/Jina's, as `rerank_body_of` told the body."""
    if isinstance(body, TEIRerankRequest):
        return await tei_rerank(request, body)
    return await scores.rerank(request, body)


def _predict_inputs(inputs: object) -> tuple[list[str | tuple[str, str]], bool]:
    """(the sequences to classify, each a text or a pair of texts, and whether TEI's
    `inputs` was a batch): a text; a pair (a list of two texts, as TEI reads one); or a
    batch, a list of texts or of one- and two-text lists."""
    if isinstance(inputs, str):
        return [inputs], False
    if isinstance(inputs, list) and len(inputs) == 2 and all(isinstance(item, str) for item in inputs):
        return [(inputs[0], inputs[1])], False
    if isinstance(inputs, list) and inputs:
        sequences = [item if isinstance(item, str) else item[0] if isinstance(item, list) and len(item) == 1
                     else (item[0], item[1]) if isinstance(item, list) and len(item) == 2 else None for item in inputs]
        if all(isinstance(sequence, str) or (isinstance(sequence, tuple) and all(isinstance(t, str) for t in sequence))
               for sequence in sequences):
            return sequences, True  # type: ignore[return-value]
    raise APIError(422, "inputs must be a text, a pair of texts, or a non-empty list of texts or of one- or two-text "
                        "lists", param="inputs")


async def predict(request: web.Request, body: TEIPredictRequest) -> TEIPredictions | TEIPredictionBatch:
    """TEI's `/predict`: every label's score, best first, of a text or of a pair of texts
    (read as the model reads pairs: the second cut first, each in its own segment); for a
    batch, a list per sequence. Pairs of one first text go to the model as one request."""
    model = tei_model(request, scores.CLASSIFY_KINDS)
    if body.parameters:
        raise APIError(422, f"parameters {', '.join(sorted(body.parameters))} (the HF inference form's) are not "
                            "served: use raw_scores for logits; every label is answered", param="parameters")
    sequences, batch = _predict_inputs(body.inputs)
    if len(sequences) > max_items(request):
        raise APIError(413, f"{len(sequences)} inputs; at most {max_items(request)} in one request", param="inputs")
    groups: dict[str | None, list[int]] = {}  # by the first text of a pair; None: single texts
    for i, sequence in enumerate(sequences):
        groups.setdefault(sequence[0] if isinstance(sequence, tuple) else None, []).append(i)
    if body.truncation_direction.lower() == "left" and set(groups) != {None}:
        raise APIError(422, "truncation_direction Left is not served for pairs: a pair longer than the model is cut at "
                            "the end of its second text", param="truncation_direction")

    async def classified(first: str | None, indices: list[int]) -> list[np.ndarray]:
        if first is None:
            inputs = _cut(body.truncate, text_or_token_inputs([sequences[i] for i in indices], max_items(request),
                                                              "inputs"), body.truncation_direction, model.spec)
        else:  # cut, unless truncate is false: a pair's chunks could not be combined
            inputs = _cut(body.truncate is not False, ModelInputs(texts=[sequences[i][1] for i in indices], query=first),
                          "Right", model.spec)
        result = await request.app[ENGINE_CLIENT].run(model, inputs)
        try:
            logits = result.stacked()
        finally:
            result.release()
        return list(logits if body.raw_scores else scores.activate(logits, result.activation))

    rows: list[np.ndarray] = [np.empty(0)] * len(sequences)
    answers = await asyncio.gather(*(classified(first, indices) for first, indices in groups.items()))
    for indices, values in zip(groups.values(), answers):
        for i, row in zip(indices, values):
            rows[i] = row
    labels = model.info.labels if model.info else []
    predictions = [[TEIPrediction(score=float(row[j]), label=labels[j]) for j in np.argsort(-row, kind="stable")]
                   for row in rows]
    return TEIPredictionBatch(predictions) if batch else TEIPredictions(predictions[0])


async def similarity(request: web.Request, body: TEISimilarityRequest) -> SimilarityResponse:
    """TEI's `/similarity`: the cosine of the source sentence's vector with each sentence's."""
    model = tei_model(request, embeddings.COHERE_KINDS)
    parameters = body.parameters
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    inputs = with_prompt(model, text_or_token_inputs(texts, max_items(request) + 1, "inputs"), None,
                         parameters.prompt_name if parameters else None, None)
    _, rows = await embeddings.embedder(request).vectors(
        model, _cut(parameters.truncate if parameters else None, inputs,
                    parameters.truncation_direction if parameters else "Right", model.spec), None, "dimensions")
    rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return SimilarityResponse((rows[1:] @ rows[0]).astype(float).tolist())


async def decode(request: web.Request, body: TEIDecodeRequest) -> DecodeResponse:
    """TEI's `/decode`: each sequence of ids as text, by the tokenizer of the model `/info`
    describes (`root_model`)."""
    model = root_model(request)
    texts = await tokens.detokenize(request, DetokenizeRequest(model=model.spec.name, ids=body.ids,
                                                               skip_special_tokens=body.skip_special_tokens))
    return DecodeResponse(texts)


def root_model(request: web.Request) -> ServedModel:
    """The model `POST /`, `/info` and `/decode` speak for, as TEI's one model: the first in
    models.toml (the only one, where one is served)."""
    return next(iter(request.app[ENGINE_CLIENT].models.values()))


_TEI_TYPES = {"rerank": "reranker", "classify": "classifier"}


async def info(request: web.Request, _: None) -> TEIInfo:
    """TEI's `/info`, of the model `POST /` serves (`root_model`)."""
    from infinity.api.app import package_version  # the app imports the routes

    model = root_model(request)
    spec, server = model.spec, request.app[CONFIG].server
    labels = model.info.labels if model.info else []
    kind = _TEI_TYPES.get(spec.kind, "embedding")
    details = ({"pooling": spec.pooling} if kind == "embedding" else
               {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)}})
    return TEIInfo(model_id=spec.name, model_dtype=spec.dtype, model_type={kind: details}, served_model_name=spec.name,
                   max_concurrent_requests=server.max_queued_items, max_input_length=spec.max_length,
                   max_batch_tokens=spec.max_batch_tokens, max_batch_requests=spec.max_batch_size,
                   max_client_batch_size=max_items(request), auto_truncate=spec.long_inputs == "truncate",
                   tokenization_workers=server.tokenizer_workers, version=package_version())


def root_body_of(request: web.Request, body: bytes) -> type[msgspec.Struct]:
    """`POST /`'s body, by its keys: `texts` is TEI's rerank, `inputs` holding an object
    `{source_sentence, sentences}` its similarity; other `inputs` are classified where the
    model `POST /` serves (`root_model`) is a classifier, else embedded."""
    members = body_members(body) or {}
    if "texts" in members:
        return TEIRerankRequest
    if bytes(members.get("inputs", b"")).lstrip().startswith(b"{"):
        return TEISimilarityRequest
    return TEIPredictRequest if root_model(request).spec.kind in scores.CLASSIFY_KINDS else TEIEmbedRequest


async def root(request: web.Request,
               body: TEIEmbedRequest | TEIRerankRequest | TEISimilarityRequest | TEIPredictRequest
               ) -> TEIEmbedResponse | TEIRerankResponse | TEIPredictions | TEIPredictionBatch | SimilarityResponse:
    """Hugging Face's inference form (`POST /`): the TEI route `root_body_of` chose."""
    if isinstance(body, TEIRerankRequest):
        return await tei_rerank(request, body)
    if isinstance(body, TEISimilarityRequest):
        return await similarity(request, body)
    if isinstance(body, TEIPredictRequest):
        return await predict(request, body)
    return await tei_embed(request, body)


_TEI_ERRORS = TEIErrorResponse
_EITHER_ERRORS = (ErrorResponse, TEIErrorResponse)

# An operation's kinds are those its bodies' `model` may name: TEI's name none, so only the
# paths TEI shares with Cohere declare the kinds of Cohere's body there.

ROUTES = [
    Route(openapi.Operation("post", "/embed", (), "Embed texts: TEI's body (`inputs` of texts or token ids; a bare "
                            "list of vectors) or Cohere v1's (`texts`, `model`, ...)", (TEIEmbedRequest,
                            CohereEmbedRequest), (TEIEmbedResponse, CohereEmbedResponse), MODEL_ERRORS,
                            embeddings.COHERE_KINDS, error_answer=_EITHER_ERRORS), embed, embed_body_of),
    Route(openapi.Operation("post", "/embed_all", (), "Each input's token states, a vector per token (TEI)",
                            TEIEmbedAllRequest, TEIEmbedAllResponse, MODEL_ERRORS, error_answer=_TEI_ERRORS),
          embed_all),
    Route(openapi.Operation("post", "/rerank", (), "Score texts against a query: TEI's body (`texts`; a bare list, "
                            "best first) or Cohere's and Jina's (`documents`)", (TEIRerankRequest, RerankRequest),
                            (TEIRerankResponse, RerankResponse), MODEL_ERRORS, scores.RERANK_KINDS,
                            error_answer=_EITHER_ERRORS),
          rerank, rerank_body_of),
    Route(openapi.Operation("post", "/predict", (), "Every label's score, best first, for a text or a batch (TEI)",
                            TEIPredictRequest, (TEIPredictions, TEIPredictionBatch), MODEL_ERRORS,
                            error_answer=_TEI_ERRORS), predict),
    Route(openapi.Operation("post", "/similarity", (), "The cosine of a sentence with each of others (TEI)",
                            TEISimilarityRequest, SimilarityResponse, MODEL_ERRORS, error_answer=_TEI_ERRORS),
          similarity),
    Route(openapi.Operation("post", "/decode", (), "Token ids back to texts (TEI)", TEIDecodeRequest, DecodeResponse,
                            MODEL_ERRORS, error_answer=_TEI_ERRORS), decode),
    Route(openapi.Operation("get", "/info", (), "The served model as TEI describes it (the one POST / serves)", None,
                            TEIInfo, ()), info),
    Route(openapi.Operation("post", "/", (), "Hugging Face's inference form (TEI): rerank (`texts`), similarity "
                            "(`inputs.source_sentence`), else embed or classify as the model's kind",
                            (TEIEmbedRequest, TEIRerankRequest, TEISimilarityRequest, TEIPredictRequest),
                            (TEIEmbedResponse, TEIRerankResponse, TEIPredictions, TEIPredictionBatch,
                             SimilarityResponse), MODEL_ERRORS, error_answer=_TEI_ERRORS), root, root_body_of),
]
