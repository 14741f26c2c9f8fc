"""The hybrid head (`kind = "hybrid"`, BGE-M3): three outputs from the token states of one
pass, as FlagEmbedding's BGE-M3 model computes them (`_dense_embedding`,
`_sparse_embedding`, `_colbert_embedding`), each input given those its request asks for:

- "dense": the pooled state (the first token's), L2-normalised: (hidden,) float32;
- "sparse": relu(sparse_linear(state)) of each token, the largest per token id, without
  the tokenizer's cls, eos, pad and unk tokens: the nonzero weights by index, as `ENTRY`
  records (what a SPLADE model's head gives);
- "multivector": colbert_linear over the states of the tokens after the first,
  L2-normalised: (tokens - 1, width) float32 (what a multi-vector model's head gives).

A type is computed over the whole batch when any input of it asks for it: a request asks
the same types of all its inputs, and requests asking different ones rarely share a batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from infinity.shared.folders import COLBERT_LINEAR, SPARSE_LINEAR, special_token
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec
from workers.heads.chain import linear_layer
from workers.heads.multivector import read_rows
from workers.heads.pooled import PooledEmbedding
from workers.heads.sparse import entries_of

# The special tokens FlagEmbedding leaves out of the sparse weights.
UNWEIGHTED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


class HybridVectors:
    activation = "none"
    vector_types = KINDS["hybrid"].vector_types

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        folder = Path(spec.path)
        self.labels: list[str] = []
        self._dense = PooledEmbedding(spec, config)
        self.dim = self._dense.dim  # the dense vector's; the multi-vector width may differ
        self._sparse_linear = _linear(folder / SPARSE_LINEAR, self.dim, out_features=1)
        self._colbert_linear = _linear(folder / COLBERT_LINEAR, self.dim)
        self._normalize = spec.normalize
        self._unweighted = _unweighted_ids(folder)
        self._outputs: dict[str, Callable[[torch.Tensor, torch.Tensor, np.ndarray], list[np.ndarray]]] = {
            "dense": self._dense_vectors, "sparse": self._sparse_weights, "multivector": self._token_vectors}

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor, input_ids: np.ndarray,
                 wanted: list[tuple[str, ...]]) -> list[dict[str, np.ndarray]]:
        asked = dict.fromkeys(vector_type for types in wanted for vector_type in types)
        computed = {vector_type: self._outputs[vector_type](raw, mask, input_ids) for vector_type in asked}
        return [{vector_type: computed[vector_type][row] for vector_type in types} for row, types in enumerate(wanted)]

    def _dense_vectors(self, states: torch.Tensor, mask: torch.Tensor, input_ids: np.ndarray) -> list[np.ndarray]:
        return list(self._dense(states, mask))

    def _sparse_weights(self, states: torch.Tensor, mask: torch.Tensor, input_ids: np.ndarray) -> list[np.ndarray]:
        weights = torch.relu(self._sparse_linear.to(states.device)(states.float())).squeeze(-1).cpu().numpy()
        read = mask.bool().cpu().numpy() & (weights > 0) & ~np.isin(input_ids, self._unweighted)
        return [_largest_per_id(input_ids[row, read[row]], weights[row, read[row]]) for row in range(len(weights))]

    def _token_vectors(self, states: torch.Tensor, mask: torch.Tensor, input_ids: np.ndarray) -> list[np.ndarray]:
        vectors = self._colbert_linear.to(states.device)(states[:, 1:].float())
        if self._normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        return read_rows(vectors, mask[:, 1:])


def _largest_per_id(ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each token id's largest weight, by id, as `ENTRY` records."""
    unique, position = np.unique(ids, return_inverse=True)
    largest = np.zeros(len(unique), np.float32)
    np.maximum.at(largest, position, weights)
    return entries_of(unique, largest)


def _linear(path: Path, in_features: int, out_features: int | None = None) -> torch.nn.Linear:
    """The linear layer saved at `path` (a state dict), checked against the encoder's width
    (and the output width it must have) so that a mismatch stops the start, not a request."""
    layer = linear_layer({key: value.float() for key, value in
                          torch.load(path, map_location="cpu", weights_only=True).items()})
    if layer.in_features != in_features or out_features not in (None, layer.out_features):
        raise ValueError(f"{path} maps {layer.in_features} features to {layer.out_features}; the encoder gives "
                         f"{in_features}" + (f" and it must give {out_features}" if out_features else ""))
    return layer


def _unweighted_ids(folder: Path) -> np.ndarray:
    """The ids of the special tokens left out of the sparse weights (`UNWEIGHTED_TOKENS`)
    that the tokenizer names and has."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = (tokenizer.token_to_id(token) for token in (special_token(folder, key) for key in UNWEIGHTED_TOKENS)
           if token is not None)
    return np.array(sorted({token_id for token_id in ids if token_id is not None}), dtype=np.int64)
