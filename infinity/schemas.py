"""Request and response bodies of the HTTP API as msgspec types (requests are decoded and
checked with them, responses encoded from them, and the OpenAPI document is built from
them), and the checks of a request that a type cannot express (the shapes `input` may
take, limits)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, NewType, TypeVar

import msgspec
import numpy as np
from msgspec import UNSET, Meta, Struct, UnsetType

from infinity.errors import APIError
from infinity.quantize import EmbeddingType

# --- requests ----------------------------------------------------------------------------------

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2 ** 31 - 1}
_TEXT = {"type": "string", "minLength": 1}
_TEXT_OR_TOKENS = {"anyOf": [
    _TEXT,
    {"type": "array", "items": _TEXT, "minItems": 1},
    {"type": "array", "items": _TOKEN_ID, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1},
]}
# Shapes that msgspec cannot tell apart by type alone (it takes one kind of list per union);
# `text_or_token_inputs` and `rerank_inputs` check them and say what is wrong.
TextOrTokens = Annotated[Any, Meta(
    description="A text, a list of texts, a list of token ids, or a list of lists of token ids",
    extra_json_schema=_TEXT_OR_TOKENS)]
Query = Annotated[Any, Meta(description="The query each document is scored against", extra_json_schema=_TEXT)]
Documents = Annotated[Any, Meta(
    description="The documents to score: texts, or objects whose `text` is the document; for a page-retrieval "
                "model, page images (data: URIs or URLs, or objects whose `content` is one image_url part)",
    extra_json_schema={"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "string"},
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        {"type": "object", "properties": {"content": {"type": "array", "minItems": 1, "maxItems": 1}},
         "required": ["content"]}]}})]


# Queries and documents, in OpenAI-style and in Cohere's names.
InputType = Literal["query", "document", "search_query", "search_document"]

# A sparse model's answer per input: its largest this many values (then by index).
TopK = Annotated[int, Meta(ge=1, description="A sparse model's largest this many values per input, "
                                             "sorted by index; none: every nonzero value")]


class ImageUrl(Struct):
    url: str


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImagePart(Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class AudioUrlPart(Struct, tag="audio_url", tag_field="type"):
    audio_url: ImageUrl


class InputAudio(Struct):
    data: str  # the file's bytes in base64
    format: Annotated[str, Meta(pattern="^[a-z0-9]{1,16}$")]  # "wav", "mp3", "flac", ...


class AudioPart(Struct, tag="input_audio", tag_field="type"):
    """OpenAI's and vLLM's audio content part: base64 data and its format."""

    input_audio: InputAudio

    @property
    def uri(self) -> str:
        return f"data:audio/{self.input_audio.format};base64,{self.input_audio.data}"


class ChatMessage(Struct):
    """A message of vLLM's embeddings form: a text, or content parts."""

    content: str | list[TextPart | ImagePart | AudioUrlPart | AudioPart]
    role: str = "user"


class EmbeddingRequest(Struct):
    """OpenAI embeddings, plus the output type: `embedding_type` (one, in each item's
    `embedding`) or `embedding_types` (several, in each item's `embeddings`), a sparse
    model's `top_k`; or, instead of `input`, vLLM's `messages` holding one text or one
    image."""

    input: TextOrTokens | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(description="Keep the first this many dimensions, then re-normalise; "
                                                "0 for all", extra_json_schema={"minimum": 0})] | None = None
    user: str | None = None
    embedding_type: EmbeddingType | None = None
    embedding_types: Annotated[list[EmbeddingType], Meta(min_length=1)] | None = None
    # What `input` holds: text, or (for models that see or hear) images or audio as data:
    # URIs or URLs, as infinity's `modality`.
    modality: Literal["text", "image", "audio"] = "text"
    input_type: Annotated[InputType, Meta(description="Encode the inputs as queries or as documents, for models "
                                                      "that tell them apart (multi-vector); default document")] | None = None

    @property
    def task(self) -> str | None:
        """The `input_type` in the model's terms: "query", "document" or None (not given)."""
        return None if self.input_type is None else self.input_type.removeprefix("search_")
    top_k: TopK | None = None

    def output_types(self, default: EmbeddingType) -> list[EmbeddingType]:
        """The requested types (see `output_types`); `embedding_type` stands in for the default."""
        if self.embedding_type is not None and self.embedding_types is not None:
            raise APIError(422, "give embedding_type (one type) or embedding_types (a list), not both",
                           param="embedding_types")
        return output_types(self.embedding_types, self.embedding_type or default)


# Cohere's "base64" type: base64 of the float32 values.
CohereEmbeddingType = Literal[EmbeddingType, "base64"]


