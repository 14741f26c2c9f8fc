"""Checks of a request's inputs beyond their types (the shapes `input` may take, limits),
sorting them into the engine client's `ModelInputs`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from infinity.api.errors import APIError
from infinity.api.types.common import ImagePart
from infinity.api.types.scores import RerankRequest
from infinity.client.engine_client import ModelInputs
from infinity.shared.protocol import ModelSpec

_Type = TypeVar("_Type", bound=str)


def output_types(types: list[_Type] | None, default: _Type) -> list[_Type]:
    """The requested output types, each once, in request order; `[default]` without a list."""
    if types is None:
        return [default]
    if not types:
        raise APIError(422, "embedding_types must name at least one type", param="embedding_types")
    return list(dict.fromkeys(types))


def kept_tokens(truncate_prompt_tokens: int | None, spec: ModelSpec, pairs: bool = False) -> int | None:
    """vLLM's `truncate_prompt_tokens`: the count of each input's last tokens to keep, or
    None for its -1 (or none: inputs are cut to the model's length at their end). A 422
    beyond the model's length (as vLLM's), and for `pairs`, which are cut at the end of
    their document only."""
    if truncate_prompt_tokens in (None, -1):
        return None
    param = "truncate_prompt_tokens"
    if pairs:
        raise APIError(422, f"{param} {truncate_prompt_tokens} keeps each input's last tokens, which is not served "
                            "for pairs (a pair longer than the model is cut at the end of its document); send -1",
                       param=param)
    if not 0 < truncate_prompt_tokens <= spec.max_length:
        raise APIError(422, f"{param} must be -1 or between 1 and {spec.max_length}, the length of model "
                            f"'{spec.name}'", param=param)
    return truncate_prompt_tokens


def keeping_last(inputs: ModelInputs, keep: int | None, param: str, spec: ModelSpec) -> ModelInputs:
    """`inputs` cut at their start to their last `keep` tokens where the request field
    `param` asks it (vLLM's truncate_prompt_tokens, TEI's truncation_direction Left), never
    chunked; unchanged for None. A 422 for media, and after a prompt, whose tokens a cut at
    the start would take first."""
    if keep is None:
        return inputs
    if inputs.long_inputs not in (None, "truncate"):
        raise APIError(422, f"{param} cuts long inputs at their start; long_inputs {inputs.long_inputs!r} takes them "
                            "otherwise: give one of the two", param=param)
    if inputs.media is not None or inputs.query is not None:
        raise APIError(422, f"{param} cuts texts or token ids at their start; these inputs are not", param=param)
    if inputs.texts is not None and inputs.prompt_on(spec):
        raise APIError(422, f"{param} cuts each input at its start, which would cut the prompt put before it "
                            f"(model '{spec.name}' puts one before these texts); leave it out, or ask for no prompt "
                            "(prompt \"\")", param=param)
    return msgspec.structs.replace(inputs, keep_last=keep, long_inputs="truncate")


def without_special_tokens(inputs: ModelInputs, add_special_tokens: bool | None, spec: ModelSpec) -> ModelInputs:
    """`inputs` whose texts are tokenized without the model's special tokens where vLLM's
    `add_special_tokens` is false (token ids never get them); unchanged otherwise. A 422
    for pairs and media, after a prompt (which is read as the start of a text with them),
    and where long inputs are chunked (chunks are read with them)."""
    if add_special_tokens is not False:
        return inputs
    param = "add_special_tokens"
    if inputs.media is not None or inputs.query is not None:
        raise APIError(422, f"{param} false applies to texts and token ids; these inputs are not", param=param)
    if inputs.texts is not None and inputs.prompt_on(spec):
        raise APIError(422, f"{param} false is not served after a prompt (model '{spec.name}' puts one before these "
                            "texts); leave it out, or ask for no prompt (prompt \"\")", param=param)
    if (inputs.long_inputs or spec.long_inputs) == "chunk":
        raise APIError(422, f"{param} false is not served with long inputs chunked; send long_inputs \"truncate\" "
                            "or \"error\"", param=param)
    return msgspec.structs.replace(inputs, special_tokens=False)


_SHAPE = ("{} must be a non-empty string, a list of non-empty strings, a list of token ids "
          "or a list of lists of token ids")


def text_or_token_inputs(value: Any, max_items: int, param: str = "input") -> ModelInputs:
    """Check the inputs of an embeddings or classify request (the field `param`) and sort
    them into texts or token ids."""
    if isinstance(value, str):
        if not value:
            raise APIError(422, f"{param} must not be an empty string", param=param)
        return ModelInputs(texts=[value])
    if not isinstance(value, list) or not value:
        raise APIError(422, _SHAPE.format(param), param=param)
    if all(isinstance(v, str) for v in value):
        return text_inputs(value, max_items, param)
    return token_inputs(value, max_items, param, _SHAPE.format(param))


def token_inputs(value: list, max_items: int, param: str, shape: str) -> ModelInputs:
    """Check a non-empty list of token ids (one input), or of lists of them (the field
    `param`; `shape`: what it should be, said if it is not)."""
    if all(_is_token(v) for v in value):
        return ModelInputs(token_ids=_in_range([value], param))
    _check_count(len(value), max_items, param)
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        return ModelInputs(token_ids=_in_range(value, param))
    raise APIError(422, shape, param=param)


def text_inputs(texts: list[str], max_items: int, param: str) -> ModelInputs:
    """Check a list of texts: not empty, within the item limit, no empty string."""
    if not texts:
        raise APIError(422, f"{param} must be a non-empty list of strings", param=param)
    _check_count(len(texts), max_items, param)
    empty = next((i for i, text in enumerate(texts) if not text), None)
    if empty is not None:
        raise APIError(422, f"{param}[{empty}] is an empty string", param=param)
    return ModelInputs(texts=texts)


def _check_count(count: int, max_items: int, param: str) -> None:
    if count > max_items:
        raise APIError(422, f"{param} has {count} items, more than the limit of {max_items} "
                            "per request; split it into several requests", param=param)


def _in_range(sequences: list[list[int]], param: str) -> list[list[int]]:
    """Token ids travel as int32; the tokenizer process checks the model's own vocabulary."""
    for i, ids in enumerate(sequences):
        bad = next((t for t in ids if not 0 <= t <= _MAX_TOKEN_ID), None)
        if bad is not None:
            raise APIError(422, f"{param}[{i}] holds token id {bad}, outside the model's vocabulary",
                           param=param)
    return sequences


_MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def page_documents(body: RerankRequest, max_items: int) -> list[str]:
    """A page-retrieval rerank's query (checked) and documents as image data: URIs or URLs:
    each a string, or `{"content": [{"type": "image_url", "image_url": {"url": ...}}]}`."""
    def read(document: object) -> str | None:
        if isinstance(document, dict):
            try:
                (part,) = msgspec.convert(document.get("content"), list[ImagePart])
            except (msgspec.ValidationError, ValueError, TypeError):
                return None
            return part.image_url.url
        return document if isinstance(document, str) else None

    return _rerank_documents(body, max_items, read, "page images",
                             "a page image: a data: URI or URL, or an object whose content is one image_url part")


def rerank_inputs(body: RerankRequest, max_items: int) -> ModelInputs:
    """Check a rerank request: a non-empty query, documents as strings or {"text": ...}."""
    def read(document: object) -> str | None:
        text = document.get("text") if isinstance(document, dict) else document
        return text if isinstance(text, str) else None

    texts = _rerank_documents(body, max_items, read, "strings or of objects with 'text'",
                              "a string or an object with a string 'text'")
    return ModelInputs(texts=texts, query=body.query)


def _rerank_documents(body: RerankRequest, max_items: int, read: Callable[[object], str | None], kinds: str,
                      one: str) -> list[str]:
    """A rerank request's documents, each as `read` makes it (None: not a document of
    the model's kind, described as `one`; the list as `kinds`), after checking its query."""
    if not isinstance(body.query, str) or not body.query:
        raise APIError(422, "query must be a non-empty string", param="query")
    documents = body.documents
    if not isinstance(documents, list) or not documents:
        raise APIError(422, f"documents must be a non-empty list of {kinds}", param="documents")
    _check_count(len(documents), max_items, "documents")
    read_documents = [read(document) for document in documents]
    for i, document in enumerate(read_documents):
        if document is None:
            raise APIError(422, f"documents[{i}] must be {one}", param="documents")
    return read_documents  # type: ignore[return-value]
