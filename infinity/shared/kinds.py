"""The one table of model kinds, and what each engine can compute.

A kind says what a model serves and how: the media it takes beside text, the raw output
its engine gives for each of them (`RawOutput`), the head that turns that into answers
(`workers.heads`), the preprocessor that makes its media (and, for some, its texts)
ready for the model (`workers.preprocess`), the folder reader that recognises its
folders and reads their settings (`infinity.folders`), the capabilities it serves (in
infinity's names, which `/v1/models` reports and the routes declare), and the traits
the rest of the server asks about. Everything that lists kinds derives from `KINDS`;
everything that asks which engine can serve a kind derives from `ENGINE_OUTPUTS`.

A new kind whose engine output already exists is its head, its folder reader, one entry
here and its tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal


class RawOutput(enum.StrEnum):
    """What an engine's forward pass returns, as a torch tensor on any device."""

    TOKEN_STATES = "token_states"  # (n, longest, hidden): the encoder's last hidden states
    SEQUENCE_LOGITS = "sequence_logits"  # (n, labels): a sequence-classification head's logits
    TOKEN_LOGITS = "token_logits"  # (n, longest, vocabulary): a masked-language-model head's logits
    TEXT_FEATURES = "text_features"  # (n, dim): a two-tower model's text tower, its projected pooled output
    IMAGE_FEATURES = "image_features"  # (n, dim): a two-tower model's vision tower, likewise
    AUDIO_FEATURES = "audio_features"  # (n, dim): a two-tower model's audio tower, likewise
    # (n, longest, dim): a retrieval model's own per-token vectors (ColPali's `embeddings`)
    RETRIEVAL_EMBEDDINGS = "retrieval_embeddings"


# What each raw output is, as an error that names an engine lacking it says.
RAW_OUTPUT_MEANING = {
    RawOutput.TOKEN_STATES: "an encoder's token states",
    RawOutput.SEQUENCE_LOGITS: "a sequence-classification head's logits",
    RawOutput.TOKEN_LOGITS: "the masked-language-model head a sparse model needs",
    RawOutput.TEXT_FEATURES: "a two-tower model's text tower",
    RawOutput.IMAGE_FEATURES: "a two-tower model's vision tower",
    RawOutput.AUDIO_FEATURES: "a two-tower model's audio tower",
    RawOutput.RETRIEVAL_EMBEDDINGS: "a page-retrieval model's vision-language model",
}

# What each engine computes. CTranslate2 converts encoders and their classification
# heads; ONNX Runtime and OpenVINO run what torch exports of text towers and vision towers.
_EXPORTED = frozenset({RawOutput.TOKEN_STATES, RawOutput.SEQUENCE_LOGITS, RawOutput.TOKEN_LOGITS,
                       RawOutput.TEXT_FEATURES, RawOutput.IMAGE_FEATURES})
ENGINE_OUTPUTS: dict[str, frozenset[RawOutput]] = {
    "torch": frozenset(RawOutput),
    "onnx": _EXPORTED,
    "ctranslate2": frozenset({RawOutput.TOKEN_STATES, RawOutput.SEQUENCE_LOGITS}),
    "openvino": _EXPORTED,
    # A static-embedding model's rows per token (sentence-transformers' StaticEmbedding).
    "static": frozenset({RawOutput.TOKEN_STATES}),
}
# The dtypes each engine takes (`dtype = "auto"` resolves to one of them); some only on some
# devices, which the engine checks at load: onnx int8 on CPUs and float16 on CUDA, openvino
# bfloat16 on CPUs that compute it natively.
ENGINE_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": ("float32", "float16", "bfloat16"),
    "onnx": ("float32", "float16", "int8"),
    "ctranslate2": ("float32", "float16", "int8", "int8_float16"),
    "openvino": ("float32", "bfloat16"),
    "static": ("float32",),
}
EngineName = Literal[tuple(ENGINE_OUTPUTS)]  # type: ignore[valid-type]


def dtype_refusal(engine: str, dtype: str) -> str | None:
    """Why `engine` cannot run `dtype` (`ENGINE_DTYPES`), or None."""
    if dtype in ENGINE_DTYPES[engine]:
        return None
    return f"the {engine} engine takes dtype {', '.join(ENGINE_DTYPES[engine])}; got {dtype}"


TEXT = "text"  # the medium every kind takes (a page-retrieval model's queries too)