class CohereInput(Struct):
    """One input of Cohere v2's `inputs`: its content parts (one, for the models here)."""

    content: Annotated[list[TextPart | ImagePart], Meta(min_length=1)]


class CohereEmbedRequest(Struct):
    """Cohere v1/v2 embed bodies: `texts`, or `images` (data: URIs) for image-text models,
    or v2's `inputs` (each one text or one image_url part). `input_type` is accepted and
    ignored; long inputs are cut at the end (or refused) as the model's `truncate`
    setting says, so `truncate` may only be END."""

    texts: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    images: Annotated[list[str], Meta(min_length=1)] | None = None
    inputs: Annotated[list[CohereInput], Meta(min_length=1)] | None = None
    model: str | None = None
    input_type: str | None = None
    embedding_types: Annotated[list[CohereEmbeddingType], Meta(min_length=1)] | None = None
    truncate: Literal["END"] = "END"
    output_dimension: Annotated[int, Meta(extra_json_schema={"minimum": 1})] | None = None


_Type = TypeVar("_Type", bound=str)


def output_types(types: list[_Type] | None, default: _Type) -> list[_Type]:
    """The requested output types, each once, in request order; `[default]` without a list."""
    if types is None:
        return [default]
    if not types:
        raise APIError(422, "embedding_types must name at least one type", param="embedding_types")
    return list(dict.fromkeys(types))


class SparseEmbedRequest(Struct):
    """TEI's `/embed_sparse` body, plus `model` (a served sparse model; none: the only one)
    and `top_k`. Long inputs are cut at the end as the model's `truncate` setting says;
    `truncate: false` refuses them (422) even where the model would cut them. A served
    sparse model has no prompts, so `prompt_name` is refused."""

    inputs: TextOrTokens
    model: str | None = None
    truncate: bool | None = None
    truncation_direction: Literal["Right"] = "Right"
    prompt_name: str | None = None
    top_k: TopK | None = None


class RerankRequest(Struct):
    """Cohere v1/v2 and Jina rerank bodies (their other fields are accepted and ignored)."""

    query: Query
    documents: Documents
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0, description="Results to return, best first; 0 for all")] | None = None
    return_documents: bool = False
    raw_scores: bool = False


class ClassifyRequest(Struct):
    input: TextOrTokens
    model: str | None = None
    raw_scores: bool = False


# --- responses ---------------------------------------------------------------------------------

class Usage(Struct):
    """Tokens the model processed (after truncation), and how many inputs were cut to its
    maximum length."""

    prompt_tokens: int
    total_tokens: int
    truncated_inputs: int


class SparseEmbedding(Struct):
    """A sparse model's vector: its nonzero values and their indices (vocabulary entries),
    by index."""

    indices: list[int]
    values: list[float]


# A list of numbers (floats, or integers for the quantised types), or with base64 the
# base64 of the row's raw little-endian bytes; for a multi-vector model, a list of such
# lists (one per token), or the base64 of all the rows' bytes in order; for a sparse
# model, its indices and values.
Embedding = list[float | list[float]] | str | SparseEmbedding


class EmbeddingData(Struct, kw_only=True):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Embedding | UnsetType = UNSET  # with one output type
    embeddings: dict[str, Embedding] | UnsetType = UNSET  # with `embedding_types`: by type
    shape: list[int] | UnsetType = UNSET  # a multi-vector model's [n_tokens, dim]


class EmbeddingResponse(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class SparseValue(Struct):
    index: int
    value: float


# TEI's `/embed_sparse` answer: per input, its nonzero values by index (a bare JSON list).
SparseEmbedResponse = NewType("SparseEmbedResponse", list[list[SparseValue]])


class ApiVersion(Struct):
    version: str


class BilledUnits(Struct):
    input_tokens: int | UnsetType = UNSET
    search_units: int | UnsetType = UNSET


class InputTokens(Struct):
    input_tokens: int


class CohereMeta(Struct):
    api_version: ApiVersion
    billed_units: BilledUnits
    tokens: InputTokens


class CohereImage(Struct):
    width: int
    height: int
    format: str
    bit_depth: int


class CohereEmbedResponse(Struct, kw_only=True):
    id: str
    # embeddings_floats: a float list per text; embeddings_by_type: by type, one value per text.
    embeddings: list[list[float]] | dict[str, list[Embedding]]
    texts: list[str]
    images: list[CohereImage] | UnsetType = UNSET  # each input image as it was sent
    meta: CohereMeta
    response_type: Literal["embeddings_floats", "embeddings_by_type"]


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, kw_only=True):
    index: int  # of the document in the request
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET  # with `return_documents`


