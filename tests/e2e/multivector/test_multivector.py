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

from tests.support.answers import assert_error
from tests.support.server import models_toml, running_server
from tests.support.shm import SHM_DIR, shm_arenas
from tests.support.tiny_models import (save_tiny_multivector, save_tiny_pylate_colbert, save_tiny_stanford_colbert,
                                       scoring_text)

pytestmark = pytest.mark.timeout(300)

NAME = "tiny-colbert"
# The classic ColBERT settings: prompts, expanded queries, a document length, a skiplist.
CLASSIC = "tiny-colbert-classic"
CLASSIC_TORCH = "tiny-colbert-classic-torch"  # the same on the torch engine, which "auto" does not pick
# Older layouts that sentence-transformers loads too: PyLate's, Stanford's.
PYLATE, STANFORD = "tiny-colbert-pylate", "tiny-colbert-stanford"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_multivector(tmp_path_factory.mktemp("multivector") / "colbert")


@pytest.fixture(scope="module")
def classic_folder(tmp_path_factory):
    return save_tiny_multivector(tmp_path_factory.mktemp("multivector") / "classic", seed=3, colbert=True)


def _encoder(folder):
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(str(folder), device="cpu")


def _numpy(rows) -> list[np.ndarray]:
    return [row.float().numpy() for row in rows]


@pytest.fixture(scope="module")
def reference(folder):
    model = _encoder(folder)
    return lambda texts: _numpy(model.encode_document(texts))


@pytest.fixture(scope="module")
def classic(classic_folder):
    return _encoder(classic_folder)


@pytest.fixture(scope="module")
def legacy_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy")
    return {PYLATE: save_tiny_pylate_colbert(root / "pylate", seed=4),
            STANFORD: save_tiny_stanford_colbert(root / "stanford", seed=5)}


@pytest.fixture(scope="module")
def colbert_server(folder, classic_folder, legacy_folders, tmp_path_factory):
    config = models_toml({NAME: folder, CLASSIC: classic_folder, **legacy_folders})
    config += f'[[models]]\nname = "{CLASSIC_TORCH}"\nsource = "{classic_folder}"\nengine = "torch"\n'
    with running_server(config=config, log_dir=tmp_path_factory.mktemp("multivector-server")) as proc:
        yield proc


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [scoring_text(rng, rng.randint(1, 40)) for _ in range(count)]


