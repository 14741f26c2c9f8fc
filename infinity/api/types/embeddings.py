"""Bodies of the embedding routes: OpenAI's `/v1/embeddings` (with vLLM's `messages`),
Cohere's v1/v2 embed, TEI's `/embed_sparse`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, NewType

from msgspec import UNSET, Meta, Struct, UnsetType, field

from infinity.api.binary import Endianness, WireDtype
from infinity.api.errors import APIError
from infinity.api.inputs import output_types
from infinity.api.types.common import (INPUT_TYPE, ChunkOverlap, CohereMeta, ImagePart, ImageUrl, InputType,
                                       LongInputs, PromptedRequest, TextOrTokens, TextPart, Usage)
from infinity.shared.kinds import KINDS
from infinity.shared.vectors import EmbeddingType

# The outputs of a hybrid model (BGE-M3) a request may ask for.
VectorType = Literal[KINDS["hybrid"].vector_types]  # type: ignore[valid-type]

# A sparse model's answer per input: its largest this many values (then by index).
TopK = Annotated[int, Meta(ge=1, description="A sparse model's largest this many values per input, "
                                             "sorted by index; none: every nonzero value")]


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


class EmbeddingRequest(PromptedRequest):
    """OpenAI embeddings, plus the output type: `embedding_type` (one, in each item's
    `embedding`) or `embedding_types` (several, in each item's `embeddings`), a sparse
    model's `top_k`, the texts' prompt (`prompt_name`, `prompt`, `input_type`), how long
    inputs are taken (`long_inputs`, `chunk_overlap`), a vector per span of each text
    (`late_chunking` with `spans` or `split`); or, instead of `input`, vLLM's
    `messages` holding one text or one image."""

    input: TextOrTokens | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    model: str | None = None
    # null is the default, as OpenAI reads it: LiteLLM's openai provider sends null so that
    # its openai client does not put base64 in (see __post_init__).
    encoding_format: Annotated[Literal["float", "base64", "bytes", "bytes_only"], Meta(
        description="bytes: the answer is the vectors' raw bytes (application/octet-stream, see docs/api.md), as "
                    "embed_dtype in endianness; bytes_only: the rows alone, without the header (vLLM's); "
                    "null: float")] | None = "float"
    # vLLM's: naming either also puts vLLM's `metadata` header on a bytes answer.
    embed_dtype: Annotated[WireDtype, Meta(description="The wire type of base64 and bytes values (vLLM's); none: "
                                                       "float32")] | None = None
    endianness: Annotated[Endianness, Meta(description="The byte order of base64 and bytes values (vLLM's); none: "
                                                       "little")] | None = None
    dimensions: Annotated[int, Meta(description="Keep the first this many dimensions, then re-normalise; "
                                                "0 for all", extra_json_schema={"minimum": 0})] | None = None
    # LiteLLM's infinity provider sends `dimensions` under Cohere's name.
    output_dimension: Annotated[int, Meta(description="As dimensions", extra_json_schema={"minimum": 1})] | None = None
    user: str | None = None
    embedding_type: EmbeddingType | None = None
    embedding_types: Annotated[list[EmbeddingType], Meta(min_length=1)] | None = None
    # What `input` holds: text, or (for models that see or hear) images or audio as data:
    # URIs or URLs, as infinity's `modality`.
    modality: Literal["text", "image", "audio"] = "text"
    input_type: Annotated[InputType, INPUT_TYPE] | None = None
    top_k: TopK | None = None
    outputs: Annotated[list[VectorType], Meta(
        min_length=1, description="A hybrid model's outputs to answer from one pass, each item holding each in its "
                                  "own field (dense, sparse, multivector with its shape); none: the dense vector, "
                                  "in embedding")] | None = None
    long_inputs: LongInputs | None = None
    chunk_overlap: ChunkOverlap | None = None
    input_usage: Annotated[bool, Meta(
        description="Also answer each input's tokens (usage.input_tokens) and the indices of the inputs cut to the "
                    "model's length (usage.truncated_indices)")] = False
    late_chunking: Annotated[bool, Meta(
        description="Each text read whole (where longer than the model, in windows sharing chunk_overlap tokens; none: "
                    "a quarter of a window), then one vector per span of it (spans or split), the mean of the token "
                    "states its characters cover, in each item's spans (see docs/api.md)")] | None = None
    spans: Annotated[list[list[CharacterSpan]], Meta(
        description="With late_chunking: per input, its spans as [start, end) character ranges")] | None = None
    split: Annotated[Literal["sentences"], Meta(
        description="With late_chunking: each input's spans are its sentences (ended by . ! or ? before whitespace, "
                    "or by a newline)")] | None = None
    # vLLM's pooling fields.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "vLLM's: -1 (or none): inputs cut to the model's length; a count of tokens to keep from the end is "
        "refused here"))] | None = None
    add_special_tokens: Annotated[bool, Meta(description="vLLM's: false tokenizes texts without the model's special "
                                                         "tokens")] = True
    use_activation: Annotated[bool, Meta(description=(
        "vLLM's: false asks for the vectors before the model's final L2 normalisation"))] | None = None

    def __post_init__(self) -> None:
        if self.encoding_format is None:
            self.encoding_format = "float"
        if self.output_dimension is not None:
            if self.dimensions not in (None, 0, self.output_dimension):
                raise ValueError("give dimensions or output_dimension (the same), not two sizes - at "
                                 "`$.output_dimension`")
            self.dimensions = self.output_dimension

    @property
    def wire(self) -> tuple[WireDtype, Endianness]:
        """The wire type and byte order of base64 and bytes values."""
        return self.embed_dtype or "float32", self.endianness or "little"

    def output_types(self, default: EmbeddingType) -> list[EmbeddingType]:
        """The requested types (see `output_types`); `embedding_type` stands in for the default."""
        if self.embedding_type is not None and self.embedding_types is not None:
            raise APIError(422, "give embedding_type (one type) or embedding_types (a list), not both",
                           param="embedding_types")
        return output_types(self.embedding_types, self.embedding_type or default)


# Cohere's "base64" type: base64 of the float32 values.
CohereEmbeddingType = Literal[EmbeddingType, "base64"]


NOT_ON_COHERE = Meta(description="Not taken here (422 unless false): late chunking answers a vector per span, on "
                                 "/v1/embeddings")


class CohereInput(Struct):
    """One input of Cohere v2's `inputs`: its content parts (one, for the models here)."""

    content: Annotated[list[TextPart | ImagePart], Meta(min_length=1)]


class CohereEmbedRequest(PromptedRequest):
    """Cohere v1/v2 embed bodies: `texts`, or `images` (data: URIs) for image-text models,
    or v2's `inputs` (each one text or one image_url part). `input_type` picks the texts'
    prompt, as on `/v1/embeddings` (`prompt_name` and `prompt` too). Long inputs are taken
    as the model is set, unless `truncate` says otherwise (END: cut at the end; NONE:
    refused) or `long_inputs` does (as on `/v1/embeddings`; not both)."""

    texts: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    images: Annotated[list[str], Meta(min_length=1)] | None = None
    inputs: Annotated[list[CohereInput], Meta(min_length=1)] | None = None
    model: str | None = None
    input_type: Annotated[Literal[InputType, "image"], INPUT_TYPE] | None = None
    embedding_types: Annotated[list[CohereEmbeddingType], Meta(min_length=1)] | None = None
    truncate: Literal["NONE", "END"] | None = None
    long_inputs: LongInputs | None = None
    chunk_overlap: ChunkOverlap | None = None
    output_dimension: Annotated[int, Meta(extra_json_schema={"minimum": 1})] | None = None
    # Late chunking's fields, named so that they are refused rather than ignored (Cohere's
    # answer holds a vector per text, with no place for spans).
    late_chunking: Annotated[bool, NOT_ON_COHERE] | None = None
    spans: Annotated[list[list[CharacterSpan]], NOT_ON_COHERE] | None = None
    split: Annotated[Literal["sentences"], NOT_ON_COHERE] | None = None


class SparseEmbedRequest(PromptedRequest):
    """TEI's `/embed_sparse` body, plus `model` (a served sparse model; none: the only one),
    `top_k` and `prompt` (beside TEI's `prompt_name`). Long inputs are cut at the end as the
    model's `long_inputs` setting says; `truncate: false` refuses them (422, before the model
    runs) even where the model would cut them."""

    inputs: TextOrTokens
    model: str | None = None
    truncate: bool | None = None
    truncation_direction: Literal["Right"] = "Right"
    top_k: TopK | None = None


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


# A span of a text with late chunking: [start, end) characters.
CharacterSpan = tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)]]


