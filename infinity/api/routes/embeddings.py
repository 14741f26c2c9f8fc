"""Embedding routes: OpenAI's `/v1/embeddings` (float, base64, quantised types,
`dimensions`; a multi-vector model's matrices; a sparse model's indices and values) and
Cohere's v1/v2 embed, encoded straight from the shared-memory arena; TEI's
`/embed_sparse` for sparse (SPLADE) models."""

from __future__ import annotations

import uuid

import msgspec
from msgspec import UNSET
import numpy as np
from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import APIError
from infinity.api.inputs import output_types, text_inputs, text_or_token_inputs
from infinity.api.media_fetch import media_bytes
from infinity.api.routes.common import (CONFIG, ENGINE_CLIENT, FETCHER, MODEL_ERRORS, Route, kinds_serving, max_items,
                                        served_model, usage)
from infinity.api.types.common import ApiVersion, BilledUnits, CohereMeta, ImagePart, InputTokens, TextPart
from infinity.api.types.embeddings import (AudioUrlPart, CohereEmbedRequest, CohereEmbedResponse, CohereImage,
                                           EmbeddingData, EmbeddingRequest, EmbeddingResponse, SparseEmbedRequest,
                                           SparseEmbedResponse, SparseEmbedding, SparseValue)
from infinity.client.engine_client import ModelInputs, Result
from infinity.client.topology import ServedModel
from infinity.shared.vectors import EmbeddingType, encode, encode_matrix, largest, shorten

# the model kinds each route serves
OPENAI_KINDS = kinds_serving("embed", "sparse")
COHERE_KINDS = kinds_serving("embed", vector_per_input=True)
IMAGE_KINDS = kinds_serving("image_embed")
AUDIO_KINDS = kinds_serving("audio_embed")
SPARSE_KINDS = kinds_serving("sparse")


async def embeddings(request: web.Request, body: EmbeddingRequest,
                     kinds: tuple[str, ...] = OPENAI_KINDS) -> EmbeddingResponse:
    """OpenAI embeddings; with `embedding_types`, each item holds `embeddings` by type
    instead of `embedding`. `kinds`: those of the route asked (a media route serves fewer)."""
    model = served_model(request, body.model, kinds)
    body = _with_input(body)
    if body.modality == "text":
        inputs = text_or_token_inputs(body.input, max_items(request))
    elif body.modality == model.kind.medium:
        inputs = ModelInputs(media=await media_bytes(request.app[FETCHER], body.input,
                                                     request.app[CONFIG].media.max_bytes(body.modality),
                                                     max_items(request)))
    else:
        # Not read as text: a data: URI or URL embedded as words would be a wrong vector.
        raise APIError(422, f"model '{model.spec.name}' does not embed {body.modality} inputs (it is of kind "
                            f"'{model.spec.kind}')", param="modality")
    if model.kind.sparse:
        return await _sparse(request, model, inputs, body)
    if body.top_k is not None:
        raise APIError(422, f"top_k applies to sparse models; '{model.spec.name}' is of kind '{model.spec.kind}'",
                       param="top_k")
    types = body.output_types(request.app[CONFIG].server.embedding_type)
    if model.kind.late_interaction:
        return await _multivector(request, model, inputs, body, types)
    # 0 asks for every dimension, as in infinity (its generated client sends 0 by default).
    result, rows = await _embed(request, model, inputs, body.dimensions or None, "dimensions")
    encoded = {t: encode(rows, t, body.encoding_format == "base64") for t in types}
    if body.embedding_types is None:
        data = [EmbeddingData(index=i, embedding=value) for i, value in enumerate(encoded[types[0]])]
    else:
        data = [EmbeddingData(index=i, embeddings={t: encoded[t][i] for t in types}) for i in range(len(rows))]
    return EmbeddingResponse(data=data, model=model.spec.name, usage=usage(result))


