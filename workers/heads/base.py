"""The head interface: what one model kind makes of an engine's raw output."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec
from workers.engines.base import RawOutput


class Head(Protocol):
    output: RawOutput  # what it needs from the engine
    dim: int  # floats per input it returns (per token for a multi-vector head; a sparse head's vocabulary size)
    labels: list[str]  # a classifier's labels by output index; empty for embedders
    activation: str  # "sigmoid", "softmax" or "none": applied by the front end unless raw scores are asked
    # Whether its outputs vary in size by input: then it returns one array per input (a
    # vector per token, a sparse vector's entries), sent to the front end with the
    # request's `Done`; else one (n, dim) float32 array, written into the arena.
    ragged: bool

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        """`config`: the model's transformers config.json."""

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> np.ndarray | list[np.ndarray]:
        """The engine's raw output of a batch and the (n, longest) mask of the tokens to
        read (the attention mask, unless inputs hold tokens the encoder does not attend to
        but whose states count, or tokens left out), on the same device -> (n, dim)
        float32, one row per input; if `ragged`, one array per input."""
        ...
