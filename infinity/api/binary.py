"""Raw binary embeddings: what `/v1/embeddings` answers to `encoding_format: "bytes"` (or
to `Accept: application/octet-stream`), and `read_embeddings`, the one function a client
reads it with (docs/api.md shows the same function to copy).

The body: 4 bytes, the length N of a header (little-endian uint32); N bytes of JSON,
padded with spaces so that the rows start at a multiple of 8 bytes:
`{"shape": [rows, dim], "dtype": ..., "byteorder": ..., "model": ..., "usage": {...}}`;
then the rows in C order, each value of `dtype` (vLLM's `embed_dtype`: "float32",
"float16" or "bfloat16", the upper half of the float32 rounded to nearest even) in
`byteorder` ("little" or "big"). A thousand 384-wide vectors are 1.5 MB in float32 and
half that in the 16-bit types, against about 8 MB of JSON numbers, and neither side
builds a Python list.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

import numpy as np

CONTENT_TYPE = "application/octet-stream"
WireDtype = Literal["float32", "float16", "bfloat16"]
Endianness = Literal["little", "big", "native"]  # vLLM's names; native: the server's


def wire_values(rows: np.ndarray, dtype: WireDtype, endianness: Endianness) -> np.ndarray:
    """(n, dim) float32 `rows` as `dtype` in `endianness` (bfloat16 as its 16-bit patterns),
    ready for `tobytes` (vLLM's `embed_dtype` and `endianness`, for bytes and base64 alike)."""
    order = "<" if _byteorder(endianness) == "little" else ">"
    if dtype == "bfloat16":
        return _bfloat16_bits(rows).astype(order + "u2")
    return rows.astype(order + ("f4" if dtype == "float32" else "f2"))


def _byteorder(endianness: Endianness) -> str:
    return sys.byteorder if endianness == "native" else endianness


def encode_rows(rows: np.ndarray, dtype: WireDtype, endianness: Endianness, about: dict[str, Any]) -> bytes:
    """The body answering (n, dim) float32 `rows` as `dtype` in `endianness`, with
    `about` (the model, the usage) in the header beside the layout."""
    byteorder = _byteorder(endianness)
    values = wire_values(rows, dtype, endianness)
    header = json.dumps({"shape": list(rows.shape), "dtype": dtype, "byteorder": byteorder, **about}).encode()
    header += b" " * (-(4 + len(header)) % 8)
    return len(header).to_bytes(4, "little") + header + values.tobytes()


def vllm_metadata(shape: tuple[int, int], dtype: WireDtype, endianness: Endianness, start: int,
                  about: dict[str, Any]) -> str:
    """vLLM's `metadata` response header of a bytes answer whose (n, dim) rows begin at
    byte `start` of the body: where each row lies (`start`, `end`), its dtype, byte order
    and shape, beside `about` (id, created, model, usage). vLLM's decoder slices the body
    by these offsets, which step over this format's own header before the rows."""
    size = shape[1] * (4 if dtype == "float32" else 2)
    order = _byteorder(endianness)
    data = [{"index": i, "embed_dtype": dtype, "endianness": order, "start": start + i * size,
             "end": start + (i + 1) * size, "shape": [shape[1]]} for i in range(shape[0])]
    return json.dumps({**about, "data": data}, separators=(",", ":"))


def _bfloat16_bits(rows: np.ndarray) -> np.ndarray:
    """The bfloat16 of each float32 value as uint16 bits, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(rows), np.uint16(0x7FC0), rounded)


def read_embeddings(body: bytes) -> tuple[np.ndarray, dict]:
    """The (rows, dim) float32 vectors of a binary answer, and its header."""
    size = int.from_bytes(body[:4], "little")
    header = json.loads(body[4:4 + size])
    order = "<" if header["byteorder"] == "little" else ">"
    if header["dtype"] == "bfloat16":
        halves = np.frombuffer(body, order + "u2", offset=4 + size).astype(np.uint32)
        vectors = (halves << 16).view(np.float32)
    else:
        vectors = np.frombuffer(body, order + {"float32": "f4", "float16": "f2"}[header["dtype"]], offset=4 + size)
    return vectors.astype(np.float32).reshape(header["shape"]), header
