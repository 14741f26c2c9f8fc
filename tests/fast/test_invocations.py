"""SageMaker's `/invocations` in process: each body goes to the route its keys belong to
and is answered as that route answers it (vLLM's shapes for a classifier and a
reranker, TEI's for TEI's bodies, errors in the body's dialect); and `/classify` answers
vLLM's shape where the body holds vLLM's fields, infinity's otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from tests.fast.inprocess import scoring_models, serving_on_its_own_loop

pytestmark = pytest.mark.timeout(120)

TEXTS = ["a short sentence", "another sentence about servers", "x"]
QUERY = "what is a server"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving_on_its_own_loop(model=scoring_models(tmp_path_factory.mktemp("invocations"))) as client:
        yield client


def _invoke(server, body: dict) -> object:
    status, answer = server.ask("POST", "/invocations", body)
    assert status == 200, answer
    return answer


def test_embeddings_bodies_embed(server):
    _, ours = server.ask("POST", "/v1/embeddings", {"model": "m", "input": TEXTS})
    answer = _invoke(server, {"model": "m", "input": TEXTS})
    assert answer["object"] == "list" and answer["id"].startswith("embd-")
    np.testing.assert_allclose([item["embedding"] for item in answer["data"]],
                               [item["embedding"] for item in ours["data"]], atol=1e-6)
    pooled = _invoke(server, {"model": "m", "input": TEXTS, "task": "embed"})
    assert pooled["id"].startswith("pool-")
    np.testing.assert_allclose([item["data"] for item in pooled["data"]],
                               [item["embedding"] for item in ours["data"]], atol=1e-6)


def test_a_classifiers_body_is_answered_in_vllms_shape(server):
    _, ours = server.ask("POST", "/v1/classify", {"model": "classify", "input": TEXTS})
    answer = _invoke(server, {"model": "classify", "input": TEXTS})
    assert answer["object"] == "list" and answer["id"].startswith("classify-")
    for item, row in zip(answer["data"], ours["data"], strict=True):
        by_label = {score["label"]: score["score"] for score in row}
        assert item["label"] == row[0]["label"] and item["num_classes"] == len(row)
        assert sorted(item["probs"], reverse=True) == pytest.approx([score["score"] for score in row], abs=1e-6)
        assert max(item["probs"]) == pytest.approx(by_label[item["label"]], abs=1e-6)


def test_classify_answers_vllms_shape_where_the_body_holds_vllms_fields(server):
    _, infinity = server.ask("POST", "/classify", {"model": "classify", "input": TEXTS})
    assert infinity["object"] == "classify" and isinstance(infinity["data"][0], list)
    for fields in ({"use_activation": True}, {"truncate_prompt_tokens": -1}, {"add_special_tokens": True}):
        status, vllm = server.ask("POST", "/classify", {"model": "classify", "input": TEXTS, **fields})
        assert status == 200 and vllm["object"] == "list", (fields, vllm)
        assert [item["label"] for item in vllm["data"]] == [row[0]["label"] for row in infinity["data"]]
    status, logits = server.ask("POST", "/classify", {"model": "classify", "input": TEXTS, "use_activation": False})
    _, raw = server.ask("POST", "/classify", {"model": "classify", "input": TEXTS, "raw_scores": True})
    assert status == 200
    for item, row in zip(logits["data"], raw["data"], strict=True):
        assert sorted(item["probs"], reverse=True) == pytest.approx([score["score"] for score in row], abs=1e-6)
    status, bare = server.ask("POST", "/classify", {"model": "classify", "input": TEXTS, "add_special_tokens": False})
    assert status == 200 and bare["object"] == "list" and bare["data"] != vllm["data"]  # read without [CLS], [SEP]


def test_rerank_and_score_bodies_score(server):
    _, ours = server.ask("POST", "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": TEXTS})
    answer = _invoke(server, {"model": "rerank", "query": QUERY, "documents": TEXTS, "return_documents": True})
    assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == [
        (r["index"], r["relevance_score"]) for r in ours["results"]]
    assert answer["results"][0]["document"] == {"text": TEXTS[answer["results"][0]["index"]]}  # vLLM's object
    scored = _invoke(server, {"model": "rerank", "text_1": QUERY, "text_2": TEXTS})
    by_index = {r["index"]: r["relevance_score"] for r in ours["results"]}
    assert [item["score"] for item in scored["data"]] == pytest.approx([by_index[i] for i in range(3)], abs=1e-6)


def test_teis_bodies_are_teis_root(server):
    _, ours = server.ask("POST", "/v1/embeddings", {"model": "m", "input": TEXTS})
    vectors = _invoke(server, {"inputs": TEXTS})
    np.testing.assert_allclose(vectors, [item["embedding"] for item in ours["data"]], atol=1e-6)
    ranked = _invoke(server, {"query": QUERY, "texts": TEXTS})
    assert sorted(item["index"] for item in ranked) == [0, 1, 2] and "score" in ranked[0]


def test_errors_answer_in_the_bodys_dialect(server):
    status, error = server.ask("POST", "/invocations", {"inputs": 5})
    assert status == 422 and set(error) == {"error", "error_type"}, error
    # No model named, and two that embed or classify: the only embedder's body, as vLLM's one model's.
    assert _invoke(server, {"input": TEXTS})["model"] == "m"
    status, error = server.ask("POST", "/invocations", {"model": "nope", "input": TEXTS})
    assert status == 404 and error["error"]["param"] == "model", error
    status, error = server.ask("POST", "/invocations", [1, 2])
    assert status == 422 and "message" in error["error"], error