class SpanEmbedding(Struct, kw_only=True):
    """A span's vector with late chunking: its characters [start, end) in the input, its
    tokens [token_start, token_end) among those of the pass (special and prompt tokens
    counted, as /tokenize counts them)."""

    start: int
    end: int
    token_start: int
    token_end: int
    embedding: Embedding


class EmbeddingData(Struct, kw_only=True):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Embedding | UnsetType = UNSET  # with one output type
    embeddings: dict[str, Embedding] | UnsetType = UNSET  # with `embedding_types`: by type
    shape: list[int] | UnsetType = UNSET  # a multi-vector model's [n_tokens, dim]
    # With `outputs`, a hybrid model's outputs asked, each in its field (`shape`: the multivector's).
    dense: Embedding | UnsetType = UNSET
    sparse: SparseEmbedding | UnsetType = UNSET
    multivector: Embedding | UnsetType = UNSET
    spans: list[SpanEmbedding] | UnsetType = UNSET  # with `late_chunking`: a vector per span, no `embedding`


class EmbeddingResponse(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage
    # As vLLM and infinity answer them.
    id: str = field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


class SparseValue(Struct):
    index: int
    value: float


# TEI's `/embed_sparse` answer: per input, its nonzero values by index (a bare JSON list).
SparseEmbedResponse = NewType("SparseEmbedResponse", list[list[SparseValue]])


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
