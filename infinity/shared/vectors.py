"""What a client may ask of a model's float32 vectors, on every way out (the HTTP routes,
the corpus job): fewer dimensions (re-normalised), another embedding type (quantised) as
JSON lists or base64 strings, a sparse vector's largest entries.

The exact encodings, for one row `x` of float32 values (already truncated to `dimensions`
and re-normalised when a request asks for fewer dimensions):

- `float`: `x` itself.
- `int8`: `clip(rint(x * 127), -127, 127)` as int8, computed in float64 (exact: the
  product of a float32 and 127 fits a float64), rounding ties to even. A fixed scale, so
  that dot products of quantised vectors stay proportional to the float ones across
  documents and requests; it suits unit-norm embeddings (every value within ±1) and clips
  values beyond ±1. -128 never occurs.
- `uint8`: the int8 value plus 128, as uint8: `x = 0.0` maps to 128, `x >= 1` to 255,
  `x <= -1` to 1 (0 never occurs).
- `ubinary`: one bit per value, 1 where `x > 0` (so 0.0, -0.0 and NaN give 0), packed eight
  to a byte with the first value in the most significant bit (`numpy.packbits`), as
  uint8 (0..255). A row of `dim` values gives `ceil(dim / 8)` bytes; the unused low bits
  of the last byte are 0.
- `binary`: the `ubinary` bytes minus 128, as int8 (-128..127), the convention of Cohere
  and sentence-transformers' `quantize_embeddings(..., "binary")`.

With base64, each row is the base64 (standard alphabet, padded) of its raw little-endian
bytes: four per value (IEEE float32) for `float`, one per value for the other types
(int8 and binary as two's complement). A multi-vector input's matrix (a row per token)
is encoded row by row the same way, and with base64 as one string of all its rows' bytes
in order (row-major).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary"]
EMBEDDING_TYPES: tuple[str, ...] = get_args(EmbeddingType)


def shorten(rows: np.ndarray, dimensions: int | None, renormalize: bool = True) -> np.ndarray:
    """(n, dim) float32 rows cut to their first `dimensions` values and re-normalised
    unless told not to (Matryoshka models); `rows` unchanged when `dimensions` is None or
    not fewer."""
    if dimensions is None or dimensions >= rows.shape[1]:
        return rows
    rows = rows[:, :dimensions]
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12) if renormalize else rows


def largest(entries: np.ndarray, k: int) -> np.ndarray:
    """A sparse vector's `k` entries of largest value (records of `index` and `value`;
    any of equal ones at the cut), still by index."""
    if len(entries) <= k:
        return entries
    cut = len(entries) - k
    return entries[np.sort(np.argpartition(entries["value"], cut)[cut:])]


def to_float(rows: np.ndarray) -> np.ndarray:
    """(n, dim) float32, little-endian."""
    return np.asarray(rows, dtype="<f4")


def to_int8(rows: np.ndarray) -> np.ndarray:
    """(n, dim) int8: `clip(rint(x * 127), -127, 127)`."""
    return np.clip(np.rint(np.asarray(rows, dtype=np.float64) * 127), -127, 127).astype(np.int8)


def to_uint8(rows: np.ndarray) -> np.ndarray:
    """(n, dim) uint8: the int8 value plus 128."""
    return (to_int8(rows).astype(np.int16) + 128).astype(np.uint8)


def to_ubinary(rows: np.ndarray) -> np.ndarray:
    """(n, ceil(dim / 8)) uint8: the bits `x > 0`, packed most significant bit first."""
    return np.packbits(np.asarray(rows) > 0, axis=-1)


def to_binary(rows: np.ndarray) -> np.ndarray:
    """(n, ceil(dim / 8)) int8: the `ubinary` bytes minus 128."""
    return (to_ubinary(rows).astype(np.int16) - 128).astype(np.int8)


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float": to_float, "int8": to_int8, "uint8": to_uint8, "binary": to_binary, "ubinary": to_ubinary,
}


def encode(rows: np.ndarray, embedding_type: EmbeddingType,
           as_base64: bool = False) -> list[list[float]] | list[list[int]] | list[str]:
    """Each row of `rows` as the JSON value of `embedding_type`: a list of numbers, or
    with `as_base64` the base64 string of its raw little-endian bytes."""
    values = QUANTIZERS[embedding_type](rows)
    if as_base64:
        return [base64.b64encode(row.tobytes()).decode() for row in values]
    return values.tolist()


def encode_matrix(matrix: np.ndarray, embedding_type: EmbeddingType,
                  as_base64: bool = False) -> list[list[float]] | list[list[int]] | str:
    """A multi-vector input's (n_tokens, dim) matrix as the JSON value of `embedding_type`:
    a list of rows, or with `as_base64` the base64 string of all its rows' bytes."""
    values = QUANTIZERS[embedding_type](matrix)
    if as_base64:
        return base64.b64encode(np.ascontiguousarray(values).tobytes()).decode()
    return values.tolist()
