"""End to end: reranking. One server (module scope) serves the packaged embedder, a tiny
random-weight BERT cross-encoder and a tiny classifier from one models.toml; its
`/v1/rerank` (also `/rerank`, `/v2/rerank`) must agree with sentence-transformers'
`CrossEncoder.predict`, speak the Cohere (v1 and v2 clients) and Jina shapes, handle
`top_n` / `return_documents` / `raw_scores`, refuse bad input with the JSON error shape
(never a 5xx), refuse models of another kind with 400, and keep serving afterwards.

Truncation: the server cuts query-document pairs on the document side only (the query is
kept), i.e. transformers' `truncation="only_second"`. `CrossEncoder` cuts with
`"longest_first"`, which is the same as long as the query is no longer than what is left
of the document; the pairs with long queries below therefore take their reference from
`CrossEncoder.predict(..., processing_kwargs={"text": {"truncation": "only_second"}})`,
itself checked against the model run directly on the HF tokenizer's `only_second` pairs.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from tests.support.answers import assert_error
from tests.support.reference import MODEL_NAME
from tests.support.tiny_models import CLASSIFIER_NAME, RERANKER_NAME, SCORING_MAX_LENGTH, scoring_text

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-4
MAX_ITEMS_PER_REQUEST = 2048  # the server's default --max-items-per-request
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


# --- the server and the references --------------------------------------------------------

class Reference:
    """The tiny cross-encoder, as sentence-transformers and transformers load it from the
    saved folder (never from a freshly trained tokenizer)."""

    def __init__(self, folder) -> None:
        import torch
        from sentence_transformers import CrossEncoder
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(2)
        self.torch = torch
        self.cross_encoder = CrossEncoder(str(folder), max_length=SCORING_MAX_LENGTH, device="cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
        assert self.cross_encoder.num_labels == 1
        assert self.cross_encoder.max_seq_length == SCORING_MAX_LENGTH

    def predict(self, pairs: list[tuple[str, str]], raw: bool = False, only_second: bool = True,
                batch_size: int = 32) -> np.ndarray:
        """CrossEncoder.predict: sigmoid (its default for one label) or the raw logit."""
        kwargs = {"processing_kwargs": {"text": {"truncation": "only_second"}}} if only_second else {}
        if raw:
            kwargs["activation_fn"] = self.torch.nn.Identity()
        scores = self.cross_encoder.predict(pairs, batch_size=batch_size, show_progress_bar=False, **kwargs)
        return np.asarray(scores, dtype=np.float64)

    def encode(self, pairs: list[tuple[str, str]]):
        return self.tokenizer([q for q, _ in pairs], [d for _, d in pairs], truncation="only_second",
                              max_length=SCORING_MAX_LENGTH)

    def direct_logits(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """The model run directly on the HF tokenizer's only_second pairs, one at a time."""
        out = []
        encoded = self.encode(pairs)
        with self.torch.no_grad():
            for i in range(len(pairs)):
                features = {k: self.torch.tensor([v[i]]) for k, v in encoded.items()}
                out.append(float(self.model(**features).logits[0, 0]))
        return np.asarray(out, dtype=np.float64)

    def token_counts(self, pairs: list[tuple[str, str]]) -> list[int]:
        return [len(ids) for ids in self.encode(pairs)["input_ids"]]

    def query_tokens(self, query: str) -> int:
        return len(self.tokenizer(query)["input_ids"]) - 2


@pytest.fixture(scope="module")
def reference(scoring_server, models_root) -> Reference:  # the server fixture built the models
    return Reference(models_root / "reranker")