def _cohere_inputs(body: CohereEmbedRequest) -> tuple[list[str] | None, list[str] | None]:
    """(texts, images) of a Cohere body: `texts`, `images`, or v2's `inputs` (one part
    each, all texts or all images)."""
    given = [name for name in ("texts", "images", "inputs") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(422, "give one of texts, images or inputs", param="texts")
    if body.inputs is None:
        return body.texts, body.images
    if any(len(item.content) != 1 for item in body.inputs):
        raise APIError(422, "each of inputs must hold one text or one image_url part here (a two-tower model "
                            "embeds a text and an image apart, not together)", param="inputs")
    parts = [item.content[0] for item in body.inputs]
    if all(isinstance(part, TextPart) for part in parts):
        return [part.text for part in parts], None  # type: ignore[union-attr]
    if all(isinstance(part, ImagePart) for part in parts):
        return None, [part.image_url.url for part in parts]  # type: ignore[union-attr]
    raise APIError(422, "inputs mix texts and images; send them in separate requests", param="inputs")


def _with_input(body: EmbeddingRequest) -> EmbeddingRequest:
    """The request with its one input in `input`: vLLM's `messages` (one message of one
    text, or of one image or audio part) turned into `input` and `modality`."""
    if body.messages is None:
        if body.input is None:
            raise APIError(422, "input is required (or vLLM's messages)", param="input")
        return body
    if body.input is not None:
        raise APIError(422, "give input or messages, not both", param="messages")
    parts = [part for message in body.messages
             for part in ([TextPart(message.content)] if isinstance(message.content, str) else message.content)]
    if len(parts) != 1:
        raise APIError(422, f"messages must hold one text, image or audio clip: an embedding here is of one input (a "
                            f"two-tower model embeds a text and a medium apart, not together); these hold {len(parts)} "
                            "parts", param="messages")
    (part,) = parts
    if isinstance(part, TextPart):
        return msgspec.structs.replace(body, input=[part.text], modality="text", messages=None)
    if isinstance(part, ImagePart):
        return msgspec.structs.replace(body, input=[part.image_url.url], modality="image", messages=None)
    url = part.audio_url.url if isinstance(part, AudioUrlPart) else part.uri
    return msgspec.structs.replace(body, input=[url], modality="audio", messages=None)


async def embeddings_image(request: web.Request, body: EmbeddingRequest) -> EmbeddingResponse:
    """infinity's image route: OpenAI embeddings of images (data: URIs or URLs)."""
    return await embeddings(request, msgspec.structs.replace(body, modality="image"), IMAGE_KINDS)


async def embeddings_audio(request: web.Request, body: EmbeddingRequest) -> EmbeddingResponse:
    """infinity's audio route: OpenAI embeddings of audio clips (data: URIs or URLs)."""
    return await embeddings(request, msgspec.structs.replace(body, modality="audio"), AUDIO_KINDS)


async def cohere_embed(request: web.Request, body: CohereEmbedRequest) -> CohereEmbedResponse:
    """Cohere v1/v2 embed. v1 without `embedding_types` (and a float server default)
    answers `embeddings_floats`; otherwise `embeddings_by_type`, where Cohere's `base64`
    type is the base64 of the float32 values."""
    default = request.app[CONFIG].server.embedding_type
    types = output_types(body.embedding_types, default)
    model = served_model(request, body.model, COHERE_KINDS)
    texts, images = _cohere_inputs(body)
    if images is None:
        inputs = text_inputs(texts, max_items(request), "texts")
    elif model.kind.medium == "image":
        inputs = ModelInputs(media=await media_bytes(request.app[FETCHER], images,
                                                     request.app[CONFIG].media.max_image_bytes, max_items(request)))
    else:
        raise APIError(422, f"model '{model.spec.name}' does not embed images (it is of kind '{model.spec.kind}')",
                       param="images")
    result, rows = await _embed(request, model, inputs, body.output_dimension, "output_dimension")
    version = "2" if request.path.endswith("/v2/embed") else "1"
    by_type = version == "2" or body.embedding_types is not None or default != "float"
    embeddings = ({t: encode(rows, "float", True) if t == "base64" else encode(rows, t) for t in types}
                  if by_type else encode(rows, "float"))
    tokens = result.prompt_tokens
    described = (UNSET if result.info is None
                 else [CohereImage(*msgspec.structs.astuple(info)) for info in result.info])
    return CohereEmbedResponse(
        id=uuid.uuid4().hex, embeddings=embeddings, texts=texts or [], images=described,  # type: ignore[arg-type]
        meta=CohereMeta(ApiVersion(version), BilledUnits(input_tokens=tokens), InputTokens(tokens)),
        response_type="embeddings_by_type" if by_type else "embeddings_floats")


async def _multivector(request: web.Request, model: ServedModel, inputs: ModelInputs, body: EmbeddingRequest,
                       types: list[EmbeddingType]) -> EmbeddingResponse:
    """A multi-vector model's embeddings: each item a matrix (a row per token, padding
    removed) and its `shape`."""
    if body.dimensions:
        raise APIError(422, f"dimensions does not apply to the multi-vector model '{model.spec.name}' (it would "
                            "cut every token's vector); leave it out", param="dimensions")
    result = await request.app[ENGINE_CLIENT].run(model, msgspec.structs.replace(inputs, task=body.task))
    try:
        matrices = list(result.rows())
    finally:
        result.release()
    as_base64 = body.encoding_format == "base64"
    data = []
    for i, matrix in enumerate(matrices):
        encoded = {t: encode_matrix(matrix, t, as_base64) for t in types}
        data.append(EmbeddingData(index=i, shape=list(matrix.shape),
                                  **({"embedding": encoded[types[0]]} if body.embedding_types is None
                                     else {"embeddings": encoded})))
    return EmbeddingResponse(data=data, model=model.spec.name, usage=usage(result))


async def _sparse(request: web.Request, model: ServedModel, inputs: ModelInputs,
                  body: EmbeddingRequest) -> EmbeddingResponse:
    """A sparse model's embeddings: each item its nonzero values and their indices, by
    index, in float only (`indices` are vocabulary entries: nothing to cut or quantise)."""
    name = model.spec.name
    if body.dimensions:
        raise APIError(422, f"dimensions does not apply to the sparse model '{name}' (its dimensions are vocabulary "
                            "entries); use top_k to keep its largest values", param="dimensions")
    if body.encoding_format == "base64":
        raise APIError(422, f"the sparse model '{name}' answers its indices and values as JSON numbers, not base64: "
                            "send encoding_format \"float\" (the openai client sends base64 unless told)",
                       param="encoding_format")
    # The server's default type is for dense vectors; a sparse model's values are floats.
    types = body.output_types("float")
    if types != ["float"]:
        raise APIError(422, f"the sparse model '{name}' answers float values only, not "
                            f"{', '.join(t for t in types if t != 'float')}",
                       param="embedding_types" if body.embedding_types is not None else "embedding_type")
    result, vectors = await _sparse_vectors(request, model, inputs, body.top_k)
    data = []
    for i, entries in enumerate(vectors):
        vector = SparseEmbedding(indices=entries["index"].tolist(), values=entries["value"].tolist())
        data.append(EmbeddingData(index=i, **({"embedding": vector} if body.embedding_types is None
                                              else {"embeddings": {"float": vector}})))
    return EmbeddingResponse(data=data, model=name, usage=usage(result))


async def embed_sparse(request: web.Request, body: SparseEmbedRequest) -> SparseEmbedResponse:
    """TEI's sparse embeddings: per input, its nonzero values as `{index, value}`, by index."""
    model = served_model(request, body.model, SPARSE_KINDS)
    if body.prompt_name is not None:
        raise APIError(422, f"model '{model.spec.name}' has no prompts; leave prompt_name out", param="prompt_name")
    inputs = text_or_token_inputs(body.inputs, max_items(request), "inputs")
    result, vectors = await _sparse_vectors(request, model, inputs, body.top_k)
    if body.truncate is False and result.truncated:
        raise APIError(422, f"{result.truncated} of the inputs are longer than the {model.spec.max_length} tokens of "
                            f"model '{model.spec.name}', and truncate is false", param="truncate")
    return SparseEmbedResponse([[SparseValue(index, value) for index, value in entries.tolist()]
                                for entries in vectors])


async def _sparse_vectors(request: web.Request, model: ServedModel, inputs: ModelInputs,
                          top_k: int | None) -> tuple[Result, list[np.ndarray]]:
    """Run `inputs` through a sparse model; return the (released) result and each input's
    nonzero entries (records of `index` and `value`, by index), its largest `top_k` only
    and never more than the model's own max_active_dims."""
    result = await request.app[ENGINE_CLIENT].run(model, inputs)
    try:
        vectors = list(result.rows())
    finally:
        result.release()
    limits = [k for k in (top_k, model.spec.max_active_dims) if k is not None]
    if limits:
        vectors = [largest(entries, min(limits)) for entries in vectors]
    return result, vectors


async def _embed(request: web.Request, model: ServedModel, inputs: ModelInputs, dimensions: int | None,
                 dimensions_param: str) -> tuple[Result, np.ndarray]:
    """Run `inputs` through an embedder; return the (released) result and its vectors as
    one (n, dim) float32 array, truncated to `dimensions` and re-normalised."""
    dim = model.info.dim if model.info else None
    if dimensions is not None and dim is not None and not 0 < dimensions <= dim:
        raise APIError(422, f"{dimensions_param} must be between 1 and {dim} for model '{model.spec.name}'",
                       param=dimensions_param)
    result = await request.app[ENGINE_CLIENT].run(model, inputs)
    try:
        rows = np.stack(list(result.rows()))
    finally:
        result.release()
    return result, shorten(rows, dimensions)


ROUTES = [
    Route(openapi.Operation("post", "/v1/embeddings", ("/embeddings",), "Embed texts or token ids (OpenAI)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, OPENAI_KINDS), embeddings),
    Route(openapi.Operation("post", "/embeddings_image", (), "Embed images given as data: URIs or URLs (infinity)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, IMAGE_KINDS, media=True),
          embeddings_image),
    Route(openapi.Operation("post", "/embeddings_audio", (), "Embed audio clips given as data: URIs or URLs (infinity)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, AUDIO_KINDS, media=True),
          embeddings_audio),
    Route(openapi.Operation("post", "/v1/embed", ("/embed", "/v2/embed"), "Embed texts (Cohere v1 and v2)",
                            CohereEmbedRequest, CohereEmbedResponse, MODEL_ERRORS, COHERE_KINDS), cohere_embed),
    Route(openapi.Operation("post", "/v1/embed_sparse", ("/embed_sparse",),
                            "A sparse model's nonzero values per input, by index (TEI)", SparseEmbedRequest,
                            SparseEmbedResponse, MODEL_ERRORS, SPARSE_KINDS), embed_sparse),
]
