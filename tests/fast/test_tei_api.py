"""TEI's native routes in process (tests/fast/inprocess.py), against the fake engine: the
shapes of `/embed`, `/rerank`, `/predict`, `/similarity`, `/decode`, `/info` and `POST /`,
which dialect a shared path's body is, how a TEI body (which names no model) finds its
model, and TEI's error shape."""

from __future__ import annotations

import numpy as np
import pytest

from infinity.config import ConfigError, ModelConfig, load_config
from tests.fast.inprocess import scoring_models, serving_on_its_own_loop
from tests.support.tiny_models import save_tiny_classifier

pytestmark = pytest.mark.timeout(120)

TEXTS = ["a short sentence", "another sentence about servers", "x"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving_on_its_own_loop(model=scoring_models(tmp_path_factory.mktemp("tei"))) as client:
        yield client


def test_tei_embed_answers_the_vectors_of_v1_embeddings_as_a_bare_list(server):
    status, tei = server.ask("POST", "/embed", {"inputs": TEXTS})
    _, ours = server.ask("POST", "/v1/embeddings", {"input": TEXTS, "model": "m"})
    assert status == 200
    np.testing.assert_allclose(tei, [item["embedding"] for item in ours["data"]], atol=1e-6)
    status, one = server.ask("POST", "/embed", {"inputs": TEXTS[0], "dimensions": 8})
    assert status == 200 and len(one) == 1 and len(one[0]) == 8


def test_cohere_bodies_on_embed_keep_their_shape(server):
    status, cohere = server.ask("POST", "/embed", {"texts": TEXTS, "model": "m"})
    assert status == 200 and cohere["response_type"] == "embeddings_floats" and len(cohere["embeddings"]) == 3


def test_tei_fields_it_cannot_honour_are_422s_in_teis_error_shape(server):
    for body, field in (({"inputs": "a", "truncation_direction": "Up"}, "truncation_direction"),
                        ({"inputs": "a " * 2000, "truncate": False}, "truncate")):
        status, error = server.ask("POST", "/embed", body)
        assert status == 422 and set(error) == {"error", "error_type"}, (body, error)
        assert error["error_type"] == "Validation" and field in error["error"], error
    status, error = server.ask("POST", "/v1/embed", {"texts": []})
    assert status == 422 and "message" in error["error"]  # our own shape off TEI's bodies


def test_tei_rerank_truncate_false_refuses_a_text_too_long_beside_the_query(server):
    texts = ["a short text", "word " * 2000]
    status, ranked = server.ask("POST", "/rerank", {"query": "q", "texts": texts[:1], "truncate": False})
    assert status == 200 and len(ranked) == 1
    status, error = server.ask("POST", "/rerank", {"query": "q", "texts": texts, "truncate": False})
    assert status == 422 and set(error) == {"error", "error_type"} and "truncate" in error["error"], error
    status, cut = server.ask("POST", "/rerank", {"query": "q", "texts": texts, "truncate": True})
    assert status == 200 and len(cut) == 2


def test_tei_rerank_answers_every_text_best_first_with_v1_reranks_scores(server):
    query, texts = "what is a server", ["a server serves", "bananas", "servers answer requests"]
    status, tei = server.ask("POST", "/rerank", {"query": query, "texts": texts, "return_text": True})
    _, ours = server.ask("POST", "/rerank", {"query": query, "documents": texts, "model": "rerank"})
    assert status == 200 and "results" in ours
    assert [r["index"] for r in tei] == [r["index"] for r in ours["results"]]
    np.testing.assert_allclose([r["score"] for r in tei], [r["relevance_score"] for r in ours["results"]], atol=1e-6)
    assert [r["text"] for r in tei] == [texts[r["index"]] for r in tei]
    assert [r["score"] for r in tei] == sorted((r["score"] for r in tei), reverse=True)
    _, plain = server.ask("POST", "/rerank", {"query": query, "texts": texts})
    assert all("text" not in r for r in plain)


def test_predict_answers_a_flat_list_for_a_text_and_a_list_per_input_for_a_batch(server):
    status, one = server.ask("POST", "/predict", {"inputs": TEXTS[0]})
    _, ours = server.ask("POST", "/v1/classify", {"input": TEXTS, "model": "classify"})
    assert status == 200 and one == [{"score": p["score"], "label": p["label"]} for p in ours["data"][0]]
    status, batch = server.ask("POST", "/predict", {"inputs": [[TEXTS[0]], TEXTS[1], TEXTS[2]], "raw_scores": True})
    assert status == 200 and len(batch) == 3 and len(batch[0]) == len(one)
    status, pair = server.ask("POST", "/predict", {"inputs": TEXTS[:2]})  # TEI reads two texts as a pair
    assert status == 200 and isinstance(pair[0], dict) and pair != one
    status, mixed = server.ask("POST", "/predict", {"inputs": [TEXTS[:2], [TEXTS[2]], [TEXTS[0], TEXTS[2]], TEXTS[:2]]})
    assert status == 200 and mixed[0] == mixed[3] == pair and mixed[1] == server.ask("POST", "/predict",
                                                                                      {"inputs": TEXTS[2]})[1]
    assert mixed[2] == server.ask("POST", "/predict", {"inputs": [TEXTS[0], TEXTS[2]]})[1] != pair
    status, error = server.ask("POST", "/predict", {"inputs": TEXTS[:2], "truncation_direction": "Left"})
    assert status == 422 and "truncation_direction" in error["error"]


def test_similarity_is_the_cosine_of_the_embeddings(server):
    _, vectors = server.ask("POST", "/embed", {"inputs": TEXTS})
    status, cosines = server.ask("POST", "/similarity", {"inputs": {"source_sentence": TEXTS[0],
                                                                    "sentences": TEXTS[1:]}})
    assert status == 200
    np.testing.assert_allclose(cosines, np.array(vectors[1:]) @ np.array(vectors[0]), atol=1e-5)


def test_decode_info_and_the_root_route(server):
    _, tokens = server.ask("POST", "/tokenize", {"inputs": "hello world", "model": "m"})
    ids = [t["id"] for t in tokens[0]]
    status, texts = server.ask("POST", "/decode", {"ids": ids})
    assert status == 200 and texts == ["hello world"]
    status, info = server.ask("GET", "/info")
    assert status == 200 and info["model_id"] == "m" and "embedding" in info["model_type"]
    assert info["max_input_length"] > 0 and info["max_client_batch_size"] > 0
    _, embedded = server.ask("POST", "/", {"inputs": TEXTS})
    _, tei = server.ask("POST", "/embed", {"inputs": TEXTS})
    assert embedded == tei
    _, similar = server.ask("POST", "/", {"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}})
    assert len(similar) == 2 and similar[0] == pytest.approx(1.0, abs=1e-5)


def test_a_tei_body_needs_one_model_of_its_kind_or_a_default(tmp_path):
    models = [ModelConfig(name="m", engine="torch"), ModelConfig(name="m2", engine="torch")]
    with serving_on_its_own_loop(model=models) as client:
        status, error = client.ask("POST", "/embed", {"inputs": "a"})
        assert status == 422 and "m, m2" in error["error"] and "default = true" in error["error"]
    with serving_on_its_own_loop(model=[models[0], ModelConfig(name="m2", engine="torch", default=True)]) as client:
        status, vectors = client.ask("POST", "/embed", {"inputs": "a"})
        assert status == 200 and len(vectors) == 1
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "a"\nkind = "embed"\ndefault = true\n'
                    '[[models]]\nname = "b"\nkind = "embed"\ndefault = true\n')
    with pytest.raises(ConfigError, match="default"):
        load_config(path, env={})


def test_normalize_on_a_model_without_normalize_and_truncate_on_a_model_that_refuses_long_inputs():
    model = ModelConfig(name="raw", engine="torch", normalize=False, long_inputs="error")
    with serving_on_its_own_loop(model=[model]) as client:
        _, ours = client.ask("POST", "/v1/embeddings", {"input": TEXTS})
        raw = np.array([item["embedding"] for item in ours["data"]])
        assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
        status, as_is = client.ask("POST", "/embed", {"inputs": TEXTS, "normalize": False})
        assert status == 200
        np.testing.assert_allclose(as_is, raw, atol=1e-6)
        _, normalised = client.ask("POST", "/embed", {"inputs": TEXTS})
        np.testing.assert_allclose(normalised, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
        long_text = "word " * 1000
        status, _ = client.ask("POST", "/embed", {"inputs": long_text})
        assert status == 422  # the model refuses long inputs...
        status, cut = client.ask("POST", "/embed", {"inputs": long_text, "truncate": True})
        assert status == 200 and len(cut) == 1  # ...but TEI's truncate: true cuts them


def test_shared_paths_tell_the_dialect_by_the_body(server):
    status, ranked = server.ask("POST", "/rerank", {"query": "a", "documents": ["b"], "model": "rerank"})
    assert status == 200 and "results" in ranked  # documents: Cohere's
    # documents with TEI's texts: Cohere's body, which does not take texts: refused naming them.
    status, error = server.ask("POST", "/rerank", {"query": "a", "texts": ["b"], "documents": ["b"], "model": "rerank"})
    assert status == 422 and error["error"]["param"] == "texts", error
    status, error = server.ask("POST", "/embed", {"inputs": [{"content": [{"type": "text", "text": "a"}]}],
                                                  "model": "m"})
    assert status == 200 and "embeddings" in error  # v2's content parts: Cohere's
    status, error = server.ask("POST", "/embed", {})
    assert status == 422 and error["error_type"] == "Validation" and "inputs" in error["error"]
    for path in ("/embed", "/rerank", "/"):  # not an object: no dialect's body, refused as such
        status, error = server.ask("POST", path, ["a"])
        assert status == 422 and "object" in str(error), (path, error)


def test_the_root_route_classifies_where_the_first_model_is_a_classifier(tmp_path):
    models = [ModelConfig(name="classify", source=str(save_tiny_classifier(tmp_path / "c")), engine="torch")]
    with serving_on_its_own_loop(model=models) as client:
        _, predicted = client.ask("POST", "/predict", {"inputs": TEXTS[0], "raw_scores": True})
        status, root = client.ask("POST", "/", {"inputs": TEXTS[0], "raw_scores": True})
        assert status == 200 and root == predicted and {"score", "label"} == set(root[0])
        status, info = client.ask("GET", "/info")
        assert set(info["model_type"]["classifier"]["label2id"]) == {p["label"] for p in root}


def test_a_tei_only_route_answers_errors_raised_before_its_body_is_read_in_teis_shape(server):
    async def ask() -> tuple[int, dict]:
        answer = await server.client.post("/predict", data=b"inputs=a", headers={"Content-Type": "text/plain"})
        return answer.status, await answer.json()

    status, error = server.loop.run_until_complete(ask())
    assert status == 415 and error == {"error": error["error"], "error_type": "Validation"}
    status, error = server.ask("POST", "/v1/classify", {})  # our own routes keep their shape
    assert status == 422 and set(error) == {"error"} and "message" in error["error"]


def test_embed_all_answers_each_tokens_state_from_the_engine(server):
    from tokenizers import Tokenizer

    from infinity.folders.resolve import resolve_model
    from tests.fast.inprocess import token_states

    tokenizer = Tokenizer.from_file(f"{resolve_model(ModelConfig(name='m')).path}/tokenizer.json")
    tokenizer.no_padding()
    status, states = server.ask("POST", "/embed_all", {"inputs": TEXTS[:2]})
    assert status == 200 and len(states) == 2
    for text, rows in zip(TEXTS, states):
        ids = tokenizer.encode(text).ids
        np.testing.assert_allclose(rows, token_states(np.array(ids), 384), atol=1e-6)
    status, error = server.ask("POST", "/embed_all", {"inputs": "a " * 2000, "truncate": False})
    assert status == 422 and "truncate" in error["error"]
    status, cut = server.ask("POST", "/embed_all", {"inputs": "a " * 2000})
    assert status == 200 and len(cut[0]) == resolve_model(ModelConfig(name="m")).max_length
