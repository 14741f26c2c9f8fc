"""End to end: the server's vectors agree with sentence-transformers on the same model
folder, whatever the encoding, batching, truncation, `dimensions` or input form, and
`usage` counts real tokens."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.support.answers import decode_embedding
from tests.support.reference import (DIM, MAX_LENGTH, MODEL_NAME, assert_close, assert_same_vectors, reference_embed,
                                     token_count)

pytestmark = pytest.mark.timeout(300)


def _check_response(body: dict, count: int) -> list[np.ndarray]:
    assert body["object"] == "list"
    assert body["model"] == MODEL_NAME
    assert [item["index"] for item in body["data"]] == list(range(count))
    assert all(item["object"] == "embedding" for item in body["data"])
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    vectors = [decode_embedding(item["embedding"]) for item in body["data"]]
    assert all(v.shape == (DIM,) for v in vectors)
    return vectors


def test_corpus_is_varied(sentences, reference_tokenizer):
    """The corpus itself covers what the parity tests claim to cover."""
    lengths = [len(reference_tokenizer(s)["input_ids"]) for s in sentences]
    assert len(sentences) >= 200
    assert min(lengths) <= 3
    assert sum(1 for n in lengths if n > MAX_LENGTH) >= 10
    assert any(not s.isascii() for s in sentences)
    assert any(c.isdigit() for s in sentences for c in s)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_one_request_matches_reference(server, sentences, reference_vectors, reference_tokenizer,
                                       encoding_format):
    response = server.embed(sentences, encoding_format=encoding_format)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    vectors = _check_response(body, len(sentences))
    for i, (vector, reference) in enumerate(zip(vectors, reference_vectors)):
        assert_close(vector, reference, f"input {i} ({sentences[i][:40]!r})")
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4
    if encoding_format == "base64":
        assert all(isinstance(item["embedding"], str) for item in body["data"])
    else:
        assert all(isinstance(item["embedding"], list) for item in body["data"])
    expected_tokens = sum(token_count(reference_tokenizer, s) for s in sentences)
    assert body["usage"]["prompt_tokens"] == expected_tokens


def test_base64_is_raw_little_endian_float32(server, sentences):
    """Two requests' vectors (their batches may differ: `SAME_TEXTS_ATOL`); another byte
    order or type would be far off, not 1e-6."""
    texts = sentences[:5]
    as_float = server.embed(texts, encoding_format="float").json()
    as_b64 = server.embed(texts, encoding_format="base64").json()
    import base64

    for f, b in zip(as_float["data"], as_b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == DIM * 4
        assert_same_vectors(np.frombuffer(raw, dtype="<f4"), np.asarray(f["embedding"], dtype=np.float32))


def test_default_encoding_is_float(server):
    body = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": ["hello"]}).json()
    assert isinstance(body["data"][0]["embedding"], list)


def test_concurrent_single_requests_are_batched_correctly(server, sentences, reference_vectors,
                                                          reference_tokenizer):
    """Every sentence as its own request, many at once: each gets its own vector back."""

    def one(i: int):
        fmt = "base64" if i % 2 else "float"
        form = sentences[i] if i % 3 == 0 else [sentences[i]]  # plain string or a one-item list
        return i, server.embed(form, encoding_format=fmt)

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(len(sentences))))
    for i, response in results:
        assert response.status_code == 200, f"input {i}: {response.text[:300]}"
        body = response.json()
        (vector,) = _check_response(body, 1)
        assert_close(vector, reference_vectors[i], f"input {i} ({sentences[i][:40]!r})")
        assert body["usage"]["prompt_tokens"] == token_count(reference_tokenizer, sentences[i]), i


def test_concurrent_small_batches_keep_order(server, sentences, reference_vectors, reference_tokenizer):
    """Small batches of shuffled sentences, many at once: order and `index` kept per request."""
    rng = random.Random(7)
    order = list(range(len(sentences)))
    rng.shuffle(order)
    batches = []
    while order:
        size = rng.randint(1, 9)
        batches.append(order[:size])
        order = order[size:]

    def one(n: int):
        indices = batches[n]
        fmt = "base64" if n % 2 else "float"
        return indices, server.embed([sentences[i] for i in indices], encoding_format=fmt)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(len(batches))))
    for indices, response in results:
        assert response.status_code == 200, response.text[:300]
        body = response.json()
        vectors = _check_response(body, len(indices))
        for vector, i in zip(vectors, indices):
            assert_close(vector, reference_vectors[i], f"input {i}")
        assert body["usage"]["prompt_tokens"] == sum(token_count(reference_tokenizer, sentences[i])
                                                     for i in indices)


def test_duplicates_in_one_request(server, sentences, reference_vectors):
    texts = [sentences[3], sentences[10], sentences[3], sentences[3]]
    vectors = _check_response(server.embed(texts).json(), 4)
    assert_close(vectors[0], reference_vectors[3])
    assert_close(vectors[1], reference_vectors[10])
    np.testing.assert_allclose(vectors[2], vectors[0], atol=1e-5)
    np.testing.assert_allclose(vectors[3], vectors[0], atol=1e-5)


def test_long_input_is_truncated_to_max_length(server, reference_model):
    text = " ".join(f"token{i}" for i in range(600))
    body = server.embed([text, "short"]).json()
    vector, _ = _check_response(body, 2)
    assert body["usage"]["prompt_tokens"] == MAX_LENGTH + 3  # "short" is [CLS] short [SEP]
    assert body["usage"]["truncated_inputs"] == 1
    assert_close(vector, reference_embed(reference_model, [text])[0])


@pytest.mark.parametrize("dimensions", [1, 2, 16, 64, 128, 200, 383, 384])
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_dimensions_truncate_and_renormalise(server, sentences, reference_vectors, dimensions,
                                             encoding_format):
    picks = [0, 7, 11, 50, 120]
    body = server.embed([sentences[i] for i in picks], dimensions=dimensions,
                        encoding_format=encoding_format).json()
    assert [item["index"] for item in body["data"]] == list(range(len(picks)))
    for item, i in zip(body["data"], picks):
        vector = decode_embedding(item["embedding"])
        assert vector.shape == (dimensions,)
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4
        reference = reference_vectors[i][:dimensions]
        reference = reference / np.linalg.norm(reference)
        if dimensions == 1:
            assert vector[0] == pytest.approx(float(reference[0]), abs=1e-5)  # +1 or -1
        else:
            assert_close(vector, reference, f"input {i}, dimensions={dimensions}")


def test_dimensions_leave_usage_alone(server, sentences, reference_tokenizer):
    body = server.embed(sentences[:3], dimensions=32).json()
    assert body["usage"]["prompt_tokens"] == sum(token_count(reference_tokenizer, s) for s in sentences[:3])


def test_token_ids_single_list(server, sentences, reference_vectors, reference_tokenizer):
    for i in (0, 7, 30):
        ids = reference_tokenizer(sentences[i], truncation=True, max_length=MAX_LENGTH)["input_ids"]
        body = server.embed(ids).json()
        (vector,) = _check_response(body, 1)
        assert_close(vector, reference_vectors[i], f"token ids of input {i}")
        assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_token_ids_list_of_lists(server, sentences, reference_vectors, reference_tokenizer, encoding_format):
    picks = list(range(0, len(sentences), 9))  # includes inputs longer than max_length
    ids = [reference_tokenizer(sentences[i], truncation=True, max_length=MAX_LENGTH)["input_ids"]
           for i in picks]
    assert any(len(x) == MAX_LENGTH for x in ids)
    body = server.embed(ids, encoding_format=encoding_format).json()
    vectors = _check_response(body, len(picks))
    for vector, i in zip(vectors, picks):
        assert_close(vector, reference_vectors[i], f"token ids of input {i}")
    assert body["usage"]["prompt_tokens"] == sum(len(x) for x in ids)


def test_token_ids_match_text_request(server, sentences):
    """The same inputs as text and as the tokenizer's ids give the same vectors."""
    from tests.support.reference import cosine

    texts = sentences[20:30]
    text_body = server.embed(texts).json()
    from tokenizers import Tokenizer

    from infinity.folders.resolve import packaged_model_folder

    tokenizer = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    tokenizer.no_padding()  # tokenizer.json may pad; the ids of a text are its unpadded ids
    tokenizer.enable_truncation(MAX_LENGTH)
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    ids_body = server.embed(ids).json()
    for a, b in zip(text_body["data"], ids_body["data"]):
        assert cosine(decode_embedding(a["embedding"]), decode_embedding(b["embedding"])) >= 0.999999
    for key in ("prompt_tokens", "total_tokens"):
        assert text_body["usage"][key] == ids_body["usage"][key]
    # The texts over 256 tokens were cut by the server; their ids arrived already cut.
    long_texts = sum(len(tokenizer.encode(t).overflowing) > 0 for t in texts)
    assert long_texts > 0
    assert (text_body["usage"]["truncated_inputs"], ids_body["usage"]["truncated_inputs"]) == (long_texts, 0)