def make_rerank_set(seed: int = 7) -> list[tuple[str, list[str]]]:
    """13 queries of 1 to ~30 words with 10 distinct documents each (130 pairs): documents
    from one word to 150 words (many longer than the reranker's 64 tokens)."""
    rng = random.Random(seed)
    query_words = [1, 2, 3, 4, 6, 8, 10, 12, 3, 5, 16, 22, 28]
    doc_words = [1, 2, 5, 9, 14, 20, 30, 45, 80, 150]
    out = []
    for n in query_words:
        query = scoring_text(rng, n)
        docs: list[str] = []
        for m in doc_words:
            doc = scoring_text(rng, m)
            while doc in docs:
                doc = scoring_text(rng, m)
            docs.append(doc)
        rng.shuffle(docs)
        out.append((query, docs))
    return out


RERANK_SET = make_rerank_set()


def all_pairs(rerank_set=RERANK_SET) -> list[tuple[str, str]]:
    return [(query, doc) for query, docs in rerank_set for doc in docs]


@pytest.fixture(scope="module")
def reference_scores(reference) -> dict[tuple[str, str], tuple[float, float]]:
    """(query, document) -> (relevance score, raw logit), from CrossEncoder (only_second)."""
    pairs = all_pairs()
    scores = reference.predict(pairs)
    logits = reference.predict(pairs, raw=True)
    return {pair: (float(s), float(l)) for pair, s, l in zip(pairs, scores, logits)}


def rerank(server, query, documents, model=RERANKER_NAME, path="/v1/rerank", **fields) -> requests.Response:
    return server.post(path, {"model": model, "query": query, "documents": documents, **fields})


def check_response(body: dict, documents: list, expected_count: int | None = None,
                   return_documents: bool = False) -> list[dict]:
    """The rerank response shape; return its results."""
    assert isinstance(body.get("id"), str) and body["id"], body.get("id")
    assert body.get("model") == RERANKER_NAME, body.get("model")
    assert isinstance(body.get("meta"), dict), body
    usage = body.get("usage")
    assert isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int), usage
    assert usage["total_tokens"] > 0, usage
    results = body["results"]
    count = len(documents) if expected_count is None else expected_count
    assert len(results) == count, f"{len(results)} results, expected {count}"
    indices = [r["index"] for r in results]
    assert len(set(indices)) == len(indices), f"repeated indices {indices}"
    assert all(isinstance(i, int) and 0 <= i < len(documents) for i in indices), indices
    scores = [r["relevance_score"] for r in results]
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
    assert scores == sorted(scores, reverse=True), f"results not sorted by relevance_score: {scores}"
    for result in results:
        if return_documents:
            document = documents[result["index"]]
            text = document["text"] if isinstance(document, dict) else document
            assert result.get("document") == {"text": text}, result
        else:
            assert "document" not in result, result
    return results


def assert_matches(results: list[dict], query: str, documents: list[str], expected, raw: bool = False,
                   what: str = "") -> None:
    """Each result's score equals the reference score of its (query, document) pair."""
    worst = 0.0
    for result in results:
        want = expected[(query, documents[result["index"]])][1 if raw else 0]
        worst = max(worst, abs(result["relevance_score"] - want))
        assert abs(result["relevance_score"] - want) <= TOLERANCE, (
            f"{what} document {result['index']} ({len(documents[result['index']].split())} words), query "
            f"{query[:40]!r}: served {result['relevance_score']:.7f}, reference {want:.7f}")


def assert_serves(server, reference) -> None:
    """The server still reranks a normal request correctly."""
    query, docs = "quick brown fox", ["the lazy dog", "seven wizards", "quartz sphinx"]
    response = rerank(server, query, docs)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), docs)
    want = reference.predict([(query, d) for d in docs])
    for result in results:
        assert abs(result["relevance_score"] - want[result["index"]]) <= TOLERANCE


# --- the test set and the references themselves ---------------------------------------------

