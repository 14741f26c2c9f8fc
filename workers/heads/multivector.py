"""Multi-vector heads (late interaction): each input gives an (n_tokens, dim) float32
array, a row per token it is given to read (real tokens and query-expansion tokens, not
padding nor skipped tokens). ColBERT-style models (`kind = "multivector"`): the encoder's
token states, projected by the model's Dense layer where it has one, L2-normalised if
the model says so. Page-retrieval models (`kind = "image_multivector"`, ColPali): the
model's own per-token vectors, already projected and normalised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec
from workers.engines.base import hidden_width
from workers.heads.chain import linear_layer, module_weights, prefixed


class TokenVectors:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.labels: list[str] = []
        self._projection = _projection(Path(spec.projection)) if spec.projection else None
        self.dim = hidden_width(spec) if self._projection is None else self._projection.out_features
        self._normalize = spec.normalize

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
        states = raw.float()
        if self._projection is not None:
            states = self._projection.to(states.device)(states)
        if self._normalize:
            states = torch.nn.functional.normalize(states, p=2, dim=-1)
        return read_rows(states, mask)


class RetrievalTokenVectors:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.labels: list[str] = []
        self.dim = int(config["embedding_dim"])

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
        return read_rows(raw.float(), mask)


def read_rows(vectors: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Each input's rows of `vectors` (n, longest, dim) where `mask` (n, longest) is set."""
    values, read = vectors.cpu().numpy(), mask.bool().cpu().numpy()
    return [values[row, read[row]] for row in range(len(values))]


def _projection(folder: Path) -> torch.nn.Linear:
    """The linear layer (`linear.weight`, `linear.bias` if any) among the weights in
    `folder`: a sentence-transformers Dense module's (its activation, checked at start,
    is the identity) or a Stanford ColBERT checkpoint's own."""
    return linear_layer(prefixed(module_weights(folder), "linear."))
