"""Bodies of vLLM's own pooling routes: `/score`, in its older form (`text_1`, `text_2`)
and its newer (`queries`, `documents`), and `/pooling`; vLLM's answer of `/classify`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from infinity.api.types.common import ModelRequest, TextOrTokens, Usage

Side = Annotated[Any, Meta(description="A text or a list of texts", extra_json_schema={"anyOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]})]


class ScoreRequest(ModelRequest):
    """vLLM's score body: one text against many, or pairs one to one, from `text_1` and
    `text_2` or from `queries` and `documents`. A reranker scores each pair; an embedder
    the cosine of the two texts' vectors. `use_activation` false: a reranker's logits."""

    model: str | None = None
    text_1: Side | None = None
    text_2: Side | None = None
    queries: Side | None = None
    documents: Side | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "-1 (or none): inputs cut to the model's length; a count of tokens to keep is refused here"))] | None = None
    max_tokens_per_query: Annotated[int, Meta(ge=0, description="0 only: queries are cut to the model's length")] = 0
    max_tokens_per_doc: Annotated[int, Meta(ge=0, description="0 only: documents are cut to the model's length")] = 0
    user: str | None = None


class ScoreData(Struct):
    index: int
    score: float
    object: Literal["score"] = "score"


class VllmList(Struct, kw_only=True):
    """The envelope of vLLM's answers of a list: its items in each answer's `data`."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: Usage


class ScoreResponse(VllmList, kw_only=True):
    data: list[ScoreData]


class PoolingRequest(ModelRequest):
    """vLLM's pooling body: each input's pooled output, by the model's task (`task`, none:
    the model's): an embedder's vector ("embed"), a classifier's probabilities or, with
    `use_activation` false, its logits ("classify")."""

    input: TextOrTokens
    model: str | None = None
    task: Literal["embed", "classify"] | None = None
    encoding_format: Literal["float"] = "float"
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "-1 (or none): inputs cut to the model's length; a count of tokens to keep is refused here"))] | None = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "false tokenizes texts without the model's special tokens"))] | None = None
    user: str | None = None


class PoolingData(Struct):
    index: int
    data: list[float]
    object: Literal["pooling"] = "pooling"


class PoolingResponse(VllmList, kw_only=True):
    data: list[PoolingData]


class VllmClassData(Struct):
    """An input's classes as vLLM answers them: its most likely label and every class's
    probability (or logit), in label order."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class VllmClassifyResponse(VllmList, kw_only=True):
    data: list[VllmClassData]
