"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device, and turns a padded batch of token
ids into one float32 row per input: for an embedder the pooled (and, if the model says
so, normalised) vector, for a reranker or classifier the head's raw scores. A new engine
is one module in this package plus one line in `ENGINES`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from workers.models import ModelSpec


class Engine(Protocol):
    dim: int  # floats per input
    pad_id: int
    labels: list[str]  # a classifier's labels by output index; empty for embedders
    activation: str  # "sigmoid", "softmax" or "none": applied by the front end unless raw scores are asked

    def __init__(self, spec: ModelSpec, threads: int) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray) -> np.ndarray:
        """(n, longest) int64 ids, mask and token segments -> (n, dim) float32."""
        ...