def test_rerank_set_covers_lengths(reference):
    """The pairs are what the parity tests claim: 100+ of them, documents cut to the
    64-token limit, queries short and long, queries that fit whole."""
    pairs = all_pairs()
    assert len(pairs) >= 100
    full = [len(reference.tokenizer(q, d)["input_ids"]) for q, d in pairs]
    assert sum(n > SCORING_MAX_LENGTH for n in full) >= 30, "too few pairs need truncation"
    assert sum(n <= SCORING_MAX_LENGTH // 2 for n in full) >= 20, "too few short pairs"
    query_lengths = [reference.query_tokens(q) for q, _ in RERANK_SET]
    assert max(query_lengths) < SCORING_MAX_LENGTH - 10, query_lengths
    assert max(query_lengths) > SCORING_MAX_LENGTH // 2, "no query long enough to tell the truncations apart"


def test_reference_only_second_is_the_model_itself(reference, reference_scores):
    """CrossEncoder with only_second truncation == the transformers model on only_second
    pairs (so the reference is what the contract says), and longest_first does differ for
    the long queries. Both run one pair at a time, so padding cannot blur the comparison;
    the batched reference the parity tests use differs from that by float32 noise only."""
    pairs = all_pairs()
    direct = reference.direct_logits(pairs)
    np.testing.assert_allclose(reference.predict(pairs, raw=True, batch_size=1), direct, atol=1e-5)
    np.testing.assert_allclose(reference.predict(pairs, batch_size=1), 1 / (1 + np.exp(-direct)), atol=1e-5)
    batched_logits = np.array([reference_scores[p][1] for p in pairs])
    np.testing.assert_allclose(batched_logits, direct, atol=TOLERANCE / 4)
    # Segments matter to this model: a server that dropped token_type_ids would fail parity.
    encoded = reference.encode(pairs[:20])
    with reference.torch.no_grad():
        zeroed = [float(reference.model(input_ids=reference.torch.tensor([ids]),
                                        attention_mask=reference.torch.tensor([mask])).logits[0, 0])
                  for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
    assert np.max(np.abs(np.array(zeroed) - direct[:20])) > 1e-2
    long_pairs = [(q, d) for q, d in pairs if reference.query_tokens(q) > SCORING_MAX_LENGTH // 2]
    longest_first = reference.predict(long_pairs, raw=True, only_second=False)
    only_second = reference.predict(long_pairs, raw=True)
    assert np.max(np.abs(longest_first - only_second)) > 1e-3


# --- parity ---------------------------------------------------------------------------------

def test_rerank_matches_cross_encoder_default_predict(scoring_server, reference):
    """For queries no longer than what remains of the document, the default
    `CrossEncoder.predict` (sigmoid, longest_first) is the reference as it stands."""
    checked = 0
    for query, docs in RERANK_SET:
        if reference.query_tokens(query) > (SCORING_MAX_LENGTH - 3) // 2:
            continue  # longest_first would cut the query too
        response = rerank(scoring_server, query, docs)
        assert response.status_code == 200, response.text
        results = check_response(response.json(), docs)
        want = reference.predict([(query, d) for d in docs], only_second=False)
        expected = {(query, d): (float(w), 0.0) for d, w in zip(docs, want)}
        assert_matches(results, query, docs, expected, what="default predict:")
        checked += len(docs)
    assert checked >= 80


def test_rerank_matches_cross_encoder(scoring_server, reference_scores):
    """All 130 pairs, long queries included (document-side truncation)."""
    for query, docs in RERANK_SET:
        response = rerank(scoring_server, query, docs)
        assert response.status_code == 200, response.text
        assert_matches(check_response(response.json(), docs), query, docs, reference_scores)


def test_raw_scores_are_logits(scoring_server, reference_scores):
    for query, docs in RERANK_SET:
        response = rerank(scoring_server, query, docs, raw_scores=True)
        assert response.status_code == 200, response.text
        results = check_response(response.json(), docs)
        assert_matches(results, query, docs, reference_scores, raw=True, what="raw:")
    # At least some logits lie outside [0, 1]: raw really is raw.
    logits = [v[1] for v in reference_scores.values()]
    assert min(logits) < 0 or max(logits) > 1


def test_one_request_with_every_pair_of_a_query_batched_with_others(scoring_server, reference_scores):
    """Documents of several queries in flight together (threads): each request gets its own
    query's scores, whatever batches the server cut."""
    rng = random.Random(11)
    jobs = []
    for round_ in range(4):
        for query, docs in RERANK_SET:
            subset = rng.sample(docs, rng.randint(1, len(docs)))
            jobs.append((query, subset, round_ % 2 == 1))
    rng.shuffle(jobs)

    def run(job):
        query, docs, raw = job
        response = rerank(scoring_server, query, docs, raw_scores=raw)
        return job, response

    with ThreadPoolExecutor(8) as pool:
        for (query, docs, raw), response in pool.map(run, jobs):
            assert response.status_code == 200, response.text
            results = check_response(response.json(), docs)
            assert_matches(results, query, docs, reference_scores, raw=raw, what="concurrent:")


def test_usage_counts_pair_tokens(scoring_server, reference):
    """usage.total_tokens counts the real tokens of the pairs after truncation."""
    for query, docs in RERANK_SET[:4]:
        response = rerank(scoring_server, query, docs)
        assert response.status_code == 200, response.text
        expected = sum(reference.token_counts([(query, d) for d in docs]))
        assert response.json()["usage"]["total_tokens"] == expected


@pytest.mark.parametrize("path", RERANK_PATHS[1:])
def test_other_paths_answer_the_same(scoring_server, reference_scores, path):
    query, docs = RERANK_SET[3]
    response = rerank(scoring_server, query, docs, path=path)
    assert response.status_code == 200, response.text
    assert_matches(check_response(response.json(), docs), query, docs, reference_scores, what=path)


# --- top_n, return_documents, index ----------------------------------------------------------

@pytest.mark.parametrize("top_n, expected", [(None, 10), (0, 10), (1, 1), (3, 3), (10, 10), (11, 10),
                                             (1000, 10)])
def test_top_n(scoring_server, reference_scores, top_n, expected):
    query, docs = RERANK_SET[2]
    fields = {} if top_n is None else {"top_n": top_n}
    response = rerank(scoring_server, query, docs, **fields)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), docs, expected_count=expected)
    assert_matches(results, query, docs, reference_scores)
    ranked = sorted(range(len(docs)), key=lambda i: -reference_scores[(query, docs[i])][0])
    assert [r["index"] for r in results] == ranked[:expected]


@pytest.mark.parametrize("return_documents", [None, False, True])
def test_return_documents(scoring_server, reference_scores, return_documents):
    query, docs = RERANK_SET[5]
    fields = {} if return_documents is None else {"return_documents": return_documents}
    response = rerank(scoring_server, query, docs, top_n=4, **fields)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), docs, expected_count=4, return_documents=bool(return_documents))
    assert_matches(results, query, docs, reference_scores)


