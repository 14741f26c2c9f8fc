"""The official `openai` client against the server: its default base64 encoding, float,
`dimensions`, token-id input, many concurrent requests, and errors as the client's
exception classes with the right status."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from tests.support.answers import decode_embedding
from tests.support.reference import DIM, MAX_LENGTH, MODEL_NAME, assert_close, assert_same_vectors, token_count

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="not-checked", max_retries=0, timeout=120) as c:
        yield c


def _vectors(response) -> np.ndarray:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    # The client decodes base64 itself only when it chose it (encoding_format not given).
    return np.asarray([decode_embedding(item.embedding) for item in response.data], dtype=np.float32)


def test_default_base64_encoding(client, sentences, reference_vectors, reference_tokenizer):
    texts = sentences[:64]
    response = client.embeddings.create(model=MODEL_NAME, input=texts)  # the client sends base64
    assert response.model == MODEL_NAME
    vectors = _vectors(response)
    assert vectors.shape == (len(texts), DIM)
    for i, vector in enumerate(vectors):
        assert_close(vector, reference_vectors[i], f"input {i}")
    assert response.usage.prompt_tokens == sum(token_count(reference_tokenizer, t) for t in texts)
    assert response.usage.total_tokens == response.usage.prompt_tokens


def test_float_encoding(client, sentences, reference_vectors):
    texts = sentences[64:140]
    response = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    vectors = _vectors(response)
    for i, vector in enumerate(vectors):
        assert_close(vector, reference_vectors[64 + i], f"input {64 + i}")


def test_base64_and_float_agree(client, sentences):
    texts = sentences[140:150]
    as_b64 = _vectors(client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="base64"))
    as_float = _vectors(client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float"))
    assert_same_vectors(as_b64, as_float)


def test_single_string(client, sentences, reference_vectors):
    response = client.embeddings.create(model=MODEL_NAME, input=sentences[7])
    (vector,) = _vectors(response)
    assert_close(vector, reference_vectors[7])


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("dimensions", [32, 256])
def test_dimensions(client, sentences, reference_vectors, encoding_format, dimensions):
    response = client.embeddings.create(model=MODEL_NAME, input=sentences[150:155], dimensions=dimensions,
                                        encoding_format=encoding_format)
    vectors = _vectors(response)
    assert vectors.shape == (5, dimensions)
    for i, vector in enumerate(vectors):
        reference = reference_vectors[150 + i][:dimensions]
        assert_close(vector, reference / np.linalg.norm(reference), f"input {150 + i}")
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4


def test_token_ids(client, sentences, reference_vectors, reference_tokenizer):
    ids = [reference_tokenizer(s, truncation=True, max_length=MAX_LENGTH)["input_ids"] for s in sentences[:6]]
    many = _vectors(client.embeddings.create(model=MODEL_NAME, input=ids))
    for i, vector in enumerate(many):
        assert_close(vector, reference_vectors[i], f"token ids of input {i}")
    (one,) = _vectors(client.embeddings.create(model=MODEL_NAME, input=ids[2], encoding_format="float"))
    assert_close(one, reference_vectors[2])


def test_models_list(client):
    models = client.models.list()
    assert MODEL_NAME in [m.id for m in models.data]


def test_async_client_concurrent(server, sentences, reference_vectors):
    """Many concurrent requests from AsyncOpenAI, one or a few sentences each."""

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            chunks = [list(range(i, min(i + 1 + i % 4, len(sentences)))) for i in range(0, len(sentences), 3)]
            responses = await asyncio.gather(*(
                aclient.embeddings.create(model=MODEL_NAME, input=[sentences[j] for j in chunk])
                for chunk in chunks))
            return chunks, responses

    chunks, responses = asyncio.run(run())
    for chunk, response in zip(chunks, responses):
        vectors = _vectors(response)
        assert len(vectors) == len(chunk)
        for j, vector in zip(chunk, vectors):
            assert_close(vector, reference_vectors[j], f"input {j}")


# --- errors ------------------------------------------------------------------------------------

def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="no-such-model", input=["hello"])
    assert info.value.status_code == 404
    assert MODEL_NAME in info.value.message
    assert "no-such-model" in info.value.message
    assert info.value.param == "model"


def test_empty_string_is_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.embeddings.create(model=MODEL_NAME, input="")
    assert info.value.status_code == 422
    assert info.value.param == "input"


def test_empty_list_is_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model=MODEL_NAME, input=[])


@pytest.mark.parametrize("dimensions", [-3, DIM + 1])  # 0 asks for all, as in infinity
def test_dimensions_out_of_range_is_unprocessable(client, dimensions):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.embeddings.create(model=MODEL_NAME, input=["hello"], dimensions=dimensions)
    assert info.value.param == "dimensions"


def test_token_ids_outside_vocabulary_are_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model=MODEL_NAME, input=[[101, 10 ** 7, 102]])


def test_bad_encoding_format_is_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model=MODEL_NAME, input=["hello"], encoding_format="int8")  # type: ignore[arg-type]


def test_server_still_serves_after_errors(client, sentences, reference_vectors):
    (vector,) = _vectors(client.embeddings.create(model=MODEL_NAME, input=[sentences[0]]))
    assert_close(vector, reference_vectors[0])


def test_api_key(api_key_server, sentences, reference_vectors):
    with openai.OpenAI(base_url=api_key_server.url("/v1"), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.embeddings.create(model=MODEL_NAME, input=["hello"])
        assert info.value.status_code == 401
    with openai.OpenAI(base_url=api_key_server.url("/v1"), api_key=api_key_server.api_key,
                       max_retries=0) as good:
        (vector,) = _vectors(good.embeddings.create(model=MODEL_NAME, input=[sentences[1]]))
        assert_close(vector, reference_vectors[1])