class RerankResponse(Struct, kw_only=True):
    id: str
    object: Literal["rerank"] = "rerank"  # as infinity answers (its client checks it)
    created: int
    results: list[RerankResult]
    model: str
    usage: Usage
    meta: CohereMeta


class LabelScore(Struct):
    label: str
    score: float


class ClassifyResponse(Struct, kw_only=True):
    id: str
    object: Literal["classify"] = "classify"  # as infinity answers (its client checks it)
    created: int
    data: list[list[LabelScore]]  # per input, every label, best first
    model: str
    usage: Usage


class ModelStats(Struct):
    """How full the model's queue is (the fields infinity's clients read)."""

    queue_fraction: float
    queue_absolute: int
    results_pending: int
    batch_size: int


class ReplicaCard(Struct):
    device: str
    ready: bool
    inputs: int  # computed so far
    engine: str | None
    dtype: str | None  # what it computes in: float32, bfloat16, ...


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    owned_by: Literal["infinity"] = "infinity"
    created: int
    kind: Literal["embed", "rerank", "classify", "multivector", "sparse", "image_text", "audio_text",
                  "image_multivector"]
    capabilities: list[str]
    backend: str  # the engine of the first replica that loaded
    dtype: str  # what the first replica that loaded computes in (until one has: what its spec asks)
    stats: ModelStats
    ready: bool
    dimensions: int | None
    max_length: int
    devices: list[str]
    replicas: list[ReplicaCard]


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(Struct):
    status: Literal["ok"]
    unix: float


# --- checks beyond the types -------------------------------------------------------------------

class ModelInputs(msgspec.Struct, frozen=True):
    """Either texts or token-id sequences, never both; with `query`, the texts are the
    documents each paired with it; `task`: encode them as the model's "query" or
    "document" (models that tell the two apart)."""

    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    query: str | None = None
    task: str | None = None
    media: list[bytes] | None = None  # fetched bytes or data: URIs (see `protocol.Tokenize.media`)

    def __len__(self) -> int:
        inputs = next(i for i in (self.texts, self.token_ids, self.media) if i is not None)
        return len(inputs)


def decode_body(body: bytes | bytearray, request_type: type[msgspec.Struct], max_chars: int | None = None) -> Any:
    """Decode a JSON body into `request_type`, or raise the matching 400/422 APIError.

    With `max_chars`, a text in the body longer than that (at the top level, or an item of
    a top-level list) is decoded only in part, still more than `max_chars` characters of
    it: no model reads more of an input, and a 16 MiB text then costs one pass over its
    bytes (which checks the whole body) rather than two."""
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        members = None  # not an object: the typed decode below says so
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_json(exc) from None
    if members is not None:
        repeated = _repeated_key(body, members)
        if repeated is not None:
            raise APIError(400, f"the request body names '{repeated}' more than once", param=repeated)
        if max_chars is not None and not _carries_media(members):
            body = _shortened(body, members, max_chars)
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise APIError(422, str(exc), param=_param_of(str(exc))) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_json(exc) from None


def _not_json(exc: msgspec.DecodeError | RecursionError) -> APIError:
    if isinstance(exc, RecursionError):
        return APIError(400, "the request body is nested too deeply")
    return APIError(400, f"the request body is not valid JSON: {exc}")


def _carries_media(members: dict[str, msgspec.Raw]) -> bool:
    """Whether a body's inputs are media (a data: URI is read whole, however long): Cohere's
    `images`, or a `modality` other than text."""
    if "images" in members:
        return True
    try:
        return "modality" in members and msgspec.json.decode(members["modality"]) != "text"
    except msgspec.DecodeError:
        return False


# A member's key and the separators around it, between two values of one JSON object.
_KEY = re.compile(rb'\s*[{,]\s*("(?:[^"\\]|\\.)*")\s*:\s*')
_END = re.compile(rb"\s*}\s*")


def _repeated_key(body: bytes | bytearray, members: dict[str, msgspec.Raw]) -> str | None:
    """The first key the top-level object of `body` (valid JSON) names twice, or None.

    msgspec silently keeps the last of repeated keys, so a body that says two things is
    refused instead. Walks the members in order, comparing each value in place with the
    one kept for its key: a key met again, or a value that is not the one kept (a later
    member repeats its key), names a repeated key; a value that continues past the kept
    one's bytes leaves the walk off a member boundary, which only a repeated key does."""
    if not members:
        return None
    position, seen, key = 0, set(), None
    while len(seen) < len(members):
        found = _KEY.match(body, position)
        if found is None:
            return key
        key = _key_text(found.group(1))
        kept = members.get(key)
        if key in seen or kept is None or not _lies_at(body, kept, found.end()):
            return key
        seen.add(key)
        position = found.end() + len(kept)
    if _END.fullmatch(body, position) is not None:
        return None
    after = _KEY.match(body, position)  # a member past every kept one repeats a key
    return key if after is None else _key_text(after.group(1))


