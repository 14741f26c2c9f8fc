"""Bodies and answers of TEI's (text-embeddings-inference) native routes as TEI documents
them: `/embed`, `/embed_all`, `/rerank`, `/predict`, `/similarity`, `/decode`, `/info`
(its error shape, `TEIErrorResponse`, is with ours in `infinity.api.errors`). TEI serves
one model, so none of its bodies names one (see `infinity.api.routes.tei` for how a
request finds its model)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, NewType

from msgspec import UNSET, Meta, Struct, UnsetType

from infinity.api.errors import TEIErrorResponse, tei_error_body
from infinity.api.types.common import ModelRequest, TextOrTokens, _TEXT
from infinity.api.types.tokens import TokenIds

Truncate = Annotated[bool, Meta(description="true: inputs longer than the model are cut; false: refused (422); "
                                            "none: as the model is set")]
TruncationDirection = Annotated[Literal["Right", "right", "Left", "left"], Meta(
    description="Which end of a long input is cut: its end (Right) or its start (Left: the last tokens kept; not for "
                "rerank pairs, nor after a prompt)")]


class TEIRequest(ModelRequest, kw_only=True):
    """A TEI body: its errors are answered in TEI's shape (`{"error", "error_type"}`)."""

    error_body: ClassVar = staticmethod(tei_error_body)


class TEIEmbedRequest(TEIRequest, kw_only=True):
    inputs: TextOrTokens
    normalize: Annotated[bool, Meta(description="L2-normalised vectors (true), or the model's vector before its "
                                                "final Normalize (false: served where the chain has none)")] = True
    truncate: Truncate | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: Annotated[str, Meta(description="The model's prompt of this name before each text")] | None = None
    dimensions: Annotated[int, Meta(ge=1, description="Keep this many leading dimensions (Matryoshka)")] | None = None


class TEIEmbedAllRequest(TEIRequest, kw_only=True):
    inputs: TextOrTokens
    truncate: Truncate | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: Annotated[str, Meta(description="The model's prompt of this name before each text")] | None = None


class TEIRerankRequest(TEIRequest, kw_only=True):
    query: Annotated[Any, Meta(extra_json_schema=_TEXT)]
    texts: Annotated[list[str], Meta(min_length=1)]
    raw_scores: bool = False
    return_text: bool = False
    truncate: Truncate | None = None
    truncation_direction: TruncationDirection = "Right"


class TEIRerankResult(Struct, kw_only=True):
    index: int
    score: float
    text: str | UnsetType = UNSET  # with `return_text`


PredictInputs = Annotated[Any, Meta(
    description="A text, a pair (a list of two texts, classified together), or a batch: a list of texts and of "
                "one- or two-text lists",
    extra_json_schema={"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": {"anyOf": [
        _TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 2}]}}]})]


class TEIPredictRequest(TEIRequest, kw_only=True):
    inputs: PredictInputs
    raw_scores: bool = False
    truncate: Truncate | None = None
    truncation_direction: TruncationDirection = "Right"
    # The HF inference form's (huggingface_hub's text_classification sends an empty one).
    parameters: Annotated[dict[str, Any], Meta(description=(
        "The HF inference form's parameters: empty only (function_to_apply and top_k are refused: use raw_scores; "
        "every label is answered)"))] | None = None


class TEIPrediction(Struct):
    score: float
    label: str


class SimilarityInputs(Struct):
    source_sentence: Annotated[str, Meta(min_length=1)]
    sentences: Annotated[list[str], Meta(min_length=1)]


class SimilarityParameters(Struct, kw_only=True):
    truncate: Truncate | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: str | None = None


class TEISimilarityRequest(TEIRequest, kw_only=True):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class TEIDecodeRequest(TEIRequest, kw_only=True):
    ids: TokenIds
    skip_special_tokens: bool = True


class TEIInfo(Struct, kw_only=True):
    """What TEI's `/info` says of the model that `POST /` serves."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_type: dict[str, dict[str, Any]]  # {"embedding": {pooling}}, {"classifier"|"reranker": {id2label, label2id}}
    served_model_name: str
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None


TEIEmbedResponse = NewType("TEIEmbedResponse", list[list[float]])
TEIEmbedAllResponse = NewType("TEIEmbedAllResponse", list[list[list[float]]])  # per input, per token
TEIRerankResponse = NewType("TEIRerankResponse", list[TEIRerankResult])
TEIPredictions = NewType("TEIPredictions", list[TEIPrediction])  # one input's, best first
TEIPredictionBatch = NewType("TEIPredictionBatch", list[list[TEIPrediction]])
SimilarityResponse = NewType("SimilarityResponse", list[float])
DecodeResponse = NewType("DecodeResponse", list[str])
