"""The embedding head (`kind = "embed"`): token states pooled into one vector per input
(mean, first token or last token, right padding), in float32, L2-normalised if the model
says so."""

from __future__ import annotations

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec


def pool(mode: str, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L, d) token states, (n, L) mask of the tokens read -> (n, d). The mask is the
    attention mask (right padding), less a prompt's tokens where the model leaves them out
    of pooling: "cls" takes the first token read, "lasttoken" the last, as
    sentence-transformers' Pooling does."""
    if mode == "mean":
        # Summed into float32: a reduced-precision sum would round every pooled vector to
        # 8 bits of mantissa (float32 states give the same bits as before).
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(dim=1, dtype=torch.float32) / mask.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "cls":
        return hidden[rows, attention_mask.argmax(dim=1)]
    if mode == "lasttoken":
        return hidden[rows, attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(dim=1)]
    raise ValueError(f"unknown pooling {mode!r}")


class PooledEmbedding:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.dim = int(config["hidden_size"])
        self.labels: list[str] = []
        self._pooling = spec.pooling
        self._normalize = spec.normalize

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        if self._pooling == "mean" and raw.dtype == torch.float32 and raw.device.type == "cpu":
            return mean_rows(raw.numpy(), mask.numpy(), self._normalize)
        vectors = pool(self._pooling, raw, mask).float()
        if self._normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.cpu().numpy()


def mean_rows(hidden: np.ndarray, mask: np.ndarray, normalize: bool) -> np.ndarray:
    """`pool("mean", ...)` of float32 states on the CPU, L2-normalised if asked, in numpy:
    one sum of products and two divisions, where torch pays its dispatch on a dozen small
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
