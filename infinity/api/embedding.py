"""Answering an embeddings body (OpenAI's `/v1/embeddings`, with its extensions) on a
served model, whatever carried it: the HTTP routes (`infinity.api.routes.embeddings`) or a
line of an OpenAI batch file (`infinity.corpus.batch_file`). Float, base64 and quantised
types and `dimensions`; a multi-vector model's matrices; a sparse model's indices and
values. Errors are `APIError`s (a client's mistake) or `ServingError`s (from the children)."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np

from infinity.api.binary import WIRE_BYTES, encode_rows, vllm_metadata, wire_values
from infinity.api.errors import APIError
from infinity.api.inputs import keeping_last, kept_tokens, text_or_token_inputs, without_special_tokens
from infinity.api.late_chunking import character_spans, refuse_unless_late_chunkable, span_vectors
from infinity.api.long_inputs import chunk_means, with_long_inputs
from infinity.api.media_fetch import MediaFetcher, media_bytes
from infinity.api.prompts import with_prompt
from infinity.api.types.common import TextPart, ImagePart, Usage
from infinity.api.types.embeddings import (AudioUrlPart, EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                           SparseEmbedding, SpanEmbedding)
from infinity.client.engine_client import EngineClient, ModelInputs, Result
from infinity.client.topology import ServedModel
from infinity.config import Config
from infinity.shared.kinds import kinds_with
from infinity.shared.protocol import UNNORMALIZED
from infinity.shared.vectors import EmbeddingType, encode, encode_matrix, largest, shorten


@dataclass(frozen=True)
class Embedder:
    """What answering an embeddings body needs beside it: the engine client, the media
    fetcher, the configuration, and the most inputs one body may carry."""

    client: EngineClient
    fetcher: MediaFetcher
    config: Config
    max_items: int

    async def embeddings(self, model: ServedModel, body: EmbeddingRequest) -> EmbeddingResponse:
        """OpenAI embeddings of `body` on `model`; with `embedding_types`, each item holds
        `embeddings` by type instead of `embedding`."""
        if body.encoding_format in ("bytes", "bytes_only"):
            raise APIError(422, f"encoding_format \"{body.encoding_format}\" is an HTTP answer of its own; here, use "
                                "\"float\" or \"base64\"", param="encoding_format")
        body = with_input(body)
        refuse_unless_late_chunkable(model, body)
        _refuse_unserved_vllm_fields(model, body)
        _refuse_wire_type_unless_base64(model, body, self.config.server.embedding_type)
        inputs = await self._inputs(model, body)
        if body.late_chunking:
            return await self._late_chunks(model, inputs, body)
        if body.outputs is not None:
            return await self._hybrid(model, inputs, body)
        if model.kind.sparse:
            return await self._sparse(model, inputs, body)
        _refuse_top_k(model, body)
        types = body.output_types(self.config.server.embedding_type)
        if model.kind.late_interaction:
            return await self._multivector(model, inputs, body, types)
        # 0 asks for every dimension, as in infinity (its generated client sends 0 by default).
        result, rows = await self.vectors(model, inputs, body.dimensions or None, "dimensions",
                                          _unnormalized_by(body))
        if body.wire != ("float32", "little"):
            encoded = {"float": [base64.b64encode(row.tobytes()).decode() for row in wire_values(rows, *body.wire)]}
        else:
            encoded = {t: encode(rows, t, body.encoding_format == "base64") for t in types}
        if body.embedding_types is None:
            data = [EmbeddingData(index=i, embedding=value) for i, value in enumerate(encoded[types[0]])]
        else:
            data = [EmbeddingData(index=i, embeddings={t: encoded[t][i] for t in types}) for i in range(len(rows))]
        return EmbeddingResponse(data=data, model=model.spec.name, usage=Usage.of(result, body.input_usage))

    async def embeddings_bytes(self, model: ServedModel, body: EmbeddingRequest) -> tuple[bytes, dict[str, str]]:
        """`body`'s vectors on `model` as one binary answer (`infinity.api.binary`) and its
        headers: float vectors of a model with one vector per input, in `body.embed_dtype`;
        for `bytes_only` (vLLM's), the rows alone. A bytes body naming vLLM's `embed_dtype`
        or `endianness` also gets vLLM's `metadata` header (it would be too long for some
        clients' header limits to send unasked: about 100 bytes a row)."""
        name = model.spec.name
        if model.kind.ragged and not model.kind.vector_types:
            raise APIError(422, f"the {model.spec.kind} model '{name}' answers a vector per token or a sparse vector, "
                                "not rows of one width: binary answers are for dense vectors", param="encoding_format")
        if body.outputs is not None:
            raise APIError(422, "a binary answer holds the dense vectors; leave outputs out", param="outputs")
        _refuse_top_k(model, body)
        if body.late_chunking:
            raise APIError(422, "a binary answer holds a vector per input; late chunking answers in JSON",
                           param="encoding_format")
        if body.embedding_types is not None or (body.embedding_type or "float") != "float":
            raise APIError(422, "a binary answer holds float values (as embed_dtype); leave embedding_type(s) out",
                           param="embedding_type")
        body = with_input(body)
        _refuse_unserved_vllm_fields(model, body)
        inputs = await self._inputs(model, body)
        result, rows = await self.vectors(model, inputs, body.dimensions or None, "dimensions",
                                          _unnormalized_by(body))
        if body.encoding_format == "bytes_only":
            return wire_values(rows, *body.wire).tobytes(), {}
        usage = msgspec.to_builtins(Usage.of(result, body.input_usage))
        answer = encode_rows(rows, *body.wire, {"model": name, "usage": usage})
        if body.embed_dtype is None and body.endianness is None:
            return answer, {}
        rows_start = len(answer) - rows.size * WIRE_BYTES[body.wire[0]]
        about = {"id": f"embd-{uuid.uuid4().hex}", "created": int(time.time()), "model": name, "usage": usage}
        return answer, {"metadata": vllm_metadata(rows.shape, *body.wire, rows_start, about)}

    async def _inputs(self, model: ServedModel, body: EmbeddingRequest) -> ModelInputs:
        """The inputs `body` (`with_input`) holds, as its modality says (media fetched),
        with the prompt it asks for, its long ones taken as it asks."""
        if body.modality == "text":
            inputs = text_or_token_inputs(body.input, self.max_items)
        elif body.modality == model.kind.medium:
            inputs = ModelInputs(media=await media_bytes(self.fetcher, body.input,
                                                         self.config.media.max_bytes(body.modality), self.max_items))
        else:
            # Not read as text: a data: URI or URL embedded as words would be a wrong vector.
            raise APIError(422, f"model '{model.spec.name}' does not embed {body.modality} inputs (it is of kind "
                                f"'{model.spec.kind}')", param="modality")
        inputs = with_prompt(model, inputs, body.prompt, body.prompt_name, body.input_type)
        if body.late_chunking:  # its chunk_overlap is its windows' (`infinity.api.late_chunking`)
            return inputs
        inputs = keeping_last(with_long_inputs(model, inputs, body.long_inputs, body.chunk_overlap),
                              kept_tokens(body.truncate_prompt_tokens, model.spec), "truncate_prompt_tokens", model.spec)
        return without_special_tokens(inputs, body.add_special_tokens, model.spec)

    async def vectors(self, model: ServedModel, inputs: ModelInputs, dimensions: int | None,
                      dimensions_param: str, unnormalized_by: str | None = None) -> tuple[Result, np.ndarray]:
        """Run `inputs` through an embedder; return the (released) result and its vectors as
        one (n, dim) float32 array (a chunked input's: its chunks' mean, `chunk_means`),
        truncated to `dimensions` and re-normalised; where the request field
        `unnormalized_by` asks for them, the vectors before the model's final Normalize
        (neither re-normalised)."""
        _check_dimensions(model, dimensions, dimensions_param)
        before_normalize = unnormalized_by is not None and model.spec.normalize
        if before_normalize:
            _refuse_unless_unnormalized(model, unnormalized_by)
            inputs = msgspec.structs.replace(inputs, vector_types=(*inputs.vector_types, UNNORMALIZED))
        result = await self.client.run(model, inputs)
        try:
            rows = chunk_means(result, model.spec.normalize and not before_normalize)
        finally:
            result.release()
        return result, shorten(rows, dimensions, renormalize=unnormalized_by is None)

    async def sparse_vectors(self, model: ServedModel, inputs: ModelInputs,
                             top_k: int | None) -> tuple[Result, list[np.ndarray]]:
        """Run `inputs` through a sparse model; return the (released) result and each input's
        nonzero entries (records of `index` and `value`, by index), its largest `top_k` only
        and never more than the model's own max_active_dims."""
        result = await self.client.run(model, msgspec.structs.replace(inputs, vector_types=("sparse",)))
        try:
            vectors = list(result.rows())
        finally:
            result.release()
        return result, _within_top_k(model, vectors, top_k)

    async def _late_chunks(self, model: ServedModel, inputs: ModelInputs, body: EmbeddingRequest) -> EmbeddingResponse:
        """Each text's span vectors from one reading of it (`infinity.api.late_chunking`), in
        each item's `spans`, as `embedding_type` and `dimensions` ask."""
        _refuse_top_k(model, body)
        _check_dimensions(model, body.dimensions or None, "dimensions")
        if inputs.texts is None:
            raise APIError(422, "late chunking finds spans by characters: give texts, not token ids", param="input")
        (embedding_type,) = body.output_types(self.config.server.embedding_type)
        answers, billed = await span_vectors(self.client, model, inputs, character_spans(body, inputs.texts),
                                           body.chunk_overlap)
        data = []
        for index, answer in enumerate(answers):
            encoded = encode(shorten(answer.vectors, body.dimensions or None), embedding_type,
                             body.encoding_format == "base64")
            data.append(EmbeddingData(index=index, spans=[
                SpanEmbedding(start=start, end=end, token_start=token_start, token_end=token_end, embedding=vector)
                for (start, end), (token_start, token_end), vector in zip(answer.characters, answer.tokens, encoded)]))
        return EmbeddingResponse(data=data, model=model.spec.name, usage=Usage(billed, billed, 0))

    async def _multivector(self, model: ServedModel, inputs: ModelInputs, body: EmbeddingRequest,
                           types: list[EmbeddingType]) -> EmbeddingResponse:
        """A multi-vector model's embeddings: each item a matrix (a row per token, padding
        removed) and its `shape`."""
        if body.dimensions:
            raise APIError(422, f"dimensions does not apply to the multi-vector model '{model.spec.name}' (it "
                                "would cut every token's vector); leave it out", param="dimensions")
        result = await self.client.run(model, inputs)
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
        return EmbeddingResponse(data=data, model=model.spec.name, usage=Usage.of(result, body.input_usage))

    async def _sparse(self, model: ServedModel, inputs: ModelInputs, body: EmbeddingRequest) -> EmbeddingResponse:
        """A sparse model's embeddings: each item its nonzero values and their indices, by
        index, in float only (`indices` are vocabulary entries: nothing to cut or quantise)."""
        name = model.spec.name
        if body.dimensions:
            raise APIError(422, f"dimensions does not apply to the sparse model '{name}' (its dimensions are "
                                "vocabulary entries); use top_k to keep its largest values", param="dimensions")
        if body.encoding_format == "base64":
            raise APIError(422, f"the sparse model '{name}' answers its indices and values as JSON numbers, not "
                                "base64: send encoding_format \"float\" (the openai client sends base64 unless told)",
                           param="encoding_format")
        # The server's default type is for dense vectors; a sparse model's values are floats.
        types = body.output_types("float")
        if types != ["float"]:
            raise APIError(422, f"the sparse model '{name}' answers float values only, not "
                                f"{', '.join(t for t in types if t != 'float')}",
                           param="embedding_types" if body.embedding_types is not None else "embedding_type")
        result, vectors = await self.sparse_vectors(model, inputs, body.top_k)
        data = []
        for i, entries in enumerate(vectors):
            vector = _sparse_embedding(entries)
            data.append(EmbeddingData(index=i, **({"embedding": vector} if body.embedding_types is None
                                                  else {"embeddings": {"float": vector}})))
        return EmbeddingResponse(data=data, model=name, usage=Usage.of(result, body.input_usage))

    async def _hybrid(self, model: ServedModel, inputs: ModelInputs, body: EmbeddingRequest) -> EmbeddingResponse:
        """The outputs of a hybrid model `body.outputs` asks for, from one pass: each item
        holds each in its own field (`dense`, `sparse`, `multivector` and its `shape`),
        encoded as for a model of that one output (`encoding_format` and the embedding
        type apply to `dense` and `multivector`, `dimensions` to `dense`, `top_k` to `sparse`)."""
        name = model.spec.name
        if not model.kind.vector_types:
            raise APIError(422, f"outputs applies to hybrid models; '{name}' is of kind '{model.spec.kind}'",
                           param="outputs")
        asked = tuple(dict.fromkeys(body.outputs or ()))
        for field, output in (("dimensions", "dense"), ("top_k", "sparse")):
            if getattr(body, field) and output not in asked:
                raise APIError(422, f"{field} applies to the {output} output, which outputs does not ask for",
                               param=field)
        types = body.output_types(self.config.server.embedding_type)
        if len(types) > 1:
            raise APIError(422, "with outputs, give one embedding_type (each output is one field)",
                           param="embedding_types")
        _check_dimensions(model, body.dimensions or None, "dimensions")
        result = await self.client.run(model, msgspec.structs.replace(inputs, vector_types=asked))
        try:
            by_type = {vector_type: result.rows_of(vector_type) for vector_type in asked}
        finally:
            result.release()
        as_base64 = body.encoding_format == "base64"
        items: list[dict] = [{} for _ in range(len(inputs))]
        if "dense" in by_type:
            for item, vector in zip(items, encode(shorten(np.stack(by_type["dense"]), body.dimensions or None),
                                                  types[0], as_base64)):
                item["dense"] = vector
        for item, entries in zip(items, _within_top_k(model, by_type.get("sparse", []), body.top_k)):
            item["sparse"] = _sparse_embedding(entries)
        for item, matrix in zip(items, by_type.get("multivector", [])):
            item.update(multivector=encode_matrix(matrix, types[0], as_base64), shape=list(matrix.shape))
        return EmbeddingResponse(data=[EmbeddingData(index=i, **item) for i, item in enumerate(items)], model=name,
                                 usage=Usage.of(result, body.input_usage))


def _check_dimensions(model: ServedModel, dimensions: int | None, param: str) -> None:
    """`dimensions` (the field `param`), where given, must be within the model's vectors."""
    dim = model.info.dim if model.info else None
    if dimensions is not None and dim is not None and not 0 < dimensions <= dim:
        raise APIError(422, f"{param} must be between 1 and {dim} for model '{model.spec.name}'", param=param)


def _within_top_k(model: ServedModel, vectors: list[np.ndarray], top_k: int | None) -> list[np.ndarray]:
    """Sparse vectors (`index`, `value` records, by index), each its largest `top_k`
    values only and never more than the model's own max_active_dims."""
    limits = [k for k in (top_k, model.spec.max_active_dims) if k is not None]
    return [largest(entries, min(limits)) for entries in vectors] if limits else vectors


def _sparse_embedding(entries: np.ndarray) -> SparseEmbedding:
    return SparseEmbedding(indices=entries["index"].tolist(), values=entries["value"].tolist())


def _refuse_unserved_vllm_fields(model: ServedModel, body: EmbeddingRequest) -> None:
    """A 422 for vLLM's fields where `body` asks what is not served: keeping inputs' last
    tokens beyond the model's length or with late chunking, texts without their special tokens
    with late chunking, vectors before the final Normalize of a
    model whose kind does not give them or in late chunking's spans."""
    if kept_tokens(body.truncate_prompt_tokens, model.spec) is not None and body.late_chunking:
        raise APIError(422, "truncate_prompt_tokens keeps each input's last tokens; late chunking reads texts whole",
                       param="truncate_prompt_tokens")
    if not body.add_special_tokens and body.late_chunking:
        raise APIError(422, "add_special_tokens false is not served with late chunking", param="add_special_tokens")
    if body.use_activation is False and model.spec.normalize:
        _refuse_unless_unnormalized(model, "use_activation")
        if body.late_chunking:
            raise APIError(422, "use_activation false is not served with late chunking: its spans' vectors are "
                                "normalised where the model normalises", param="use_activation")


def _refuse_wire_type_unless_base64(model: ServedModel, body: EmbeddingRequest, default: EmbeddingType) -> None:
    """A 422 where `body` asks for float values in another dtype or byte order than
    base64's float32 little-endian (vLLM's `embed_dtype`, `endianness`) where they cannot
    apply: JSON numbers, types other than float, or vectors other than one per input."""
    param = "embed_dtype" if body.wire[0] != "float32" else "endianness"
    if body.wire == ("float32", "little"):
        return
    if body.encoding_format != "base64":
        raise APIError(422, f"{param} applies to encoding_format \"base64\" or \"bytes\"; JSON numbers are numbers",
                       param=param)
    if body.output_types(default) != ["float"] or body.embedding_types is not None:
        raise APIError(422, f"{param} is the wire type of float values: leave embedding_type(s) out", param=param)
    if model.kind.ragged or body.late_chunking or body.outputs is not None:
        raise APIError(422, f"{param} applies to models of one dense vector per input", param=param)


def _unnormalized_by(body: EmbeddingRequest) -> str | None:
    """The field of `body` that asks for vectors before the final Normalize (vLLM's
    `use_activation: false`), or None."""
    return "use_activation" if body.use_activation is False else None


def _refuse_unless_unnormalized(model: ServedModel, param: str) -> None:
    """A 422 naming `param` where it asks for the vectors before the final Normalize of a
    model whose kind's head does not give them (`KindSpec.unnormalized`)."""
    if not model.kind.unnormalized:
        raise APIError(422, f"{param} asks for vectors before the model's final L2 normalisation, which the "
                            f"{model.spec.kind} model '{model.spec.name}' does not give (only models of kind "
                            f"{', '.join(kinds_with(lambda kind: kind.unnormalized))} do)", param=param)


def _refuse_top_k(model: ServedModel, body: EmbeddingRequest) -> None:
    """`top_k` keeps a sparse vector's largest values: for any other model it is a 422."""
    if body.top_k is not None:
        raise APIError(422, f"top_k applies to sparse models; '{model.spec.name}' is of kind "
                            f"'{model.spec.kind}'", param="top_k")


def with_input(body: EmbeddingRequest) -> EmbeddingRequest:
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
