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
from safetensors import safe_open

from infinity.shared.protocol import ModelSpec


class TokenVectors:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.labels: list[str] = []
        self._projection = _projection(Path(spec.projection)) if spec.projection else None
        self.dim = int(config["hidden_size"]) if self._projection is None else self._projection.out_features
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
    return linear_layer(_linear_weights(folder))


def linear_layer(weights: dict[str, torch.Tensor]) -> torch.nn.Linear:
    """The linear layer of a state dict (`weight`, and `bias` if any), for inference."""
    out_features, in_features = weights["weight"].shape
    layer = torch.nn.Linear(in_features, out_features, bias="bias" in weights)
    layer.load_state_dict(weights)
    return layer.eval()


def _linear_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
            return {key.removeprefix("linear."): weights.get_tensor(key).float()
                    for key in weights.keys() if key.startswith("linear.")}
    weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {key.removeprefix("linear."): value.float() for key, value in weights.items() if key.startswith("linear.")}
