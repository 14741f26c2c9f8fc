"""vLLM's `/score` on a real server: a cross-encoder's pairs score as sentence-transformers'
CrossEncoder scores them (its logits with `use_activation: false`), one query against many
documents and pairs of different queries in one request; an embedder's as the cosine of
sentence-transformers' vectors."""

from __future__ import annotations

import numpy as np

from tests.support.reference import MODEL_NAME, SAME_SCORES_ATOL
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


def test_use_activation_false_answers_logits_on_rerank_and_classify(scoring_server):
    from tests.support.tiny_models import CLASSIFIER_LABELS, CLASSIFIER_NAME

    def rerank(**fields):
        answer = scoring_server.post("/v1/rerank", {"model": RERANKER_NAME, "query": QUERIES[0],
                                                    "documents": DOCUMENTS, **fields})
        assert answer.status_code == 200, answer.text
        return {item["index"]: item["relevance_score"] for item in answer.json()["results"]}

    logits, raw, activated = rerank(use_activation=False), rerank(raw_scores=True), rerank()
    assert logits.keys() == raw.keys() == activated.keys()
    np.testing.assert_allclose([logits[i] for i in raw], list(raw.values()), atol=SAME_SCORES_ATOL)
    assert not np.allclose([activated[i] for i in raw], list(raw.values()), atol=SAME_SCORES_ATOL)

    def classify(**fields):
        answer = scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME, "input": DOCUMENTS, **fields})
        assert answer.status_code == 200, answer.text
        return answer.json()["data"]

    # vLLM's field asks vLLM's answer: every class's value in label order, its best label.
    raw, probabilities = classify(raw_scores=True), classify()
    assert not np.allclose([s["score"] for row in raw for s in row], [s["score"] for row in probabilities for s in row],
                           atol=SAME_SCORES_ATOL)
    for use_activation, expected in ((False, raw), (True, probabilities)):
        for item, row in zip(classify(use_activation=use_activation), expected, strict=True):
            by_label = {score["label"]: score["score"] for score in row}
            assert item["label"] == row[0]["label"] and item["num_classes"] == len(CLASSIFIER_LABELS)
            np.testing.assert_allclose(item["probs"], [by_label[label] for label in CLASSIFIER_LABELS],
                                       atol=SAME_SCORES_ATOL)
    refused = scoring_server.post("/v1/rerank", {"model": RERANKER_NAME, "query": "q", "documents": ["d"],
                                                 "truncate_prompt_tokens": 4})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


def test_pooling_gives_a_classifiers_probabilities_in_label_order(scoring_server):
    from tests.support.tiny_models import CLASSIFIER_LABELS, CLASSIFIER_NAME

    for use_activation in (True, False):
        pooled = scoring_server.post("/pooling", {"model": CLASSIFIER_NAME, "input": DOCUMENTS,
                                                  "use_activation": use_activation})
        assert pooled.status_code == 200, pooled.text
        classified = scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME, "input": DOCUMENTS,
                                                          "raw_scores": not use_activation}).json()
        for item, scores in zip(pooled.json()["data"], classified["data"], strict=True):
            by_label = {score["label"]: score["score"] for score in scores}
            np.testing.assert_allclose(item["data"], [by_label[label] for label in CLASSIFIER_LABELS],
                                       atol=SAME_SCORES_ATOL)
