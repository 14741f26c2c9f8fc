"""Raw binary embeddings: what `/v1/embeddings` answers to `encoding_format: "bytes"` (or
to `Accept: application/octet-stream`), and `read_embeddings`, the one function a client
reads it with (docs/api.md shows the same function to copy).

The body: 4 bytes, the length N of a header (little-endian uint32); N bytes of JSON,
padded with spaces so that the rows start at a multiple of 8 bytes:
`{"shape": [rows, dim], "dtype": ..., "byteorder": ..., "model": ..., "usage": {...}}`;
then the rows in C order, each value of `dtype` (vLLM's `embed_dtype`: "float32",
"float16", "bfloat16": the upper half of the float32 rounded to nearest even, or the 8-bit
"fp8_e4m3" and "fp8_e5m2" as torch casts to them) in
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
WireDtype = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
# Bytes per value of each wire type.
WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# vLLM's 8-bit types as torch casts float32 to them (rounded to nearest even): exponent bits,
# mantissa bits, the largest finite value, and whether a value beyond it saturates to it
# (e4m3fn has no infinity; torch saturates) or becomes infinity (e5m2).
_FP8 = {"fp8_e4m3": (4, 3, 448.0, True), "fp8_e5m2": (5, 2, 57344.0, False)}
Endianness = Literal["little", "big", "native"]  # vLLM's names; native: the server's


def wire_values(rows: np.ndarray, dtype: WireDtype, endianness: Endianness) -> np.ndarray:
    """(n, dim) float32 `rows` as `dtype` in `endianness` (bfloat16 as its 16-bit patterns),
    ready for `tobytes` (vLLM's `embed_dtype` and `endianness`, for bytes and base64 alike)."""
    order = "<" if _byteorder(endianness) == "little" else ">"
    if dtype == "bfloat16":
        return _bfloat16_bits(rows).astype(order + "u2")
    if dtype in _FP8:
        return _fp8_bits(rows, dtype)
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
    size = shape[1] * WIRE_BYTES[dtype]
    order = _byteorder(endianness)
    data = [{"index": i, "embed_dtype": dtype, "endianness": order, "start": start + i * size,
             "end": start + (i + 1) * size, "shape": [shape[1]]} for i in range(shape[0])]
    return json.dumps({**about, "data": data}, separators=(",", ":"))


def _bfloat16_bits(rows: np.ndarray) -> np.ndarray:
    """The bfloat16 of each float32 value as uint16 bits, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(rows), np.uint16(0x7FC0), rounded)


def _fp8_bits(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Each float32 value as the uint8 bits of the 8-bit type `dtype` (`_FP8`): rounded to
    nearest even on its grid (subnormals included), as torch's cast gives them."""
    exponent_bits, mantissa_bits, largest, saturates = _FP8[dtype]
    bias = 2 ** (exponent_bits - 1) - 1
    values = np.asarray(rows, dtype=np.float64)
    magnitude = np.abs(values)
    # Past the largest value: saturated, or (infinity too) made to round past it.
    magnitude = np.minimum(magnitude, largest) if saturates else np.where(np.isinf(magnitude), 2 * largest, magnitude)
    smallest_normal = 1 - bias
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0))), smallest_normal)
        quantum = np.exp2(exponent - mantissa_bits)
        rounded = np.rint(magnitude / quantum) * quantum
        normal = rounded >= 2.0 ** smallest_normal
        rounded_exponent = np.floor(np.log2(np.where(normal, rounded, 1.0)))
    field = np.where(normal, rounded_exponent + bias, 0)
    mantissa = np.where(normal, rounded / np.exp2(rounded_exponent - mantissa_bits) - 2 ** mantissa_bits,
                        rounded / 2.0 ** (smallest_normal - mantissa_bits))
    bits = (field.astype(np.int64) << mantissa_bits) | mantissa.astype(np.int64)
    bits = np.where(rounded > largest, (2 ** exponent_bits - 1) << mantissa_bits, bits)  # infinity (e5m2)
    bits = bits | (np.signbit(values).astype(np.int64) << 7)
    return np.where(np.isnan(values), 0x7F, bits).astype(np.uint8)


def fp8_values(dtype: str) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of the 8-bit type `dtype`."""
    exponent_bits, mantissa_bits, _, saturates = _FP8[dtype]
    bias = 2 ** (exponent_bits - 1) - 1
    bits = np.arange(256)
    field, mantissa = (bits >> mantissa_bits) & (2 ** exponent_bits - 1), bits & (2 ** mantissa_bits - 1)
    magnitude = np.where(field == 0, mantissa * 2.0 ** (1 - bias - mantissa_bits),
                         (1 + mantissa / 2 ** mantissa_bits) * np.exp2(field - bias))
    top = field == 2 ** exponent_bits - 1
    if saturates:  # e4m3fn: only all ones is NaN
        magnitude = np.where(top & (mantissa == 2 ** mantissa_bits - 1), np.nan, magnitude)
    else:  # e5m2: infinity, then NaNs
        magnitude = np.where(top, np.where(mantissa == 0, np.inf, np.nan), magnitude)
    return np.where(bits >> 7, -magnitude, magnitude).astype(np.float32)


def read_embeddings(body: bytes) -> tuple[np.ndarray, dict]:
    """The (rows, dim) float32 vectors of a binary answer, and its header."""
    size = int.from_bytes(body[:4], "little")
    header = json.loads(body[4:4 + size])
    order = "<" if header["byteorder"] == "little" else ">"
    if header["dtype"] == "bfloat16":
        halves = np.frombuffer(body, order + "u2", offset=4 + size).astype(np.uint32)
        vectors = (halves << 16).view(np.float32)
    elif header["dtype"] in _FP8:
        vectors = fp8_values(header["dtype"])[np.frombuffer(body, np.uint8, offset=4 + size)]
    else:
        vectors = np.frombuffer(body, order + {"float32": "f4", "float16": "f2"}[header["dtype"]], offset=4 + size)
    return vectors.astype(np.float32).reshape(header["shape"]), header
