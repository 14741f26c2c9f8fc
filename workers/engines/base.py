"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device, and turns a padded batch of token
ids into one float32 row per input (pooled and, if the model says so, normalised).
A new engine is one module in this package plus one line in `ENGINES`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from workers.models import ModelSpec


class Engine(Protocol):
    dim: int
    vocab_size: int
    pad_id: int

    def __init__(self, spec: ModelSpec, threads: int) -> None: ...

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """(n, longest) int64 ids and mask -> (n, dim) float32 vectors."""
        ...