def test_index_is_the_position_in_the_request(scoring_server, reference_scores):
    """The same documents in another order: each score follows its document, and index
    names the document's position in this request."""
    query, docs = RERANK_SET[4]
    for order in (docs, docs[::-1], sorted(docs)):
        response = rerank(scoring_server, query, order, return_documents=True)
        assert response.status_code == 200, response.text
        results = check_response(response.json(), order, return_documents=True)
        assert_matches(results, query, order, reference_scores)
    by_text = []
    for order in (docs, docs[::-1]):
        results = rerank(scoring_server, query, order).json()["results"]
        by_text.append({order[r["index"]]: r["relevance_score"] for r in results})
    first, second = by_text
    assert first.keys() == second.keys()
    assert all(abs(first[k] - second[k]) <= TOLERANCE for k in first)


def test_duplicate_documents_keep_both_indices(scoring_server, reference):
    docs = ["lazy dog", "quartz sphinx", "lazy dog", "seven wizards", "lazy dog"]
    response = rerank(scoring_server, "the dog", docs)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), docs)
    assert sorted(r["index"] for r in results) == list(range(5))
    scores = {r["index"]: r["relevance_score"] for r in results}
    assert abs(scores[0] - scores[2]) <= TOLERANCE and abs(scores[0] - scores[4]) <= TOLERANCE


