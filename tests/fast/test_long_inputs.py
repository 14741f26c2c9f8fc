"""Inputs longer than the model, the whole request path in one process on tiny folders
(tests/fast/inprocess.py's `ModelLauncher`): chunked inputs held to sentence-transformers'
vectors of each window, averaged by hand (the formula of docs/api.md), with and without a prompt
and overlap; `usage` counting every chunk; "error" naming the input and its tokens; the cap
on chunks (422, and the server serves on); the queue's room for chunks (429, a less urgent
request's share too); per-request overrides; long documents reranked
as their best chunk, held to CrossEncoder.predict on each; the fields in the OpenAPI document."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from infinity.config import ModelConfig
from tests.fast.inprocess import LoopedClient, ModelLauncher, serving_on_its_own_loop
from tests.support.tiny_models import WORDS, save_tiny_cross_encoder, save_tiny_multivector, save_tiny_prompted_encoder

pytestmark = pytest.mark.timeout(120)

MAX_LENGTH = 16  # the embedders' (two special tokens around each window)
RERANK_MAX_LENGTH = 24
MAX_CHUNKS = 4
# Words of the tiny vocabulary, one token each: a window of n tokens is n words.
LONG = " ".join((WORDS * 3)[:30])
QUERY = "the quick fox"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long")
    return {"embedder": save_tiny_prompted_encoder(root / "embedder", {"query": "query: "}, seed=5),
            "reranker": save_tiny_cross_encoder(root / "reranker", seed=6),
            "multivector": save_tiny_multivector(root / "multivector", seed=7)}


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> Iterator[LoopedClient]:
    embedder = {"source": str(folders["embedder"]), "engine": "torch", "max_length": MAX_LENGTH}
    with serving_on_its_own_loop(ModelLauncher(), model=[
            ModelConfig(name="chunked", long_inputs="chunk", max_chunks_per_input=MAX_CHUNKS, **embedder),
            ModelConfig(name="refusing", long_inputs="error", **embedder),
            ModelConfig(name="reranker", source=str(folders["reranker"]), engine="torch",
                        max_length=RERANK_MAX_LENGTH),
            ModelConfig(name="multivector", source=str(folders["multivector"]), engine="torch",
                        max_length=MAX_LENGTH)]) as client:
        yield client


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]):  # noqa: ANN201 (sentence-transformers stays lazy)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folders["embedder"]), device="cpu")
    words = LONG.split()
    assert len(model.tokenizer(LONG, add_special_tokens=False)["input_ids"]) == len(words)  # a word, a token
    return model


def _windows(words: list[str], budget: int, overlap: int) -> list[str]:
    """The texts of windows of `budget` one-token words, `overlap` shared, by hand."""
    spans, start = [], 0
    while True:
        spans.append(" ".join(words[start:start + budget]))
        if start + budget >= len(words):
            return spans
        start += budget - overlap


@pytest.mark.parametrize("fields, prompt", [
    ({}, ""),
    ({"prompt_name": "query"}, "query: "),  # two tokens, in every window: 12 words each
    ({"chunk_overlap": 3}, ""),
])
def test_a_long_input_is_the_token_weighted_mean_of_its_windows(served, reference, fields, prompt):
    prompt_tokens = len(reference.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    windows = _windows(LONG.split(), MAX_LENGTH - 2 - prompt_tokens, fields.get("chunk_overlap", 0))
    assert len(windows) > 1
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": ["short one", LONG], **fields})
    assert status == 200, answer
    tokens = np.array([len(reference.tokenizer(prompt + window)["input_ids"]) for window in windows])
    vectors = reference.encode([prompt + window for window in windows])
    mean = tokens @ vectors / tokens.sum()
    got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
    np.testing.assert_allclose(got[1], mean / np.linalg.norm(mean), atol=2e-6)
    np.testing.assert_allclose(got[0], reference.encode(prompt + "short one"), atol=2e-6)
    billed = len(reference.tokenizer(prompt + "short one")["input_ids"]) + int(tokens.sum())
    assert answer["usage"] == {"prompt_tokens": billed, "total_tokens": billed, "truncated_inputs": 0}


def test_long_token_ids_are_windows_of_max_length_ids(served):
    ids = [5 + i % 30 for i in range(40)]
    windows = [ids[0:16], ids[16:32], ids[32:40]]
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": [ids]})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 40, answer
    _, apart = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": windows})
    vectors = np.array([item["embedding"] for item in apart["data"]])
    mean = np.array([16, 16, 8]) @ vectors / 40
    np.testing.assert_allclose(answer["data"][0]["embedding"], mean / np.linalg.norm(mean), atol=1e-6)


def test_an_input_long_in_characters_only_is_one_chunk_of_what_is_read(served):
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": [" " * 5000 + "fox"]})
    assert status == 200 and answer["usage"]["truncated_inputs"] == 1, answer


def test_a_request_may_chunk_what_its_model_refuses_and_cohere_too(served, reference):
    _, chunked = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": [LONG]})
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "refusing", "input": [LONG],
                                                            "long_inputs": "chunk"})
    assert status == 200, answer
    np.testing.assert_allclose(answer["data"][0]["embedding"], chunked["data"][0]["embedding"], atol=1e-6)
    status, answer = served.ask("POST", "/v1/embed", {"model": "refusing", "texts": [LONG], "long_inputs": "chunk"})
    assert status == 200, answer
    np.testing.assert_allclose(answer["embeddings"][0], chunked["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("path, body, tokens", [
    ("/v1/embeddings", {"model": "refusing", "input": ["fine", LONG]}, 32),  # 30 words and [CLS] [SEP]
    ("/v1/embeddings", {"model": "chunked", "input": ["fine", LONG], "long_inputs": "error"}, 32),
    ("/v1/embed", {"model": "chunked", "texts": ["fine", LONG], "truncate": "NONE"}, 32),
    ("/v1/embeddings", {"model": "refusing", "input": [[5], [5] * 40]}, 40),
])
def test_error_refuses_naming_the_input_and_its_tokens(served, path, body, tokens):
    status, answer = served.ask("POST", path, body)
    assert (status, answer["error"]["param"]) == (422, "input"), answer
    assert f"input[1] has {tokens} tokens, more than the maximum of {MAX_LENGTH}" in answer["error"]["message"]


def test_past_max_chunks_per_input_is_a_422_and_the_server_serves_on(served):
    too_long = " ".join((WORDS * 4)[:MAX_CHUNKS * (MAX_LENGTH - 2) + 1])
    for _ in range(3):  # the slots of refused requests come back
        status, answer = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": [too_long]})
        assert (status, answer["error"]["param"]) == (422, "input"), answer
        assert "max_chunks_per_input" in answer["error"]["message"]
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "chunked", "input": [LONG, "after"]})
    assert status == 200 and len(answer["data"]) == 2, answer


def test_chunks_find_no_room_in_a_full_queue_and_are_answered_429(folders):
    """Slots for the chunks are taken once the tokenizer has counted them: a queue of two
    admits a request of one input, then has no room for its three chunks."""
    model = ModelConfig(name="chunked", source=str(folders["embedder"]), engine="torch", max_length=MAX_LENGTH,
                        long_inputs="chunk")
    with serving_on_its_own_loop(ModelLauncher(), model=model, max_queued_items=2) as client:
        status, answer = client.ask("POST", "/v1/embeddings", {"input": [LONG]})
        assert status == 429 and "chunks" in answer["error"]["message"], answer
        assert client.ask("POST", "/v1/embeddings", {"input": ["fits", "two"]})[0] == 200


def test_chunks_of_a_less_urgent_request_count_against_its_share_of_the_queue(folders):
    """A request of priority above 0 may hold max_queued_items_low_priority slots, chunks
    included: its one input is admitted, its three chunks are not; at priority 0 they are."""
    model = ModelConfig(name="chunked", source=str(folders["embedder"]), engine="torch", max_length=MAX_LENGTH,
                        long_inputs="chunk")
    with serving_on_its_own_loop(ModelLauncher(), model=model, max_queued_items=8,
                                 max_queued_items_low_priority=2) as client:
        status, answer = client.ask("POST", "/v1/embeddings", {"input": [LONG], "priority": 1})
        assert status == 429 and "chunks" in answer["error"]["message"], answer
        assert "priority above 0" in answer["error"]["message"], answer
        assert client.ask("POST", "/v1/embeddings", {"input": ["fits", "two"], "priority": 1})[0] == 200
        assert client.ask("POST", "/v1/embeddings", {"input": [LONG]})[0] == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "refusing", "input": ["x"], "chunk_overlap": 2}, "chunk_overlap"),  # nothing chunked
    ("/v1/embeddings", {"model": "chunked", "input": ["x"], "chunk_overlap": MAX_LENGTH // 2}, "chunk_overlap"),
    ("/v1/embed", {"model": "chunked", "texts": ["x"], "truncate": "END", "long_inputs": "chunk"}, "long_inputs"),
    ("/v1/rerank", {"model": "reranker", "query": QUERY, "documents": ["x"], "max_chunks_per_doc": 65},
     "max_chunks_per_doc"),  # the reranker's max_chunks_per_input: 64
])
def test_what_chunking_cannot_honour_is_refused(served, path, body, param):
    status, answer = served.ask("POST", path, body)
    assert (status, answer["error"]["param"]) == (422, param), answer


def test_a_long_document_scores_as_its_best_chunk_as_cross_encoder_predicts(served, folders):
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(str(folders["reranker"]), device="cpu")
    query_tokens = len(cross_encoder.tokenizer(QUERY, add_special_tokens=False)["input_ids"])
    documents = ["a lazy dog", LONG]
    status, answer = served.ask("POST", "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": documents,
                                                       "max_chunks_per_doc": 8, "chunk_overlap": 8})
    assert status == 200, answer
    chunks = _windows(LONG.split(), RERANK_MAX_LENGTH - 3 - query_tokens, 8)
    assert len(chunks) == 3
    scores = cross_encoder.predict([(QUERY, chunk) for chunk in chunks])
    short = cross_encoder.predict([(QUERY, documents[0])])[0]
    results = {result["index"]: result for result in answer["results"]}
    assert results[1]["chunk_index"] == int(np.argmax(scores)) and results[0]["chunk_index"] == 0
    np.testing.assert_allclose([results[0]["relevance_score"], results[1]["relevance_score"]],
                               [short, scores.max()], atol=1e-5)
    # Cohere's rule: a document is scored on its first max_chunks_per_doc chunks.
    _, first_two = served.ask("POST", "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": [LONG],
                                                     "max_chunks_per_doc": 2, "chunk_overlap": 8})
    assert first_two["results"][0]["relevance_score"] == pytest.approx(float(scores[:2].max()), abs=1e-5)
    assert first_two["usage"]["truncated_inputs"] == 1
    _, plain = served.ask("POST", "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": documents})
    assert "chunk_index" not in plain["results"][0]


def test_a_multi_vector_models_long_document_scores_as_its_best_chunks_maxsim(served, folders):
    from sentence_transformers import MultiVectorEncoder

    encoder = MultiVectorEncoder(str(folders["multivector"]), device="cpu")
    status, answer = served.ask("POST", "/v1/rerank", {"model": "multivector", "query": QUERY, "documents": [LONG],
                                                       "max_chunks_per_doc": 8})
    assert status == 200, answer
    chunks = _windows(LONG.split(), MAX_LENGTH - 2, 0)
    (query,) = (rows.float().numpy() for rows in encoder.encode_query([QUERY]))
    scores = [float((query @ rows.float().numpy().T).max(axis=1).sum()) for rows in encoder.encode_document(chunks)]
    (result,) = answer["results"]
    assert result["chunk_index"] == int(np.argmax(scores))
    assert result["relevance_score"] == pytest.approx(max(scores), abs=1e-4)


def test_the_openapi_document_has_the_long_input_fields(served):
    _, document = served.ask("GET", "/openapi.json")
    schemas = document["components"]["schemas"]
    for body in ("EmbeddingRequest", "CohereEmbedRequest"):
        assert {"long_inputs", "chunk_overlap"} <= set(schemas[body]["properties"]), body
    assert "NONE" in str(schemas["CohereEmbedRequest"]["properties"]["truncate"])
    assert {"max_chunks_per_doc", "chunk_overlap"} <= set(schemas["RerankRequest"]["properties"])
    assert "chunk_index" in schemas["RerankResult"]["properties"]


@pytest.mark.parametrize("words, budget, overlap, windows", [
    ([0, 0, 1, 1, 1, 2], 4, 0, [(0, 2), (2, 6)]),  # a window stops before the word it would cut
    ([0, 0, 0, 0, 0, 1], 3, 0, [(0, 3), (3, 6)]),  # unless that word alone is longer than a window
    ([0, 1, 2, 3, 4, 5, 6], 4, 2, [(0, 4), (2, 6), (4, 7)]),
    ([0, 1, 1, 2, 3, 4, 5], 4, 1, [(0, 4), (3, 7)]),  # overlap starts at a word's first token
])
def test_windows_cut_between_words(words, budget, overlap, windows):
    from workers.preprocess.text import _windows

    assert _windows(words, budget, overlap, 10) == windows


def test_chunks_a_model_cannot_combine_stop_the_start(tmp_path):
    from infinity.config import ConfigError
    from infinity.folders.resolve import resolve_model
    from tests.support.tiny_models import save_tiny_sparse

    with pytest.raises(ConfigError, match="not for kind 'sparse'"):
        resolve_model(ModelConfig(name="s", source=str(save_tiny_sparse(tmp_path / "sparse")), long_inputs="chunk"))
    with pytest.raises(ConfigError, match="truncate = false"):
        ModelConfig(truncate=False, long_inputs="chunk")
