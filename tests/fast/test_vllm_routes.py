"""vLLM's own routes in process: `/score` pairs texts as vLLM pairs them (one against
many, or one to one, in its older `text_1`/`text_2` form and its newer
`queries`/`documents`) and scores an embedder's pairs by the cosine of the vectors
`/v1/embeddings` gives; what it cannot honour is refused naming the field; `/ping`
answers as `/health`."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tests.fast.inprocess import serving

TEXTS = ["a short sentence", "another, somewhat longer sentence about trains", "x"]


def _cosine(first: list[float], second: list[float]) -> float:
    a, b = np.array(first), np.array(second)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("form", [("text_1", "text_2"), ("queries", "documents")])
def test_an_embedders_pairs_score_as_the_cosine_of_their_vectors(form):
    async def test():
        async with serving() as client:
            vectors = [item["embedding"] for item in
                       (await (await client.post("/v1/embeddings", json={"input": TEXTS})).json())["data"]]
            first, second = form
            one_to_many = await client.post("/score", json={first: TEXTS[0], second: TEXTS})
            assert one_to_many.status == 200, await one_to_many.text()
            body = await one_to_many.json()
            assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == "m"
            assert [item["index"] for item in body["data"]] == [0, 1, 2]
            assert all(item["object"] == "score" for item in body["data"])
            np.testing.assert_allclose([item["score"] for item in body["data"]],
                                       [_cosine(vectors[0], vector) for vector in vectors], atol=1e-6)
            pairwise = await (await client.post("/v1/score", json={first: TEXTS, second: TEXTS[::-1]})).json()
            np.testing.assert_allclose([item["score"] for item in pairwise["data"]],
                                       [_cosine(a, b) for a, b in zip(vectors, vectors[::-1])], atol=1e-6)
            assert pairwise["usage"]["prompt_tokens"] > 0

    asyncio.run(test())


@pytest.mark.parametrize("body, param", [
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),  # neither one nor as many
    ({"text_1": "a"}, "text_1"),
    ({"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "text_1"),
    ({"queries": "a", "documents": []}, "documents"),
    ({"queries": "a", "documents": [1, 2]}, "documents"),
    ({"queries": "a", "documents": "b", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"queries": "a", "documents": "b", "max_tokens_per_doc": 8}, "max_tokens_per_doc"),
])
def test_what_score_cannot_honour_is_refused_naming_it(body, param):
    async def test():
        async with serving() as client:
            answer = await client.post("/score", json=body)
            assert answer.status == 422, await answer.text()
            assert (await answer.json())["error"]["param"] == param

    asyncio.run(test())


def test_ping_answers_as_health_on_get_and_post():
    async def test():
        async with serving() as client:
            for method in (client.get, client.post):
                answer = await method("/ping")
                assert answer.status == 200 and (await answer.json())["status"] == "ok"

    asyncio.run(test())


def test_vllms_bytes_only_answers_the_rows_alone():
    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
            expected = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
            assert floats["id"].startswith("embd-") and isinstance(floats["created"], int)
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes_only",
                                                               "embed_dtype": "float16", "endianness": "big"})
            assert answer.status == 200
            rows = np.frombuffer(await answer.read(), ">f2").astype(np.float32).reshape(expected.shape)
            np.testing.assert_array_equal(rows, expected.astype(np.float16).astype(np.float32))

    asyncio.run(test())


def test_vllms_bytes_with_its_fields_carry_its_metadata_header_over_the_same_body():
    """vLLM's decoder reads the `metadata` header and slices the body by its offsets; this
    server's own reader reads the same body; without vLLM's fields, no header."""
    from infinity.api.binary import read_embeddings

    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
            expected = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
            for dtype, endianness, numpy_type in (("float16", "big", ">f2"), ("float32", "little", "<f4")):
                answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes",
                                                                   "embed_dtype": dtype, "endianness": endianness})
                assert answer.status == 200
                body, metadata = await answer.read(), json.loads(answer.headers["metadata"])
                assert metadata["model"] == "m" and metadata["usage"]["prompt_tokens"] == floats["usage"]["prompt_tokens"]
                rows = [np.frombuffer(body[item["start"]:item["end"]], numpy_type).astype(np.float32)
                        for item in sorted(metadata["data"], key=lambda item: item["index"])]
                assert all(item["shape"] == [expected.shape[1]] and item["embed_dtype"] == dtype
                           and item["endianness"] == endianness for item in metadata["data"])
                np.testing.assert_array_equal(np.stack(rows), expected.astype(numpy_type).astype(np.float32))
                np.testing.assert_array_equal(read_embeddings(body)[0], np.stack(rows))
            ours = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes"})
            assert ours.status == 200 and "metadata" not in ours.headers

    asyncio.run(test())


@pytest.mark.parametrize("body, param", [
    ({"truncate_prompt_tokens": 8193}, "truncate_prompt_tokens"),  # beyond the model's length, as vLLM refuses it
    ({"truncate_prompt_tokens": 8193, "encoding_format": "bytes"}, "truncate_prompt_tokens"),
])
def test_vllms_fields_that_cannot_be_honoured_are_refused_naming_them(body, param):
    async def test():
        async with serving() as client:
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, **body})
            assert answer.status == 422, await answer.text()
            assert (await answer.json())["error"]["param"] == param
            honoured = await client.post("/v1/embeddings", json={"input": TEXTS, "truncate_prompt_tokens": -1,
                                                                 "add_special_tokens": True, "use_activation": True})
            assert honoured.status == 200

    asyncio.run(test())


def test_pooling_answers_an_embedders_vectors_as_embeddings_does():
    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
            answer = await client.post("/pooling", json={"input": TEXTS, "task": "embed"})
            assert answer.status == 200, await answer.text()
            body = await answer.json()
            assert body["id"].startswith("pool-") and body["object"] == "list" and body["model"] == "m"
            assert [(item["index"], item["object"]) for item in body["data"]] == [(i, "pooling") for i in range(3)]
            np.testing.assert_allclose([item["data"] for item in body["data"]],
                                       [item["embedding"] for item in floats["data"]], atol=1e-6)
            assert body["usage"]["prompt_tokens"] == floats["usage"]["prompt_tokens"]
            for fields, param in (({"task": "classify"}, "task"), ({"truncate_prompt_tokens": 8193}, "truncate_prompt_tokens")):
                refused = await client.post("/pooling", json={"input": TEXTS, **fields})
                assert refused.status == 422 and (await refused.json())["error"]["param"] == param

    asyncio.run(test())


def test_vllms_fp8_embed_dtypes_in_base64_and_bytes():
    import base64

    from infinity.api.binary import fp8_values, wire_values

    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
            expected = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
            for dtype in ("fp8_e4m3", "fp8_e5m2"):
                answer = await (await client.post("/v1/embeddings", json={
                    "input": TEXTS, "encoding_format": "base64", "embed_dtype": dtype})).json()
                bits = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), np.uint8) for item in answer["data"]])
                np.testing.assert_array_equal(bits, wire_values(expected, dtype, "little"))
                raw = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "bytes",
                                                                "embed_dtype": dtype})
                body, metadata = await raw.read(), json.loads(raw.headers["metadata"])
                rows = [fp8_values(dtype)[np.frombuffer(body[item["start"]:item["end"]], np.uint8)]
                        for item in metadata["data"]]
                np.testing.assert_array_equal(np.stack(rows), fp8_values(dtype)[bits])

    asyncio.run(test())
