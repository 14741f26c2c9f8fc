"""The sparse head (`kind = "sparse"`, SPLADE): a masked-language-model head's logits per
token turned into one weight per vocabulary entry, as sentence-transformers' SpladePooling
does it: log(1 + relu(x)) (and log(1 + ...) once more for "log1p_relu"), then the max or
the sum over the input's real tokens. Each input gives its nonzero weights, sorted by
index, as records of an exact int32 index and a float32 value (`ENTRY`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec
from workers.heads.chain import module_weights

ENTRY = np.dtype([("index", "<i4"), ("value", "<f4")])


class SparseWeights:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.dim = int(config["vocab_size"])
        self.labels: list[str] = []
        self._pooling = spec.pooling
        self._twice = spec.sparse_activation == "log1p_relu"
        # An inference-free model's weight per vocabulary entry for its queries.
        self._query_weights = (None if spec.query_weights is None
                               else module_weights(Path(spec.query_weights))["weight"].numpy())
        if self._query_weights is not None and len(self._query_weights) != self.dim:
            raise ValueError(f"{spec.query_weights}: {len(self._query_weights)} query weights for a vocabulary of "
                             f"{self.dim}")

    def route_queries(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
        """Queries of an inference-free model, weighed as sentence-transformers'
        SparseStaticEmbedding weighs them: each vocabulary entry a query holds (once or
        more) has its weight, the others none; (n, longest) ids and mask, right-padded."""
        assert self._query_weights is not None, "a model without a static query side"
        entries = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            held = np.unique(ids[mask.astype(bool)])
            weights = self._query_weights[held]
            entries.append(entries_of(held[weights != 0], weights[weights != 0]))
        return entries

    def __call__(self, raw: torch.Tensor, attention_mask: torch.Tensor) -> list[np.ndarray]:
        lengths = attention_mask.sum(dim=1).tolist()
        # One input at a time, its real tokens only (right padding): the logits are the
        # largest tensor of the pass (tokens x vocabulary), and no activated copy of them
        # all is ever made.
        weights = torch.stack([self._pool(raw[row, :length]) for row, length in enumerate(lengths)])
        return [_nonzero_entries(row) for row in weights.float().cpu().numpy()]

    def _pool(self, logits: torch.Tensor) -> torch.Tensor:
        """(tokens, vocabulary) logits of one input -> (vocabulary,) weights."""
        if self._pooling == "max":
            # relu and log1p never decrease: the max of the activated logits is the
            # activated max, so one vector is activated instead of every token's.
            return self._activate(logits.amax(dim=0))
        return self._activate(logits).sum(dim=0)

    def _activate(self, logits: torch.Tensor) -> torch.Tensor:
        weights = torch.log1p(torch.relu(logits))
        return torch.log1p(weights) if self._twice else weights


def _nonzero_entries(weights: np.ndarray) -> np.ndarray:
    """A (vocabulary,) weight vector's nonzero entries, by index, as `ENTRY` records."""
    indices = np.flatnonzero(weights)
    return entries_of(indices, weights[indices])


def entries_of(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Indices and their values as `ENTRY` records, in the order given."""
    entries = np.empty(len(indices), ENTRY)
    entries["index"] = indices
    entries["value"] = values
    return entries