def test_token_ids_longer_than_max_length_are_truncated(server):
    ids = [101] + [7592] * 400 + [102]
    body = server.embed([ids]).json()
    _check_response(body, 1)
    assert body["usage"]["prompt_tokens"] == MAX_LENGTH


def test_routes_without_v1_prefix(server, sentences, reference_vectors):
    response = server.post("/embeddings", {"model": MODEL_NAME, "input": [sentences[5]]})
    assert response.status_code == 200, response.text
    (vector,) = _check_response(response.json(), 1)
    assert_close(vector, reference_vectors[5])
    assert server.get("/health").status_code == 200
    assert server.get("/models").json()["data"][0]["id"] == MODEL_NAME


def test_model_may_be_omitted_with_one_model(server, sentences, reference_vectors):
    response = server.post("/v1/embeddings", {"input": sentences[:2], "user": "someone"})
    assert response.status_code == 200, response.text
    vectors = _check_response(response.json(), 2)
    assert_close(vectors[0], reference_vectors[0])
    assert_close(vectors[1], reference_vectors[1])


def test_models_route(server):
    body = server.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL_NAME
    assert model["kind"] == "embed"
    assert model["dimensions"] == DIM
    assert model["max_length"] == MAX_LENGTH


def test_client_that_leaves_has_its_waiting_inputs_dropped(server):
    """A client that hangs up mid-request: its inputs still in the inference queue are
    dropped, not computed (the inference process logs how many)."""
    import requests

    texts = [f"text {i} that is long enough to keep the engine busy " * 30 for i in range(200)]
    start = len(server.log_text())
    # The client leaves once the request has had time to be tokenized and queued (a
    # request still in the tokenizer process when its client leaves never reaches the
    # inference process); its 200 inputs of 256 tokens keep the engine busy for seconds.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url("/v1/embeddings"), json={"model": MODEL_NAME, "input": texts},
                      timeout=(5, 1.5))
    match = server.wait_for_log(r"client gone, (\d+) waiting inputs dropped", 30, start)
    assert match is not None, server.log_text()[start:]
    assert int(match[1]) > 0
    assert server.embed(["still serving"]).status_code == 200
