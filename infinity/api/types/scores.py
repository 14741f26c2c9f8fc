"""Bodies of the score routes: rerank (Cohere v1/v2, Jina) and classify."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from infinity.api.types.common import ChunkOverlap, CohereMeta, ModelRequest, TextOrTokens, Usage, _TEXT

Query = Annotated[Any, Meta(description="The query each document is scored against", extra_json_schema=_TEXT)]


Documents = Annotated[Any, Meta(
    description="The documents to score: texts, or objects whose `text` is the document; for a page-retrieval "
                "model, page images (data: URIs or URLs, or objects whose `content` is one image_url part)",
    extra_json_schema={"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "string"},
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        {"type": "object", "properties": {"content": {"type": "array", "minItems": 1, "maxItems": 1}},
         "required": ["content"]}]}})]


class RerankRequest(ModelRequest):
    """Cohere v1/v2 and Jina rerank bodies (their other fields are accepted and ignored);
    `max_chunks_per_doc` (Cohere v1's) and `chunk_overlap`: a cross-encoder or a multi-vector
    model of texts scores a document too long for it as its best chunk
    (`infinity.api.long_inputs`)."""

    query: Query
    documents: Documents
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0, description="Results to return, best first; 0 for all")] | None = None
    return_documents: bool = False
    raw_scores: bool = False
    max_chunks_per_doc: Annotated[int, Meta(ge=1, description=(
        "A document longer than fits beside the query is split into up to this many chunks, each scored with the "
        "query, and scores as its best (the result's chunk_index); 1: cut to fit; none: as the model is set"))] | None = None
    chunk_overlap: ChunkOverlap | None = None
    use_activation: Annotated[bool, Meta(description="vLLM's: false answers the logits, as raw_scores")] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "vLLM's: -1 (or none): pairs cut to the model's length; a count of tokens to keep is refused here"))] | None = None
    user: str | None = None


class ClassifyRequest(ModelRequest):
    """infinity's classify body, and vLLM's: a body holding any of vLLM's own fields
    (`use_activation`, `truncate_prompt_tokens`, `add_special_tokens`) is answered in
    vLLM's shape (`vllm_shaped`), any other in infinity's."""

    input: TextOrTokens
    model: str | None = None
    raw_scores: bool = False
    use_activation: Annotated[bool, Meta(description="vLLM's: false answers the logits, as raw_scores")] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description=(
        "vLLM's: -1 (or none): inputs cut to the model's length; a count of tokens to keep is refused here"))] | None = None
    add_special_tokens: Annotated[bool, Meta(description=(
        "vLLM's: false tokenizes texts without the model's special tokens"))] | None = None
    user: str | None = None

    @property
    def vllm_shaped(self) -> bool:
        return any(field is not None for field in (self.use_activation, self.truncate_prompt_tokens,
                                                   self.add_special_tokens))


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, kw_only=True):
    index: int  # of the document in the request
    relevance_score: float
    # With `return_documents`: Cohere's and Jina's object on /v1/rerank and /v2/rerank,
    # infinity's text on /rerank.
    document: RerankDocument | str | UnsetType = UNSET
    # Where documents were chunked: the chunk (from 0, in the document's order) that scored it.
    chunk_index: int | UnsetType = UNSET


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