def _assert_rows_match(matrix: np.ndarray, expected: np.ndarray) -> None:
    assert matrix.shape == expected.shape
    cosines = (matrix * expected).sum(axis=1) / (np.linalg.norm(matrix, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosines.min() >= 0.99999, cosines.min()


def test_the_model_is_served_as_multivector(colbert_server):
    cards = {card["id"]: card for card in colbert_server.get("/v1/models").json()["data"]}
    for name, card in cards.items():
        dim = 16 if name in (PYLATE, STANFORD) else 128
        assert (card["kind"], card["dimensions"], card["capabilities"]) == ("multivector", dim, ["embed", "rerank"])
    # CTranslate2 does not compute the expansion tokens the encoder does not attend to.
    assert cards[CLASSIC]["backend"] == "onnx"


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


def _embed(server, model: str, texts: list[str], **options) -> list[np.ndarray]:
    answer = server.post("/v1/embeddings", json={"model": model, "input": texts, **options})
    assert answer.status_code == 200, answer.text
    return [np.array(item["embedding"], dtype=np.float32) for item in answer.json()["data"]]


@pytest.mark.parametrize(("model", "input_type"), [(CLASSIC, "query"), (CLASSIC, "search_query"),
                                                   (CLASSIC_TORCH, "query")])
def test_queries_are_encoded_as_the_model_encodes_queries(colbert_server, classic, model, input_type):
    """The [Q] prompt, and every query filled to 16 tokens with [MASK] tokens the
    encoder does not attend to, whose vectors are part of the query's."""
    texts = _texts(6, 8)
    for matrix, expected in zip(_embed(colbert_server, model, texts, input_type=input_type),
                                _numpy(classic.encode_query(texts)), strict=True):
        assert matrix.shape[0] == 16
        _assert_rows_match(matrix, expected)


@pytest.mark.parametrize("input_type", ["document", "search_document", None])
def test_documents_are_encoded_as_the_model_encodes_documents(colbert_server, classic, input_type):
    """The [D] prompt, cut to the document length, skiplisted tokens left out; without
    an input_type, inputs are documents."""
    texts = _texts(7, 8) + [" ".join(["the quick brown fox"] * 20)]
    options = {} if input_type is None else {"input_type": input_type}
    served = _embed(colbert_server, CLASSIC, texts, **options)
    expected = _numpy(classic.encode_document(texts))
    assert any(len(matrix) < 24 for matrix in expected[-1:])  # the long one: cut, then skipped tokens out
    for matrix, reference_rows in zip(served, expected, strict=True):
        _assert_rows_match(matrix, reference_rows)


def test_a_query_alone_and_inside_a_batch_of_other_lengths_agree(colbert_server):
    texts = _texts(8, 7)
    batch = _embed(colbert_server, CLASSIC, texts, input_type="query")
    for text, matrix in zip(texts, batch):
        (alone,) = _embed(colbert_server, CLASSIC, [text], input_type="query")
        np.testing.assert_allclose(alone, matrix, atol=1e-5)


def test_expansion_tokens_are_not_billed(colbert_server, classic):
    texts = ["quick fox", "lazy dog jumps"]
    answer = colbert_server.post("/v1/embeddings", json={"model": CLASSIC, "input": texts, "input_type": "query"})
    real = [len(classic.tokenizer("[Q] " + text)["input_ids"]) for text in texts]
    assert answer.json()["usage"]["prompt_tokens"] == sum(real)


def test_an_unknown_input_type_is_refused(colbert_server):
    answer = colbert_server.post("/v1/embeddings", json={"model": CLASSIC, "input": ["a"], "input_type": "image"})
    assert assert_error(answer, 422)["param"] == "input_type"


@pytest.mark.parametrize("model", [NAME, CLASSIC])
def test_rerank_scores_by_maxsim_as_sentence_transformers_does(colbert_server, classic_folder, folder, model):
    encoder = _encoder(classic_folder if model == CLASSIC else folder)
    query, documents = "quick brown fox", _texts(9, 6)
    answer = colbert_server.post("/v1/rerank", json={"model": model, "query": query, "documents": documents})
    assert answer.status_code == 200, answer.text
    expected = encoder.similarity(encoder.encode_query([query]), encoder.encode_document(documents))[0].numpy()
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    for result in results:
        assert result["relevance_score"] == pytest.approx(float(expected[result["index"]]), rel=1e-5, abs=1e-5)


def test_the_cohere_client_reranks_with_a_multivector_model(colbert_server, classic):
    import cohere

    client = cohere.ClientV2(base_url=colbert_server.url(""), api_key="unused")
    documents = _texts(10, 5)
    answer = client.rerank(model=CLASSIC, query="lazy dog", documents=documents, top_n=3)
    expected = classic.similarity(classic.encode_query(["lazy dog"]), classic.encode_document(documents))[0].numpy()
    assert [r.index for r in answer.results] == list(np.argsort(-expected, kind="stable")[:3])


def test_the_api_document_lists_multivector_models_where_they_are_served(colbert_server):
    schemas = colbert_server.get("/openapi.json").json()["components"]["schemas"]

    def names(request: str) -> list[str]:
        return schemas[request]["properties"]["model"]["anyOf"][0]["enum"]

    assert set(names("EmbeddingRequest")) == set(names("RerankRequest")) == {NAME, CLASSIC, CLASSIC_TORCH, PYLATE,
                                                                             STANFORD}
    assert names("CohereEmbedRequest") == names("ClassifyRequest") == []


def test_a_multivector_model_reserves_no_worst_case_up_front(colbert_server):
    """Outputs that vary in size are held as they are computed: no model's arena holds
    slots for a (tokens x dim) matrix per queued input, which for the default 4096 queued
    inputs of 64 tokens x 128 floats would be 128 MiB per model."""
    cards = colbert_server.get("/v1/models").json()["data"]
    worst_case = 4096 * cards[0]["max_length"] * 128 * 4
    arenas = [SHM_DIR / name for name in shm_arenas(colbert_server.pid)]
    assert len(arenas) == len(cards)
    assert sum(path.stat().st_size for path in arenas) < worst_case / 1000
    texts = [" ".join(["quick brown fox jumps"] * 20)] * 2048
    answer = colbert_server.post("/v1/embeddings", json={"model": NAME, "input": texts, "encoding_format": "base64"})
    assert answer.status_code == 200
    assert {tuple(item["shape"]) for item in answer.json()["data"]} == {(cards[0]["max_length"], 128)}


@pytest.mark.parametrize("model", [PYLATE, STANFORD])
def test_older_colbert_layouts_are_served_as_sentence_transformers_loads_them(colbert_server, legacy_folders, model):
    """PyLate's and Stanford's layouts: their markers kept whole, expanded queries,
    documents cut and skiplisted (punctuation, for Stanford's), the projection from the
    Dense folder or from the checkpoint's own weights, normalised; and MaxSim rerank."""
    encoder = _encoder(legacy_folders[model])
    rng = random.Random(11)
    texts = [scoring_text(rng, rng.randint(1, 30)).replace(" ", ", ", 1) + "." for _ in range(6)]
    for input_type, encode in (("query", encoder.encode_query), ("document", encoder.encode_document)):
        for matrix, expected in zip(_embed(colbert_server, model, texts, input_type=input_type),
                                    _numpy(encode(texts)), strict=True):
            _assert_rows_match(matrix, expected)
    answer = colbert_server.post("/v1/rerank", json={"model": model, "query": texts[0], "documents": texts})
    expected = encoder.similarity(encoder.encode_query(texts[:1]), encoder.encode_document(texts))[0].numpy()
    scores = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
    np.testing.assert_allclose([scores[i] for i in range(len(texts))], expected, rtol=1e-5, atol=1e-5)
