"""Pooling of token embeddings into one vector per input (torch tensors, right padding)."""

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
