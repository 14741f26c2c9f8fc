"""The embedding head (`kind = "embed"`): token states run through the model's modules
after its encoder (`workers.heads.chain`: pooling, then Dense, LayerNorm and Normalize as
its folder orders them), one float32 vector per input."""

from __future__ import annotations

import numpy as np
import torch

from infinity.shared.protocol import PLAIN_MEANS, ModelSpec, NormalizeStep
from workers.engines.base import hidden_width
from workers.heads.chain import ModuleChain, pooled_steps


class PooledEmbedding:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        steps = pooled_steps(spec)
        self._chain = ModuleChain(steps, hidden_width(spec))
        self.dim = self._chain.dim
        self.labels: list[str] = []
        # The mean alone, normalised or not, runs in numpy (`mean_rows`) on float32 CPU states.
        self._plain_mean = steps in PLAIN_MEANS
        self._normalize = steps[-1] == NormalizeStep()

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor, normalized: bool = True) -> np.ndarray:
        if self._plain_mean and raw.dtype == torch.float32 and raw.device.type == "cpu":
            return mean_rows(raw.numpy(), mask.numpy(), self._normalize and normalized)
        return self._chain(raw, mask, normalized).cpu().numpy()


def mean_rows(hidden: np.ndarray, mask: np.ndarray, normalize: bool) -> np.ndarray:
    """Mean pooling of float32 states on the CPU, L2-normalised if asked, in numpy: one sum
    of products and two divisions, where torch pays its dispatch on a dozen small
    operations: a third of the time or less, on small batches and large
    (bench/results/serving-path.md#the-mean-in-numpy-and-batches-kept-whole-on-busy-cores).

    `einsum` adds each row's tokens in order, so an input's vector is the same to the bit
    whatever its batch mates and padding; a matrix product would not be (BLAS blocks the
    sum by the padded length)."""
    weights = mask.astype(np.float32)
    vectors = np.einsum("nl,nld->nd", weights, hidden)
    vectors /= np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)
    if normalize:
        # torch.nn.functional.normalize's rule: divided by the norm, or by 1e-12 if smaller;
        # the norm as np.linalg.norm computes it along an axis, without its checks.
        vectors /= np.maximum(np.sqrt(np.add.reduce(vectors * vectors, axis=1, keepdims=True)), 1e-12)
    return vectors
