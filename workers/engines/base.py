"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device and the raw output the model's head
asks for (`RawOutput`), and turns a padded batch of token ids into that output: the
encoder's token states, a sequence-classification head's logits, or a masked-language-
model head's logits per token. What a model kind makes of it (pooling, normalisation,
scores, sparse vectors) is the head's (`workers.heads`): no engine knows the kinds. A
new engine is one module in this package plus one line in `ENGINES`.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec


class RawOutput(enum.StrEnum):
    """What an engine's forward pass returns, as a torch tensor on any device."""

    TOKEN_STATES = "token_states"  # (n, longest, hidden): the encoder's last hidden states
    SEQUENCE_LOGITS = "sequence_logits"  # (n, labels): a sequence-classification head's logits
    TOKEN_LOGITS = "token_logits"  # (n, longest, vocabulary): a masked-language-model head's logits
    # (n, dim): a two-tower (image-text) model's text tower, its projected pooled output
    TEXT_FEATURES = "text_features"
    # (n, longest, dim): a retrieval model's own per-token vectors (ColPali's `embeddings`)
    RETRIEVAL_EMBEDDINGS = "retrieval_embeddings"


def auto_class(output: RawOutput, spec: ModelSpec) -> type:
    """The transformers class whose model gives `output`: an auto class, or for retrieval
    models (which have none) the folder's own architecture."""
    import transformers

    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return getattr(transformers, model_config(spec)["architectures"][0])
    return {RawOutput.TOKEN_STATES: transformers.AutoModel,
            RawOutput.SEQUENCE_LOGITS: transformers.AutoModelForSequenceClassification,
            RawOutput.TOKEN_LOGITS: transformers.AutoModelForMaskedLM,
            RawOutput.TEXT_FEATURES: transformers.AutoModel}[output]


def model_output(model: torch.nn.Module, inputs: dict[str, torch.Tensor], output: RawOutput) -> torch.Tensor:
    """Run a model of `auto_class(output, spec)` on `inputs`; return its `output`."""
    if output is RawOutput.TEXT_FEATURES:
        # transformers 5 returns an output object; the projected vector is its pooler output.
        return model.get_text_features(**inputs).pooler_output
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

    def __init__(self, spec: ModelSpec, threads: int, output: RawOutput) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        """(n, longest) int64 ids, mask and token segments -> the engine's `RawOutput`;
        `wide`: on every thread (only asked of an engine that `widens`); `express`: on the
        express lane (only asked of an engine with one)."""
        ...


def model_config(spec: ModelSpec) -> dict:
    """The model's transformers config.json."""
    return json.loads((Path(spec.path) / "config.json").read_text())


def pad_id(spec: ModelSpec) -> int:
    return int(model_config(spec).get("pad_token_id") or 0)
