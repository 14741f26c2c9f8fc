"""vLLM's own routes in process: `/score` pairs texts as vLLM pairs them (one against
many, or one to one, in its older `text_1`/`text_2` form and its newer
`queries`/`documents`) and scores an embedder's pairs by the cosine of the vectors
`/v1/embeddings` gives; what it cannot honour is refused naming the field; `/ping`
answers as `/health`."""

from __future__ import annotations

import asyncio

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