@dataclass(frozen=True)
class KindSpec:
    """One model kind (see the module's docstring)."""

    name: str
    # Infinity's capability names: "embed", "sparse", "rerank", "classify", "image_embed", "audio_embed".
    capabilities: tuple[str, ...]
    # The raw output its engine gives for each medium it takes: "text", and "image" or "audio".
    outputs: dict[str, RawOutput]
    head: str  # "module:Class" of its head in `workers.heads`
    reader: str  # module of its folder reader in `infinity.folders`
    # Module in `workers.preprocess` that makes its media ready for the model (None: texts only).
    preprocessor: str | None = None
    # Its texts too go through that preprocessor (the model's own processor puts prompts
    # around a query), never through a plain tokenizer.
    text_by_processor: bool = False
    late_interaction: bool = False  # a vector per token, scored against another's by MaxSim
    # Its outputs vary in size by input (a vector per token, a sparse vector): they travel
    # with the request's answer, not in the arena.
    ragged: bool = False
    # Its outputs are vectors that can be held to float32's by cosine: `dtype = "auto"`
    # may try bfloat16 for it on CPUs that compute it natively (workers/inference/precision.py).
    bfloat16_trial: bool = False
    pairs: bool = False  # its inputs are query-document pairs, in the segments its encoder was trained on
    sparse: bool = False  # its vectors are sparse: indices and values over the vocabulary
    # Several outputs from one pass, by name (BGE-M3's "dense", "sparse" and "multivector"):
    # each request asks for one or more of them, the first when it names none.
    vector_types: tuple[str, ...] = ()
    # Its head gives an input's vector before the model's final Normalize where asked
    # (`protocol.UNNORMALIZED`: TEI's `normalize: false`, vLLM's `use_activation: false`).
    unnormalized: bool = False

    @property
    def medium(self) -> str | None:
        """The medium it takes beside text ("image", "audio"), or None."""
        return next((medium for medium in self.outputs if medium != TEXT), None)

    @property
    def raw_outputs(self) -> frozenset[RawOutput]:
        return frozenset(self.outputs.values())

    @property
    def prompted(self) -> bool:
        """Its texts may have a prompt put before them: it embeds texts its tokenizer
        encodes alone (not pairs, not through a processor that adds its own prompt)."""
        return bool({"embed", "sparse"} & set(self.capabilities)) and not (self.pairs or self.text_by_processor)

    @property
    def chunks_long_inputs(self) -> bool:
        """An input longer than the model may be chunked: its texts each give one dense
        vector (the chunks' vectors are averaged) or are documents paired with a query (a
        document scores as its best chunk)."""
        one_vector = "embed" in self.capabilities and not (self.ragged or self.vector_types or self.text_by_processor)
        return one_vector or self.pairs

    @property
    def chunks_documents(self) -> bool:
        """A document too long to rerank may be scored as its best chunk: a cross-encoder's
        (each chunk paired with the query) or a multi-vector model's text (each chunk's MaxSim)."""
        return self.pairs or (self.late_interaction and self.medium is None and not self.text_by_processor)


KINDS: dict[str, KindSpec] = {kind.name: kind for kind in (
    KindSpec("embed", ("embed",), {TEXT: RawOutput.TOKEN_STATES}, "workers.heads.pooled:PooledEmbedding",
             "infinity.folders.encoder", bfloat16_trial=True, unnormalized=True),
    KindSpec("rerank", ("rerank",), {TEXT: RawOutput.SEQUENCE_LOGITS}, "workers.heads.scores:RelevanceScores",
             "infinity.folders.sequence_classification", pairs=True),
    KindSpec("classify", ("classify",), {TEXT: RawOutput.SEQUENCE_LOGITS}, "workers.heads.scores:ClassScores",
             "infinity.folders.sequence_classification"),
    KindSpec("multivector", ("embed", "rerank"), {TEXT: RawOutput.TOKEN_STATES},
             "workers.heads.multivector:TokenVectors", "infinity.folders.multivector", late_interaction=True,
             ragged=True, bfloat16_trial=True),
    KindSpec("sparse", ("sparse",), {TEXT: RawOutput.TOKEN_LOGITS}, "workers.heads.sparse:SparseWeights",
             "infinity.folders.sparse", ragged=True, sparse=True),
    KindSpec("hybrid", ("embed", "sparse", "rerank"), {TEXT: RawOutput.TOKEN_STATES},
             "workers.heads.hybrid:HybridVectors", "infinity.folders.hybrid", ragged=True,
             vector_types=("dense", "sparse", "multivector")),
    KindSpec("image_text", ("embed", "image_embed"),
             {TEXT: RawOutput.TEXT_FEATURES, "image": RawOutput.IMAGE_FEATURES},
             "workers.heads.two_tower:TowerEmbedding", "infinity.folders.two_tower", "workers.preprocess.image",
             bfloat16_trial=True),
    KindSpec("audio_text", ("embed", "audio_embed"),
             {TEXT: RawOutput.TEXT_FEATURES, "audio": RawOutput.AUDIO_FEATURES},
             "workers.heads.two_tower:TowerEmbedding", "infinity.folders.two_tower", "workers.preprocess.audio",
             bfloat16_trial=True),
    KindSpec("image_multivector", ("embed", "image_embed", "rerank"),
             {TEXT: RawOutput.RETRIEVAL_EMBEDDINGS, "image": RawOutput.RETRIEVAL_EMBEDDINGS},
             "workers.heads.multivector:RetrievalTokenVectors", "infinity.folders.page_retrieval",
             "workers.preprocess.page", text_by_processor=True, late_interaction=True, ragged=True,
             bfloat16_trial=True),
)}
Kind = Literal[tuple(KINDS)]  # type: ignore[valid-type]
MEDIA = tuple(dict.fromkeys(kind.medium for kind in KINDS.values() if kind.medium))


def kinds_with(predicate: Callable[[KindSpec], bool]) -> tuple[str, ...]:
    """The names of the kinds `predicate` holds for, in table order."""
    return tuple(name for name, kind in KINDS.items() if predicate(kind))


def lacking(engine: str, outputs: Mapping[str, RawOutput]) -> list[RawOutput]:
    """Of `outputs` (a kind's, by medium), those `engine` does not compute, media's first."""
    media_first = sorted(outputs.items(), key=lambda item: item[0] == TEXT)
    return list(dict.fromkeys(output for _, output in media_first if output not in ENGINE_OUTPUTS[engine]))
