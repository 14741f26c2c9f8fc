"""Raw binary embeddings (`encoding_format: "bytes"`, `Accept: application/octet-stream`):
the layout round-trips against the JSON floats in every wire type and byte order, the
reader docs/api.md shows is the module's, and what a binary answer cannot hold is refused."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from infinity.api.binary import CONTENT_TYPE, encode_rows, read_embeddings
from tests.fast.inprocess import serving

API_DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TEXTS = ["a short sentence", "another, somewhat longer sentence about trains", "x"]


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even) and back, computed apart from the module."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


async def _json_floats(client) -> tuple[dict, np.ndarray]:  # noqa: ANN001
    """The JSON answer of TEXTS as floats, and its vectors."""
    floats = await (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
    return floats, np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_a_binary_answer_round_trips_the_json_floats(dtype, endianness):
    async def test():
        async with serving() as client:
            floats, expected = await _json_floats(client)
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes",
                                                               "embed_dtype": dtype, "endianness": endianness})
            assert answer.status == 200 and answer.content_type == CONTENT_TYPE
            body = await answer.read()
            vectors, header = read_embeddings(body)
            assert header["shape"] == list(expected.shape) and header["dtype"] == dtype
            assert header["model"] == "m" and header["usage"] == floats["usage"]
            assert (4 + int.from_bytes(body[:4], "little")) % 8 == 0  # the rows start aligned
            assert len(body) - 4 - int.from_bytes(body[:4], "little") == expected.size * (4 if dtype == "float32" else 2)
            wire = {"float32": expected, "float16": expected.astype(np.float16).astype(np.float32),
                    "bfloat16": _bfloat16(expected)}[dtype]
            np.testing.assert_array_equal(vectors, wire)

    asyncio.run(test())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["little", "big"])
def test_base64_vectors_take_vllms_embed_dtype_and_endianness(dtype, endianness):
    """As vLLM encodes them: each vector's values in `embed_dtype` and `endianness`, in
    base64; not silently float32 little-endian."""
    import base64

    async def test():
        async with serving() as client:
            _, expected = await _json_floats(client)
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64",
                                                               "embed_dtype": dtype, "endianness": endianness})
            assert answer.status == 200
            order = "<" if endianness == "little" else ">"
            for item, row in zip((await answer.json())["data"], expected, strict=True):
                raw = base64.b64decode(item["embedding"])
                if dtype == "bfloat16":
                    got = (np.frombuffer(raw, order + "u2").astype(np.uint32) << 16).view(np.float32)
                    np.testing.assert_array_equal(got, _bfloat16(row))
                else:
                    got = np.frombuffer(raw, order + ("f4" if dtype == "float32" else "f2")).astype(np.float32)
                    np.testing.assert_array_equal(got, row.astype(np.float16 if dtype == "float16" else np.float32))

    asyncio.run(test())


@pytest.mark.parametrize("extra, param", [
    ({"embed_dtype": "float16"}, "embed_dtype"),  # JSON numbers
    ({"endianness": "big"}, "endianness"),
    ({"encoding_format": "base64", "embed_dtype": "float16", "embedding_type": "int8"}, "embed_dtype"),
])
def test_a_wire_type_where_it_cannot_apply_is_refused(extra, param):
    async def test():
        async with serving() as client:
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, **extra})
            assert answer.status == 422 and (await answer.json())["error"]["param"] == param

    asyncio.run(test())


def test_accept_octet_stream_asks_for_bytes_and_dimensions_apply():
    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 8})).json()
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 8},
                                       headers={"Accept": CONTENT_TYPE})
            assert answer.content_type == CONTENT_TYPE
            vectors, _ = read_embeddings(await answer.read())
            np.testing.assert_array_equal(vectors, [item["embedding"] for item in floats["data"]])
            both = await client.post("/v1/embeddings", json={"input": TEXTS},
                                     headers={"Accept": f"{CONTENT_TYPE}, application/json"})
            assert both.content_type == "application/json"

    asyncio.run(test())


@pytest.mark.parametrize("extra, param", [
    ({"embedding_type": "int8"}, "embedding_type"),
    ({"embedding_types": ["float"]}, "embedding_type"),
    ({"top_k": 3}, "top_k"),
    ({"embed_dtype": "float64"}, "embed_dtype"),
])
def test_what_a_binary_answer_cannot_hold_is_refused(extra, param):
    async def test():
        async with serving() as client:
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes", **extra})
            assert answer.status == 422
            assert param in (await answer.json())["error"]["message"] + str((await answer.json())["error"]["param"])

    asyncio.run(test())


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    values = np.array([[1.0, 1.00390625, 1.01171875, -2.5e-3, np.nan]], dtype=np.float32)
    vectors, _ = read_embeddings(encode_rows(values, "bfloat16", "little", {}))
    np.testing.assert_array_equal(vectors[0, :4], _bfloat16(values[0, :4]))
    assert vectors[0, 1] == 1.0  # halfway between 1 and the next bfloat16: to even
    assert np.isnan(vectors[0, 4])


def test_the_api_documents_reader_is_the_modules():
    text = API_DOCUMENT.read_text()
    code = re.search(r"```python\n(import json\n.*?def read_embeddings.*?)```", text, re.S)
    assert code, "docs/api.md shows read_embeddings"
    namespace: dict = {}
    exec(code.group(1), namespace)
    rows = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        for endianness in ("little", "big"):
            body = encode_rows(rows, dtype, endianness, {"model": "m"})
            np.testing.assert_array_equal(namespace["read_embeddings"](body)[0], read_embeddings(body)[0])


def test_a_batch_file_line_asking_for_bytes_is_refused():
    from infinity.api.embedding import Embedder
    from infinity.api.errors import APIError
    from infinity.api.types.embeddings import EmbeddingRequest

    embedder = Embedder(None, None, None, 16)  # type: ignore[arg-type]  # refused before they are used
    with pytest.raises(APIError) as refused:
        asyncio.run(embedder.embeddings(None, EmbeddingRequest(input="x", encoding_format="bytes")))  # type: ignore[arg-type]
    assert refused.value.status == 422 and refused.value.param == "encoding_format"


@pytest.mark.parametrize("dtype, torch_type", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_values_are_torchs_cast_bit_for_bit(dtype, torch_type):
    """vLLM's 8-bit embed_dtypes are torch's casts of the float32 vectors: every rounding
    (ties to even, subnormals, the largest value, saturation or infinity, NaN), and the
    reader's values are torch's of the same bits."""
    import torch

    from infinity.api.binary import fp8_values, wire_values

    grid = [0.0, -0.0, 1.0, 0.3, -0.3, 2.0 ** -9, 2.0 ** -10, 1.01 * 2.0 ** -10, 2.0 ** -16, 2.0 ** -17, 448.0,
            464.0, 500.0, 57344.0, 60000.0, 61440.0, 1e9, np.inf, -np.inf, np.nan]
    rng = np.random.default_rng(0)
    values = np.concatenate([np.array(grid, dtype=np.float32),
                             rng.standard_normal(4000).astype(np.float32) * rng.choice([1e-3, 1.0, 100.0], 4000),
                             # every float32 halfway between neighbours of the grid's binades
                             (np.exp2(rng.integers(-12, 10, 2000)) * (1 + rng.integers(0, 16, 2000) / 16 + 1 / 32)
                              ).astype(np.float32)])
    expected = torch.from_numpy(values).to(getattr(torch, torch_type)).view(torch.uint8).numpy()
    np.testing.assert_array_equal(wire_values(values[None], dtype, "little")[0], expected)
    decoded = torch.from_numpy(np.arange(256, dtype=np.uint8)).view(getattr(torch, torch_type)).float().numpy()
    np.testing.assert_array_equal(fp8_values(dtype), decoded)
    vectors, header = read_embeddings(encode_rows(values[None, :100], dtype, "big", {}))
    assert header["dtype"] == dtype
    np.testing.assert_array_equal(vectors[0], decoded[expected[:100]])
