"""TEI's native routes on a real server (the scoring server: the default embedder, a tiny
cross-encoder and classifiers, the classifier marked default), through huggingface_hub's
InferenceClient and raw HTTP, each held to our own routes' answers for the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.reference import MODEL_NAME, SAME_SCORES_ATOL, assert_close
from tests.support.tiny_models import CLASSIFIER_NAME, RERANKER_NAME

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The cat sat on the mat.", "Embeddings map texts to vectors.", "A third, unrelated sentence."]


def _ours(server, texts: list[str]) -> np.ndarray:
    answer = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": texts}).json()
    return np.array([item["embedding"] for item in answer["data"]])


def test_inference_client_feature_extraction_and_similarity(scoring_server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=scoring_server.url(""))
    vectors = client.feature_extraction(TEXTS[0])
    np.testing.assert_allclose(np.asarray(vectors).reshape(1, -1), _ours(scoring_server, TEXTS[:1]), atol=1e-6)
    similarities = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    ours = _ours(scoring_server, TEXTS)
    np.testing.assert_allclose(similarities, ours[1:] @ ours[0], atol=1e-5)


def test_inference_client_text_classification_on_predict(scoring_server):
    from huggingface_hub import InferenceClient

    # TEI answers one text with a flat list, of which the client keeps the first: the top label.
    top = InferenceClient(model=scoring_server.url("/predict")).text_classification(TEXTS[0])
    ours = scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME, "input": [TEXTS[0]]}).json()["data"][0]
    assert top.label == ours[0]["label"] and top.score == pytest.approx(ours[0]["score"], abs=1e-6)


def test_embed_all_pools_into_the_models_vector(scoring_server):
    """The packaged embedder mean-pools and normalises its token states: the mean of
    `/embed_all`'s rows, normalised, is its `/v1/embeddings` vector."""
    states = scoring_server.post("/embed_all", {"inputs": TEXTS}).json()
    pooled = np.stack([np.mean(rows, axis=0) for rows in states])
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, _ours(scoring_server, TEXTS), atol=1e-5)


def test_normalize_false_is_sentence_transformers_without_its_normalize(scoring_server, reference_model):
    """TEI's `normalize: false` on the packaged embedder (mean, then Normalize): the mean
    itself, as sentence-transformers gives it run without its last module."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize

    modules = list(reference_model)
    assert isinstance(modules[-1], Normalize)
    expected = SentenceTransformer(modules=modules[:-1], device="cpu").encode(TEXTS, convert_to_numpy=True)
    got = np.array(scoring_server.post("/embed", {"inputs": TEXTS, "normalize": False}).json(), dtype=np.float32)
    for served, reference in zip(got, expected):
        assert_close(served, reference, "normalize: false")
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)


def test_predict_of_a_pair_is_the_classifiers_on_the_pair_as_transformers_reads_it(scoring_server, models_root):
    """TEI's pair form of /predict: both texts in one input, each in its own segment (BERT's
    token types), held to transformers' softmax of the pair."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = models_root / "classifier"
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[0], TEXTS[2]), (TEXTS[2], TEXTS[1])]
    with torch.no_grad():
        encoded = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
        assert encoded["token_type_ids"].any()
        expected = torch.softmax(model(**encoded).logits, -1).numpy()
    answer = scoring_server.post("/predict", {"inputs": [list(pair) for pair in pairs]})
    assert answer.status_code == 200, answer.text
    labels = model.config.id2label
    for row, probabilities in zip(answer.json(), expected, strict=True):
        served = {item["label"]: item["score"] for item in row}
        np.testing.assert_allclose([served[labels[i]] for i in range(len(labels))], probabilities, atol=1e-5)


def test_raw_tei_embed_rerank_predict_info_decode(scoring_server):
    vectors = scoring_server.post("/embed", {"inputs": TEXTS}).json()
    np.testing.assert_allclose(vectors, _ours(scoring_server, TEXTS), atol=1e-6)
    query = "what do embeddings do"
    tei = scoring_server.post("/rerank", {"query": query, "texts": TEXTS}).json()
    ours = scoring_server.post("/v1/rerank", {"model": RERANKER_NAME, "query": query, "documents": TEXTS}).json()
    assert [r["index"] for r in tei] == [r["index"] for r in ours["results"]]
    np.testing.assert_allclose([r["score"] for r in tei], [r["relevance_score"] for r in ours["results"]],
                               atol=SAME_SCORES_ATOL)
    batch = scoring_server.post("/predict", {"inputs": TEXTS}).json()
    classified = scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME, "input": TEXTS}).json()["data"]
    for predicted, row in zip(batch, classified, strict=True):  # two requests: SAME_SCORES_ATOL apart
        assert [p["label"] for p in predicted] == [p["label"] for p in row]
        np.testing.assert_allclose([p["score"] for p in predicted], [p["score"] for p in row], atol=SAME_SCORES_ATOL)
    info = scoring_server.get("/info").json()
    assert info["model_id"] == MODEL_NAME and "embedding" in info["model_type"]  # the first in models.toml
    ids = [t["id"] for t in scoring_server.post("/tokenize", {"model": MODEL_NAME, "inputs": "hello"}).json()[0]]
    assert scoring_server.post("/decode", {"ids": ids}).json() == ["hello"]
    error = scoring_server.post("/rerank", {"query": query, "texts": TEXTS, "truncation_direction": "Left"})
    assert error.status_code == 422 and error.json()["error_type"] == "Validation"
