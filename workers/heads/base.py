"""The head interface: what one model kind makes of an engine's raw output."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec


class Head(Protocol):
    """Built for one model (its spec and transformers config); its kind's entry in the
    kinds table says what raw output the engine gives it and whether its outputs vary in
    size by input (`ragged`: one array per input, sent with the request's `Done`; else one
    (n, dim) float32 array, written into the arena)."""

    dim: int  # floats per input it returns (per token for a multi-vector head; a sparse head's vocabulary size)
    labels: list[str]  # a classifier's labels by output index; empty for embedders
    activation: str  # "sigmoid", "softmax" or "none": applied by the front end unless raw scores are asked

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        """`config`: the model's transformers config.json."""

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> np.ndarray | list[np.ndarray]:
        """The engine's raw output of a batch and the (n, longest) mask of the tokens to
        read (the attention mask, unless inputs hold tokens the encoder does not attend to
        but whose states count, or tokens left out), on the same device -> (n, dim)
        float32, one row per input; for a ragged kind, one array per input."""
        ...


class TypedHead(Head, Protocol):
    """The head of a kind with several outputs from one pass (`KindSpec.vector_types`):
    called with the batch's token ids and each input's wanted types as well, it gives each
    input a dict of those types' arrays."""

    vector_types: tuple[str, ...]  # every type it computes, by name

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor, input_ids: np.ndarray,  # type: ignore[override]
                 wanted: list[tuple[str, ...]]) -> list[dict[str, np.ndarray]]:
        """As `Head.__call__`, with the (n, longest) ids of the inputs (right-padded) and
        the types each input's request asks for."""
        ...


class NormalizingHead(Head, Protocol):
    """The head of a kind whose vectors may be asked for before the model's final
    Normalize (`KindSpec.unnormalized`, `protocol.UNNORMALIZED`)."""

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor, normalized: bool = True) -> np.ndarray:
        """As `Head.__call__`; `normalized` false: each vector before the model's final
        Normalize (as it is where the model ends with none)."""
        ...