def test_single_document(scoring_server, reference):
    response = rerank(scoring_server, "fox", ["jumps over the lazy dog"], top_n=1, return_documents=True)
    assert response.status_code == 200, response.text
    (result,) = check_response(response.json(), ["jumps over the lazy dog"], return_documents=True)
    assert result["index"] == 0
    want = reference.predict([("fox", "jumps over the lazy dog")])[0]
    assert abs(result["relevance_score"] - want) <= TOLERANCE


# --- Jina and Cohere shapes ------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["strings", "objects", "mixed"])
def test_jina_shaped_request(scoring_server, reference_scores, shape):
    query, texts = RERANK_SET[6]
    if shape == "strings":
        documents = list(texts)
    elif shape == "objects":
        documents = [{"text": t} for t in texts]
    else:
        documents = [{"text": t} if i % 2 else t for i, t in enumerate(texts)]
    body = {"model": RERANKER_NAME, "query": query, "documents": documents, "top_n": 3,
            "return_documents": True}
    response = requests.post(scoring_server.url("/v1/rerank"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), documents, expected_count=3, return_documents=True)
    assert_matches(results, query, texts, reference_scores)


@pytest.fixture(scope="module")
def cohere_clients(scoring_server):
    import cohere

    base = scoring_server.url()
    return {"v1": cohere.Client(base_url=base, api_key="x", timeout=60),
            "v2": cohere.ClientV2(base_url=base, api_key="x", timeout=60)}


@pytest.mark.parametrize("version, case, top_n", [("v1", 7, 4), ("v2", 8, 5)])
def test_cohere_client(cohere_clients, reference_scores, version, case, top_n):
    """Each official client: its `top_n` results ranked and scored as the reference, then
    every document ranked. v1 also sends documents as `{"text"}` objects and gets them
    back with `return_documents`; v2 sends plain strings, and its results carry no document."""
    client, v1 = cohere_clients[version], version == "v1"
    query, docs = RERANK_SET[case]
    expected = [reference_scores[(query, doc)][0] for doc in docs]
    response = client.rerank(model=RERANKER_NAME, query=query, documents=docs, top_n=top_n)
    assert len(response.results) == top_n
    ranked = sorted(range(len(docs)), key=lambda i: -expected[i])
    assert [r.index for r in response.results] == ranked[:top_n]
    for r in response.results:
        assert abs(r.relevance_score - expected[r.index]) <= TOLERANCE
        assert not v1 or r.document is None
    if v1:
        response = client.rerank(model=RERANKER_NAME, query=query, documents=[{"text": d} for d in docs],
                                 return_documents=True)
    else:
        response = client.rerank(model=RERANKER_NAME, query=query, documents=docs)
    assert sorted(r.index for r in response.results) == list(range(len(docs)))
    for r in response.results:
        assert abs(r.relevance_score - expected[r.index]) <= TOLERANCE
        assert not v1 or (r.document is not None and r.document.text == docs[r.index])


def test_cohere_client_sees_errors_as_such(cohere_clients):
    """A bad request through the client raises its 4xx error class (not a retried 5xx)."""
    from cohere.core.api_error import ApiError

    client = cohere_clients["v1"]
    with pytest.raises(ApiError) as info:
        client.rerank(model=RERANKER_NAME, query="fox", documents=[])
    assert 400 <= info.value.status_code < 500


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"query": ""},
    {"documents": []},
    {"documents": [5]},
    {"documents": ["fine", 5]},
    {"documents": [{"txt": "x"}]},
    {"documents": [{"text": 5}]},
    {"documents": [None]},
    {"documents": [["nested"]]},
    {"top_n": -1},
], ids=["empty-query", "no-documents", "int-document", "one-int-document", "txt-object", "int-text",
        "null-document", "nested-list", "negative-top-n"])
