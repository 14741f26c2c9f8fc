"""Multi-vector (ColBERT-style) models: a tiny sentence-transformers MultiVectorEncoder
folder served end to end, against sentence-transformers' own `encode_document` on the
same folder: the same rows (padding removed), each within cosine 1e-5, in float and
base64 with their `shape`, alone and inside batches of other lengths, through the
official `openai` client too."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest

from tests.conftest import assert_error
from tests.tiny_models import save_tiny_multivector, scoring_text

pytestmark = pytest.mark.timeout(300)

NAME = "tiny-colbert"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_multivector(tmp_path_factory.mktemp("multivector") / "colbert")


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(str(folder), device="cpu")
    return lambda texts: [row.float().numpy() for row in model.encode_document(texts)]


@pytest.fixture(scope="module")
def colbert_server(folder, tmp_path_factory):
    from tests.conftest import start_server_process

    proc = start_server_process(config=f'[[models]]\nname = "{NAME}"\nsource = "{folder}"\n',
                                log_dir=tmp_path_factory.mktemp("multivector-server"))
    try:
        yield proc
    finally:
        proc.cleanup()


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [scoring_text(rng, rng.randint(1, 40)) for _ in range(count)]


def _assert_rows_match(matrix: np.ndarray, expected: np.ndarray) -> None:
    assert matrix.shape == expected.shape
    cosines = (matrix * expected).sum(axis=1) / (np.linalg.norm(matrix, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosines.min() >= 0.99999, cosines.min()


def test_the_model_is_served_as_multivector(colbert_server):
    (card,) = colbert_server.get("/v1/models").json()["data"]
    assert (card["kind"], card["dimensions"]) == ("multivector", 128)


def test_float_rows_and_shape_match_sentence_transformers(colbert_server, reference):
    texts = _texts(1, 12)
    answer = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": texts})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    for item, expected in zip(body["data"], reference(texts), strict=True):
        matrix = np.array(item["embedding"], dtype=np.float32)
        assert item["shape"] == list(expected.shape)
        _assert_rows_match(matrix, expected)
    assert body["usage"]["prompt_tokens"] == sum(len(e) for e in reference(texts))


def test_base64_is_the_row_major_float32_matrix(colbert_server, reference):
    texts = _texts(2, 5)
    body = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": texts,
                                                       "encoding_format": "base64"}).json()
    for item, expected in zip(body["data"], reference(texts), strict=True):
        matrix = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])
        _assert_rows_match(matrix, expected)


def test_an_input_alone_and_inside_a_batch_of_other_lengths_agree(colbert_server):
    texts = _texts(3, 9)
    batch = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": texts}).json()["data"]
    for text, item in zip(texts, batch):
        (alone,) = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": [text]}).json()["data"]
        np.testing.assert_allclose(np.array(alone["embedding"]), np.array(item["embedding"]), atol=1e-5)


def test_quantised_types_apply_per_row(colbert_server, reference):
    texts = _texts(4, 3)
    body = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": texts,
                                                       "embedding_types": ["float", "int8"]}).json()
    for item, expected in zip(body["data"], reference(texts)):
        assert np.array(item["embeddings"]["int8"]).shape == expected.shape
        assert np.abs(np.array(item["embeddings"]["int8"]) - np.rint(expected * 127)).max() <= 1


def test_dimensions_is_refused_for_a_multivector_model(colbert_server):
    answer = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": ["a"], "dimensions": 16})
    assert assert_error(answer, 422)["param"] == "dimensions"


def test_the_openai_client_gets_the_matrix_and_its_shape(colbert_server, reference):
    """In float, and in the client's default mode, where it asks for base64 and decodes
    the row-major float32 bytes into one flat list."""
    from openai import OpenAI

    client = OpenAI(base_url=colbert_server.url("/v1"), api_key="unused")
    texts = _texts(5, 3)
    for options in ({"encoding_format": "float"}, {}):
        data = client.embeddings.create(model=NAME, input=texts, **options).data
        for item, expected in zip(data, reference(texts), strict=True):
            shape = item.model_extra["shape"]
            assert shape == list(expected.shape)
            _assert_rows_match(np.array(item.embedding, dtype=np.float32).reshape(shape), expected)
