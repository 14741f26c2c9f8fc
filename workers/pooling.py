"""Pooling of token embeddings into one vector per input (torch tensors, right padding),
and the embedding an engine returns: pooled, in float32, normalised if the model says so."""

from __future__ import annotations

import torch


def pool(mode: str, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L, d) token embeddings, (n, L) mask -> (n, d)."""
    if mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = attention_mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0]), last]
    raise ValueError(f"unknown pooling {mode!r}")


def embedding(mode: str, normalize: bool, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L, d) token embeddings, (n, L) mask -> (n, d) float32 embeddings."""
    vectors = pool(mode, hidden, attention_mask).float()
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if normalize else vectors