def test_bad_input_is_422(scoring_server, reference, fields):
    body = {"model": RERANKER_NAME, "query": "fox", "documents": ["dog", "wizards"], **fields}
    assert_error(scoring_server.post("/v1/rerank", body), 422)
    assert_serves(scoring_server, reference)


@pytest.mark.parametrize("missing", ["query", "documents"])
def test_missing_field_is_422(scoring_server, reference, missing):
    body = {"model": RERANKER_NAME, "query": "fox", "documents": ["dog"]}
    del body[missing]
    assert_error(scoring_server.post("/v1/rerank", body), 422)
    assert_serves(scoring_server, reference)


def test_too_many_documents_is_422(scoring_server, reference):
    docs = [f"doc {i % 10}" for i in range(MAX_ITEMS_PER_REQUEST + 1)]
    error = assert_error(rerank(scoring_server, "fox", docs), 422)
    assert str(MAX_ITEMS_PER_REQUEST) in error["message"], error
    assert_serves(scoring_server, reference)
    # Exactly the limit is served.
    response = rerank(scoring_server, "fox", docs[:MAX_ITEMS_PER_REQUEST], top_n=3)
    assert response.status_code == 200, response.text
    check_response(response.json(), docs[:MAX_ITEMS_PER_REQUEST], expected_count=3)


def test_huge_document_is_truncated(scoring_server, reference):
    rng = random.Random(5)
    huge = scoring_text(rng, 20_000)
    docs = ["lazy dog", huge, "quartz sphinx " * 30]
    query = "the quick brown fox"
    response = rerank(scoring_server, query, docs, raw_scores=True)
    assert response.status_code == 200, response.text
    results = check_response(response.json(), docs)
    want = reference.predict([(query, d) for d in docs], raw=True)
    for result in results:
        assert abs(result["relevance_score"] - want[result["index"]]) <= TOLERANCE
    assert_serves(scoring_server, reference)


def test_query_longer_than_max_length_is_no_server_error(scoring_server, reference):
    """Not fixed by the contract beyond: a client's mistake is never a 5xx."""
    rng = random.Random(6)
    response = rerank(scoring_server, scoring_text(rng, 5_000), ["lazy dog", scoring_text(rng, 300)])
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        assert_error(response, 422)
    assert_serves(scoring_server, reference)


def test_empty_document_is_no_server_error(scoring_server, reference):
    response = rerank(scoring_server, "fox", ["", "dog"])
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        assert_error(response, 422)
    assert_serves(scoring_server, reference)


def test_unknown_model_is_404(scoring_server, reference):
    assert_error(rerank(scoring_server, "fox", ["dog"], model="no-such-reranker"), 404)
    assert_serves(scoring_server, reference)


# --- kinds -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", RERANK_PATHS)
def test_embedding_model_on_rerank_is_400(scoring_server, reference, path):
    error = assert_error(rerank(scoring_server, "fox", ["dog"], model=MODEL_NAME, path=path), 400)
    message = error["message"]
    assert "embed" in message and "embeddings" in message, message
    assert_serves(scoring_server, reference)


def test_classifier_on_rerank_is_400(scoring_server, reference):
    error = assert_error(rerank(scoring_server, "fox", ["dog"], model=CLASSIFIER_NAME), 400)
    assert "classify" in error["message"], error
    assert_serves(scoring_server, reference)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_reranker_on_embeddings_is_400(scoring_server, reference, path):
    response = scoring_server.post(path, {"model": RERANKER_NAME, "input": ["fox"]})
    error = assert_error(response, 400)
    assert "rerank" in error["message"], error
    assert_serves(scoring_server, reference)


def test_embedder_still_embeds(scoring_server):
    """The embedding model beside the scoring models works as before."""
    response = scoring_server.embed(["the quick brown fox"])
    assert response.status_code == 200, response.text
    vector = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-4
