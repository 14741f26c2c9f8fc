"""vLLM's `/score` on a real server: a cross-encoder's pairs score as sentence-transformers'
CrossEncoder scores them (its logits with `use_activation: false`), one query against many
documents and pairs of different queries in one request; an embedder's as the cosine of
sentence-transformers' vectors."""

from __future__ import annotations

import numpy as np

from tests.support.reference import MODEL_NAME
from tests.support.tiny_models import RERANKER_NAME

QUERIES = ["the quick fox", "seven wizards", "the quick fox"]
DOCUMENTS = ["a lazy dog", "quick brown fox jumps", "seven wizards judge boxing matches of jumbo sized quartz"]


def _scores(server, **body) -> list[float]:
    answer = server.post("/score", body)
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return [item["score"] for item in data]


def test_a_cross_encoders_pairs_score_as_sentence_transformers(scoring_server, models_root):
    import torch
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(models_root / "reranker"), device="cpu")
    pairs = list(zip(QUERIES, DOCUMENTS))
    np.testing.assert_allclose(_scores(scoring_server, model=RERANKER_NAME, text_1=QUERIES, text_2=DOCUMENTS),
                               reference.predict(pairs), atol=1e-5)
    np.testing.assert_allclose(
        _scores(scoring_server, model=RERANKER_NAME, queries=QUERIES[0], documents=DOCUMENTS, use_activation=False),
        reference.predict([(QUERIES[0], d) for d in DOCUMENTS], activation_fn=torch.nn.Identity()),
        atol=1e-5)


def test_an_embedders_pairs_score_as_the_cosine_of_sentence_transformers_vectors(scoring_server, reference_model):
    first = reference_model.encode(QUERIES, normalize_embeddings=True)
    second = reference_model.encode(DOCUMENTS, normalize_embeddings=True)
    np.testing.assert_allclose(_scores(scoring_server, model=MODEL_NAME, text_1=QUERIES, text_2=DOCUMENTS),
                               (first * second).sum(axis=1), atol=1e-5)
