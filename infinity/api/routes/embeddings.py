"""Embedding routes: OpenAI's `/v1/embeddings` (answered by `infinity.api.embedding`, as
batch files' bodies are) and infinity's image and audio forms of it, Cohere's v1/v2 embed,
TEI's `/embed_sparse` for sparse (SPLADE) models. `/embed`, which Cohere and TEI share,
is in `infinity.api.routes.tei`."""

from __future__ import annotations

import uuid

import msgspec
from msgspec import UNSET
from aiohttp import web

from infinity.api import binary, openapi
from infinity.api.embedding import Embedder
from infinity.api.errors import APIError
from infinity.api.inputs import output_types, text_inputs, text_or_token_inputs
from infinity.api.late_chunking import refuse_on_cohere
from infinity.api.long_inputs import long_inputs_of_cohere, with_long_inputs
from infinity.api.media_fetch import media_bytes
from infinity.api.prompts import with_prompt
from infinity.api.routes.common import (CONFIG, ENGINE_CLIENT, FETCHER, MODEL_ERRORS, RawAnswer, Route, kinds_serving,
                                        max_items, served_model)
from infinity.api.types.common import ApiVersion, BilledUnits, CohereMeta, ImagePart, InputTokens, TextPart
from infinity.api.types.embeddings import (CohereEmbedRequest, CohereEmbedResponse, CohereImage, EmbeddingRequest,
                                           EmbeddingResponse, SparseEmbedRequest, SparseEmbedResponse, SparseValue)
from infinity.client.engine_client import ModelInputs
from infinity.shared.vectors import encode

# the model kinds each route serves
OPENAI_KINDS = kinds_serving("embed", "sparse")
COHERE_KINDS = kinds_serving("embed", vector_per_input=True)
IMAGE_KINDS = kinds_serving("image_embed")
AUDIO_KINDS = kinds_serving("audio_embed")
SPARSE_KINDS = kinds_serving("sparse")


def embedder(request: web.Request) -> Embedder:
    """What answers embeddings bodies on this request's server."""
    app = request.app
    return Embedder(app[ENGINE_CLIENT], app[FETCHER], app[CONFIG], max_items(request))


async def embeddings(request: web.Request, body: EmbeddingRequest,
                     kinds: tuple[str, ...] = OPENAI_KINDS) -> EmbeddingResponse | RawAnswer:
    """OpenAI embeddings, or their raw bytes where the body or the Accept header asks for
    them. `kinds`: those of the route asked (a media route serves fewer)."""
    model = served_model(request, body.model, kinds)
    if body.encoding_format in ("bytes", "bytes_only") or _accepts_bytes_only(request.headers.get("Accept", "")):
        answer, headers = await embedder(request).embeddings_bytes(model, body)
        return RawAnswer(answer, binary.CONTENT_TYPE, headers)
    return await embedder(request).embeddings(model, body)


def _accepts_bytes_only(accept: str) -> bool:
    """Whether an Accept header asks for raw bytes and not for JSON."""
    types = {part.split(";")[0].strip() for part in accept.split(",")}
    return binary.CONTENT_TYPE in types and not types & {"application/json", "*/*", "application/*"}


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


async def embeddings_image(request: web.Request, body: EmbeddingRequest) -> EmbeddingResponse | RawAnswer:
    """infinity's image route: OpenAI embeddings of images (data: URIs or URLs)."""
    return await embeddings(request, msgspec.structs.replace(body, modality="image"), IMAGE_KINDS)


async def embeddings_audio(request: web.Request, body: EmbeddingRequest) -> EmbeddingResponse | RawAnswer:
    """infinity's audio route: OpenAI embeddings of audio clips (data: URIs or URLs)."""
    return await embeddings(request, msgspec.structs.replace(body, modality="audio"), AUDIO_KINDS)


async def cohere_embed(request: web.Request, body: CohereEmbedRequest) -> CohereEmbedResponse:
    """Cohere v1/v2 embed. v1 without `embedding_types` (and a float server default)
    answers `embeddings_floats`; otherwise `embeddings_by_type`, where Cohere's `base64`
    type is the base64 of the float32 values."""
    default = request.app[CONFIG].server.embedding_type
    types = output_types(body.embedding_types, default)
    model = served_model(request, body.model, COHERE_KINDS)
    refuse_on_cohere(body)
    texts, images = _cohere_inputs(body)
    if images is None:
        inputs = text_inputs(texts, max_items(request), "texts")
    elif model.kind.medium == "image":
        inputs = ModelInputs(media=await media_bytes(request.app[FETCHER], images,
                                                     request.app[CONFIG].media.max_image_bytes, max_items(request)))
    else:
        raise APIError(422, f"model '{model.spec.name}' does not embed images (it is of kind '{model.spec.kind}')",
                       param="images")
    inputs = with_prompt(model, inputs, body.prompt, body.prompt_name, body.input_type)
    inputs = with_long_inputs(model, inputs, long_inputs_of_cohere(body.truncate, body.long_inputs), body.chunk_overlap)
    result, rows = await embedder(request).vectors(model, inputs, body.output_dimension, "output_dimension")
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


async def embed_sparse(request: web.Request, body: SparseEmbedRequest) -> SparseEmbedResponse:
    """TEI's sparse embeddings: per input, its nonzero values as `{index, value}`, by index."""
    model = served_model(request, body.model, SPARSE_KINDS)
    inputs = with_prompt(model, text_or_token_inputs(body.inputs, max_items(request), "inputs"), body.prompt,
                         body.prompt_name, None)
    if body.truncate is False:
        inputs = msgspec.structs.replace(inputs, refuse_cut="truncate")
    _, vectors = await embedder(request).sparse_vectors(model, inputs, body.top_k)
    return SparseEmbedResponse([[SparseValue(index, value) for index, value in entries.tolist()]
                                for entries in vectors])


ROUTES = [
    Route(openapi.Operation("post", "/v1/embeddings", ("/embeddings",), "Embed texts or token ids (OpenAI)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, OPENAI_KINDS, binary=True), embeddings),
    Route(openapi.Operation("post", "/embeddings_image", (), "Embed images given as data: URIs or URLs (infinity)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, IMAGE_KINDS, media=True, binary=True),
          embeddings_image),
    Route(openapi.Operation("post", "/embeddings_audio", (), "Embed audio clips given as data: URIs or URLs (infinity)",
                            EmbeddingRequest, EmbeddingResponse, MODEL_ERRORS, AUDIO_KINDS, media=True, binary=True),
          embeddings_audio),
    Route(openapi.Operation("post", "/v1/embed", ("/v2/embed",), "Embed texts (Cohere v1 and v2)",
                            CohereEmbedRequest, CohereEmbedResponse, MODEL_ERRORS, COHERE_KINDS), cohere_embed),
    Route(openapi.Operation("post", "/v1/embed_sparse", ("/embed_sparse",),
                            "A sparse model's nonzero values per input, by index (TEI)", SparseEmbedRequest,
                            SparseEmbedResponse, MODEL_ERRORS, SPARSE_KINDS), embed_sparse),
]
