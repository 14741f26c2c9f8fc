"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device and the raw output its model's kind
asks for each medium (`infinity.shared.kinds.RawOutput`: "text", and "image" or "audio"
for a model that sees or hears), and turns a padded batch of token ids (`forward`) or a
batch of media features (`forward_media`) into that output: the encoder's token states,
a head's logits, a tower's projected vector, a retrieval model's vectors per token. What
a model kind makes of it (pooling, normalisation, scores, sparse vectors) is the head's
(`workers.heads`): no engine knows the kinds. A new engine is one module in this package,
one line in `ENGINES`, and its outputs and dtypes in `infinity.shared.kinds.ENGINE_OUTPUTS`
and `ENGINE_DTYPES`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infinity.shared.folders import STATIC_FAMILY
from infinity.shared.kinds import RawOutput
from infinity.shared.protocol import ModelSpec


def auto_class(output: RawOutput, spec: ModelSpec) -> type:
    """The transformers class whose model gives `output` (a model's text output: the
    same class gives its media outputs): an auto class, or for retrieval models (which
    have none) the folder's own architecture."""
    import transformers

    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return getattr(transformers, model_config(spec)["architectures"][0])
    if output is RawOutput.TOKEN_STATES and _encoder_alone(model_config(spec).get("model_type")):
        return transformers.AutoModelForTextEncoding
    return {RawOutput.SEQUENCE_LOGITS: transformers.AutoModelForSequenceClassification,
            RawOutput.TOKEN_LOGITS: transformers.AutoModelForMaskedLM}.get(output, transformers.AutoModel)


def _encoder_alone(family: str | None) -> bool:
    """Whether transformers' encoder of `family` is a part of its base model: an
    encoder-decoder's (T5: sentence-T5, GTR), whose token states are its encoder's, the
    decoder neither loaded nor run."""
    from transformers.models.auto import modeling_auto

    encoder = modeling_auto.MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES.get(family)
    return encoder is not None and encoder != modeling_auto.MODEL_MAPPING_NAMES.get(family)


# A two-tower model's towers, by the output they give: transformers 5 returns an output
# object whose pooler output is the projected vector.
_TOWERS = {RawOutput.TEXT_FEATURES: "get_text_features", RawOutput.IMAGE_FEATURES: "get_image_features",
           RawOutput.AUDIO_FEATURES: "get_audio_features"}


def model_output(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], output: RawOutput) -> torch.Tensor:
    """Run a model of `auto_class` on `inputs` (named as its forward or tower takes them);
    return its `output`."""
    if output in _TOWERS:
        return getattr(model, _TOWERS[output])(**inputs).pooler_output
    result = model(**inputs)
    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return result.embeddings
    return result.last_hidden_state if output is RawOutput.TOKEN_STATES else result.logits


class Engine(Protocol):
    name: str  # its key in `ENGINES`
    pad_id: int
    # Forward passes it runs at once, from as many threads: on a CPU an engine may run one
    # single-threaded pass per core instead of one pass on all of them: the inference
    # process then runs a lane per pass (workers/inference/scheduler.py).
    lanes: int
    # Whether it can also run a pass on all its threads at once (`forward(wide=True)`), for
    # a lone input while the other lanes are idle, kept only where that pass measured
    # faster at start (`wide_copy_pays`).
    widens: bool
    # Whether it can run one more pass beside its lanes, on one thread, for a small
    # request while every lane runs a long pass (the express lane, workers/inference/scheduler.py),
    # without slowing its lanes when idle.
    express: bool
    # Whether its passes run on the torch threads of the thread that calls it (the torch
    # engine on a CPU): then the inference process can run several single-threaded media
    # passes at once, where that measures faster than one pass on every thread.
    on_caller_threads: bool

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        """`outputs`: the raw output to give for each medium the model takes (`TEXT` always)."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        """(n, longest) int64 ids, mask and token segments -> the text's raw output;
        `wide`: on every thread (only asked of an engine that `widens`); `express`: on the
        express lane (only asked of an engine with one)."""
        ...

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        """A batch of media items, arrays named as the model's inputs (as the medium's
        preprocessor collates them) -> the medium's raw output. Only asked of an engine
        that computes it (`infinity.shared.kinds.ENGINE_OUTPUTS`)."""
        ...


def model_config(spec: ModelSpec) -> dict:
    """The model's transformers config.json."""
    return json.loads((Path(spec.path) / "config.json").read_text())


def hidden_width(spec: ModelSpec) -> int:
    """The width of the model's token states (its text model's), as transformers reads its
    config: whatever key the family names it by (DistilBERT's `dim`, T5's `d_model`)."""
    written = model_config(spec)
    if written.get("model_type") == STATIC_FAMILY:  # a config the server wrote, not transformers'
        return int(written["hidden_size"])
    if isinstance(written.get("hidden_size"), int) and not any(
            key.endswith("_config") for key, value in written.items() if isinstance(value, dict)):
        # A config of one model (no sub-model's config) naming the width as transformers
        # names it: read as is, without importing transformers (a second of every start).
        return written["hidden_size"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    return int(config.get_text_config().hidden_size)


def pad_id(spec: ModelSpec) -> int:
    return int(model_config(spec).get("pad_token_id") or 0)