# Values up to this long are compared in place; longer ones by address, which costs no
# pass over their bytes.
_COMPARED_BYTES = 4096


def _lies_at(body: bytes | bytearray, value: msgspec.Raw, position: int) -> bool:
    """Whether `value`, a `Raw` decoded from `body` (which points into it), is the value
    that starts at `position`."""
    if len(value) <= _COMPARED_BYTES:
        return body.startswith(value, position)
    return _address(value) - _address(body) == position


def _address(buffer: bytes | bytearray | msgspec.Raw) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def _key_text(quoted: bytes) -> str:
    """A JSON string's text (`quoted` with its quotes); without escapes, its bytes."""
    return msgspec.json.decode(quoted) if b"\\" in quoted else quoted[1:-1].decode()


# The most bytes one character takes in a JSON string: a surrogate pair of \u escapes.
_CHAR_BYTES = 12


def _shortened(body: bytes | bytearray, members: dict[str, msgspec.Raw], max_chars: int) -> bytes | bytearray:
    """`body` with each long text cut to its first `max_chars` + 1 characters or more."""
    limit = _CHAR_BYTES * (max_chars + 2)
    if len(body) <= limit:
        return body
    values = {key: _short_value(memoryview(raw), limit) for key, raw in members.items()}
    if all(value is None for value in values.values()):
        return body
    return b"{" + b",".join(msgspec.json.encode(key) + b":" + (bytes(members[key]) if value is None else value)
                            for key, value in values.items()) + b"}"


def _short_value(value: memoryview, limit: int) -> bytes | None:
    """A string (or a list's strings) of more than `limit` bytes cut short; None: unchanged."""
    if len(value) <= limit:
        return None
    if value[0] == ord('"'):
        return _cut_string(value, limit)
    if value[0] == ord("["):
        items = msgspec.json.decode(value, type=list[msgspec.Raw])
        cut = [_short_value(memoryview(item), limit) for item in items]
        if any(c is not None for c in cut):
            return b"[" + b",".join(bytes(item) if c is None else c for item, c in zip(items, cut)) + b"]"
    return None


def _cut_string(literal: memoryview, limit: int) -> bytes | None:
    """The JSON string `literal` cut after at most `limit` bytes, before any character or
    escape the cut would split, and closed again; None if no such cut decodes."""
    end = limit
    while literal[end] & 0xC0 == 0x80:  # inside a UTF-8 sequence
        end -= 1
    escape = _last_escape(literal, end)
    if escape is not None and escape + _escape_length(literal, escape) > end:  # the cut would split it
        end = escape
    escape = _last_escape(literal, end)
    if escape is not None and escape + 6 == end and _is_high_surrogate(literal[escape:end]):
        end = escape  # keep a surrogate pair whole
    cut = bytes(literal[:end]) + b'"'
    try:
        msgspec.json.decode(cut)
    except msgspec.DecodeError:
        return None
    return cut


def _escape_length(literal: memoryview, start: int) -> int:
    return 6 if literal[start + 1] == ord("u") else 2


def _is_high_surrogate(escape: memoryview) -> bool:
    return escape[1] == ord("u") and 0xD800 <= int(bytes(escape[2:6]), 16) <= 0xDBFF


def _last_escape(literal: memoryview, end: int) -> int | None:
    """Where the last escape sequence that starts in the `_CHAR_BYTES` bytes before `end`
    begins (a backslash preceded by an even number of backslashes), or None."""
    for start in range(end - 1, max(0, end - _CHAR_BYTES), -1):
        if literal[start] == ord("\\"):
            run = 1
            while start - run >= 0 and literal[start - run] == ord("\\"):
                run += 1
            return start if run % 2 == 1 else None  # else it ends a run of escaped backslashes
    return None


def _param_of(message: str) -> str | None:
    """`Expected str, got int - at $.model` -> `model`;
    `Object missing required field `input`` -> `input`."""
    _, sep, path = message.rpartition(" - at `$.")
    if sep:
        return path.rstrip("`").split("[")[0].split(".")[0]
    _, sep, field = message.rpartition("missing required field `")
    return field.rstrip("`") or None if sep else None


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
    _check_count(len(value), max_items, param)
    if all(_is_token(v) for v in value):
        return ModelInputs(token_ids=_in_range([value], param))
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        return ModelInputs(token_ids=_in_range(value, param))
    raise APIError(422, _SHAPE.format(param), param=param)


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
