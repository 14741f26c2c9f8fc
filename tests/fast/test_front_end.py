"""The whole request path in one process (tests/fast/inprocess.py): HTTP, admission,
tokenizing, the protocol, batching, the head, the arena and encoding, against a fake
engine whose vectors are known."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from tokenizers import Tokenizer

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from tests.fast.inprocess import ThreadLauncher, expected_embedding, infer_holds, serving, tokenize_messages

pytestmark = pytest.mark.timeout(60)

TEXTS = ["a short sentence", "another, somewhat longer sentence about embeddings and servers", "x"]


@pytest.fixture(scope="module")
def model_tokenizer():
    spec = resolve_model(ModelConfig(name="m"))
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    return tokenizer


def _expected(tokenizer, texts: list[str], dim: int = 384) -> np.ndarray:
    return np.stack([expected_embedding(encoding.ids, dim) for encoding in tokenizer.encode_batch(texts)])


async def _held_request(client, launcher: ThreadLauncher, texts: list[str]) -> asyncio.Future:
    """An embeddings request sent while the fake engine holds every pass, once it has
    reached the inference child."""
    launcher.gate.clear()
    request = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": texts}))
    await asyncio.sleep(0.2)
    return request


def _run(test) -> None:
    asyncio.run(test())


def test_embeddings_are_the_engines_pooled_output_in_float_and_base64(model_tokenizer):
    async def test():
        async with serving() as client:
            floats = await (await client.post("/v1/embeddings", json={"input": TEXTS, "model": "m"})).json()
            packed = await (await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}))\
                .json()
        expected = _expected(model_tokenizer, TEXTS)
        got = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-6)
        decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in packed["data"]])
        np.testing.assert_array_equal(decoded, got)
        tokens = sum(len(e.ids) for e in model_tokenizer.encode_batch(TEXTS))
        assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": 0}

    _run(test)


def test_a_null_encoding_format_is_float_as_openai_reads_it(model_tokenizer):
    """LiteLLM's openai provider sends `"encoding_format": null` (so that its openai client
    adds no base64): OpenAI reads null as its default, float, and so does the server."""
    async def test():
        async with serving() as client:
            answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": None})
            floats = await answer.json()
            unknown = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "floats"})
        assert answer.status == 200, floats
        got = np.array([item["embedding"] for item in floats["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, _expected(model_tokenizer, TEXTS), atol=1e-6)
        assert unknown.status == 422  # null is the default; a misspelt format is still refused
    _run(test)


def test_a_lone_short_text_tokenized_in_the_front_end_and_token_ids_give_the_same(model_tokenizer):
    async def test():
        async with serving() as client:
            alone = await (await client.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
            ids = model_tokenizer.encode(TEXTS[0]).ids
            from_ids = await (await client.post("/v1/embeddings", json={"input": [ids]})).json()
        assert alone["data"][0]["embedding"] == from_ids["data"][0]["embedding"]
        np.testing.assert_allclose(alone["data"][0]["embedding"], _expected(model_tokenizer, TEXTS[:1])[0], atol=1e-6)

    _run(test)


def test_one_token_id_sequence_is_one_input_however_many_ids_it_holds(model_tokenizer):
    async def test():
        async with serving(max_items_per_request=4) as client:
            ids = model_tokenizer.encode(TEXTS[1]).ids  # more ids than a request may carry inputs
            return await (await client.post("/v1/embeddings", json={"input": ids})).json()

    answer = asyncio.run(test())
    np.testing.assert_allclose(answer["data"][0]["embedding"], _expected(model_tokenizer, TEXTS[1:2])[0], atol=1e-6)


def test_texts_of_a_request_that_finds_nothing_in_flight_are_tokenized_in_the_front_end(model_tokenizer,
                                                                                          monkeypatch):
    to_tokenizers = tokenize_messages(monkeypatch)
    long_texts = [TEXTS[1] * 8, TEXTS[0] * 10]  # 1,000 characters or so in all: over one short text

    async def test():
        launcher = ThreadLauncher()
        async with serving(launcher) as client:
            idle = await (await client.post("/v1/embeddings", json={"input": long_texts})).json()
            assert to_tokenizers == []  # nothing else in flight: tokenized here
            held = await _held_request(client, launcher, TEXTS[:1])
            busy = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": long_texts}))
            await asyncio.sleep(0.2)
            assert [message.texts for message in to_tokenizers] == [long_texts]  # one in flight: sent on
            launcher.gate.set()
            await held
            busy_answer = await (await busy).json()
        for answer in (idle, busy_answer):
            got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
            np.testing.assert_allclose(got, _expected(model_tokenizer, long_texts), atol=1e-6)

    _run(test)


def test_an_input_for_a_busy_inference_process_is_held_for_the_next_ones_and_a_lone_or_urgent_one_is_not(
        monkeypatch):
    from infinity.client.engine_client import BUSY_SEND_HOLD_S

    holds = infer_holds(monkeypatch)
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher) as client:
            assert (await client.post("/v1/embeddings", json={"input": TEXTS[:1]})).status == 200
            held = await _held_request(client, launcher, TEXTS[:1])  # alone: sent at once
            behind = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": TEXTS[1:2]}))
            await asyncio.sleep(0.2)
            urgent = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": TEXTS[:1], "priority": -1}))
            await asyncio.sleep(0.2)
            launcher.gate.set()
            assert all(answer.status == 200 for answer in await asyncio.gather(held, behind, urgent))

    _run(test)
    # alone, alone, behind another of its priority, more urgent than all else held
    assert holds == [0.0, 0.0, BUSY_SEND_HOLD_S, 0.0]


def test_a_request_that_does_not_fit_the_queue_is_refused_at_once_and_slots_come_back():
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher, max_queued_items=4) as client:
            held = await _held_request(client, launcher, ["one", "two", "three"])
            refused = await client.post("/v1/embeddings", json={"input": ["four", "five"]})
            assert refused.status == 429 and refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["code"] == "overloaded"
            launcher.gate.set()
            assert (await held).status == 200
            assert (await client.post("/v1/embeddings", json={"input": ["a", "b", "c", "d"]})).status == 200
            stats = (await (await client.get("/v1/models")).json())["data"][0]["stats"]
            assert stats["queue_absolute"] == 0

    _run(test)


def test_a_dead_inference_child_fails_what_it_held_with_503_and_is_restarted():
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher) as client:
            held = await _held_request(client, launcher, ["held", "by the child"])
            launcher.processes["inference-cpu"].kill()
            answer = await held
            assert answer.status == 503
            assert (await answer.json())["error"]["code"] == "worker_died"
            launcher.gate.set()
            for _ in range(300):  # restarted after 0.5 s
                if (await client.get("/health")).status == 200:
                    break
                await asyncio.sleep(0.01)
            assert (await client.post("/v1/embeddings", json={"input": ["after the restart", "two"]})).status == 200

    _run(test)


def test_an_input_the_model_cannot_take_is_a_422_from_its_tokenizer():
    async def test():
        async with serving(model=ModelConfig(name="m", engine="torch", truncate=False)) as client:
            answer = await client.post("/v1/embeddings", json={"input": [[5] * 10_000]})
            assert answer.status == 422, await answer.text()
            assert (await answer.json())["error"]["param"] == "input"

    _run(test)


def test_a_client_that_goes_away_leaves_no_slot_taken():
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher) as client:
            gone = await _held_request(client, launcher, ["going", "away"])
            gone.cancel()
            await asyncio.sleep(0.1)
            launcher.gate.set()
            for _ in range(100):
                stats = (await (await client.get("/v1/models")).json())["data"][0]["stats"]
                if stats["queue_absolute"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert stats["queue_absolute"] == 0

    _run(test)
