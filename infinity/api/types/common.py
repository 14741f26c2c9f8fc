"""What the request and response bodies of several route families share: inputs as
texts or token ids, content parts, usage, Cohere's meta block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from infinity.config import Priority

if TYPE_CHECKING:
    from infinity.client.engine_client import Result

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


# What the inputs are, in OpenAI-style and in Cohere's names: each picks the model's prompt
# for it (`infinity.api.prompts`).
InputType = Literal["query", "document", "search_query", "search_document", "classification", "clustering"]
INPUT_TYPE = Meta(description="What the inputs are: each gets the model's prompt for it where it has one (query; "
                              "document, else passage or corpus; classification; clustering), and a multi-vector "
                              "model encodes queries as queries, everything else as documents")


class ModelRequest(Struct, kw_only=True):
    """What every body that runs a model takes beside its own fields."""

    priority: Annotated[Priority, Meta(description="Lower is served first (as vLLM's); default: the API key's "
                                                   "(0 without keys)")] | UnsetType = UNSET


# How a request's inputs longer than the model are taken (infinity.api.long_inputs).
LongInputs = Annotated[Literal["truncate", "chunk", "error"], Meta(
    description="Inputs longer than the model: cut to its length (truncate), embedded in chunks whose vectors are "
                "averaged, weighted by their tokens (chunk), or refused (error, 422); none: as the model is set")]
ChunkOverlap = Annotated[int, Meta(ge=0, description="Tokens each chunk shares with the one before (none: the "
                                                     "model's chunk_overlap)")]


class PromptedRequest(ModelRequest, kw_only=True):
    """A body whose texts may have a prompt put before them (`infinity.api.prompts`)."""

    prompt_name: Annotated[str, Meta(description="The model's prompt of this name (its list is on /v1/models) "
                                                 "before each text")] | None = None
    prompt: Annotated[str, Meta(description="This text before each text (instead of a prompt_name)")] | None = None


class ImageUrl(Struct):
    url: str


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImagePart(Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class Usage(Struct):
    """Tokens the model processed (after truncation), and how many inputs were cut to its
    maximum length; where the request asked (`input_usage`), each input's tokens and the
    indices of those cut."""

    prompt_tokens: int
    total_tokens: int
    truncated_inputs: int
    input_tokens: list[int] | UnsetType = UNSET
    truncated_indices: list[int] | UnsetType = UNSET

    @classmethod
    def of(cls, result: Result, per_input: bool = False) -> Usage:
        """What a request whose outputs are `result` is billed, input by input if `per_input`."""
        each = (list(result.input_costs), sorted(result.cut)) if per_input else (UNSET, UNSET)
        return cls(result.prompt_tokens, result.prompt_tokens, result.truncated, *each)


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
