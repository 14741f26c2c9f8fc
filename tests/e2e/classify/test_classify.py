"""End to end: text classification. One server (module scope) serves the packaged
embedder, a tiny reranker, a tiny three-label classifier and the reranker forced to
kind = "classify", from one models.toml. `/v1/classify` (also `/classify`) must agree with
transformers' `pipeline("text-classification", top_k=None)` (softmax over the labels of
config.json's id2label; raw logits with `raw_scores`), count real tokens, refuse bad input
and models of another kind, and keep serving afterwards.

The server truncates long inputs to the model's max_length (64 here, from the
classifier's tokenizer_config.json); the pipeline is called with `truncation=True`, which
cuts at the same tokenizer's model_max_length.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.answers import assert_error
from tests.support.reference import MODEL_NAME
from tests.support.tiny_models import (CLASSIFIER_LABELS, CLASSIFIER_NAME, FORCED_CLASSIFIER_NAME, SCORING_MAX_LENGTH,
                                       scoring_text)

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-4
MAX_ITEMS_PER_REQUEST = 2048  # the server's default --max-items-per-request
CLASSIFY_PATHS = ("/v1/classify", "/classify")


# --- the server and the references --------------------------------------------------------

class Reference:
    """The tiny classifier through transformers' text-classification pipeline, loaded from
    the saved folder (never from a freshly trained tokenizer)."""

    def __init__(self, folder) -> None:
        import torch
        from transformers import pipeline

        torch.set_num_threads(2)
        self.pipe = pipeline("text-classification", model=str(folder), tokenizer=str(folder), top_k=None,
                             device="cpu")
        assert self.pipe.tokenizer.model_max_length == SCORING_MAX_LENGTH

    def classify(self, texts: list[str], raw: bool = False) -> list[dict[str, float]]:
        kwargs = {"function_to_apply": "none"} if raw else {}
        out = self.pipe(texts, truncation=True, batch_size=16, **kwargs)
        return [{item["label"]: float(item["score"]) for item in row} for row in out]

    def token_count(self, text: str) -> int:
        return len(self.pipe.tokenizer(text, truncation=True)["input_ids"])


@pytest.fixture(scope="module")
def reference(scoring_server, models_root) -> Reference:  # the server fixture built the models
    return Reference(models_root / "classifier")


def make_texts(count: int = 120, seed: int = 3) -> list[str]:
    """Distinct texts from one word to 150 (many over the 64-token limit)."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 12, 18, 25, 35, 50, 80, 150]
    out: list[str] = []
    while len(out) < count:
        text = scoring_text(rng, lengths[len(out) % len(lengths)])
        if text not in out:
            out.append(text)
    rng.shuffle(out)
    return out


TEXTS = make_texts()


@pytest.fixture(scope="module")
def reference_scores(reference) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """text -> (softmax scores by label, raw logits by label)."""
    probs = reference.classify(TEXTS)
    logits = reference.classify(TEXTS, raw=True)
    return {text: (p, l) for text, p, l in zip(TEXTS, probs, logits)}


def classify(server, input, model=CLASSIFIER_NAME, path="/v1/classify", **fields):
    return server.post(path, {"model": model, "input": input, **fields})


def check_response(body: dict, count: int, labels=CLASSIFIER_LABELS, model=CLASSIFIER_NAME) -> list[list[dict]]:
    """The classify response shape; return its data."""
    assert isinstance(body.get("id"), str) and body["id"], body.get("id")
    assert body.get("object") == "classify", body.get("object")  # infinity's value; its client checks it
    assert body.get("model") == model, body.get("model")
    data = body["data"]
    assert isinstance(data, list) and len(data) == count, f"{len(data)} rows, expected {count}"
    for row in data:
        assert isinstance(row, list), row
        assert sorted(item["label"] for item in row) == sorted(labels), row
        scores = [item["score"] for item in row]
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores), row
        assert scores == sorted(scores, reverse=True), f"labels not sorted by score: {row}"
    usage = body["usage"]
    assert isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] > 0, usage
    assert usage.get("total_tokens") == usage["prompt_tokens"], usage
    return data


def assert_matches(data: list[list[dict]], texts: list[str], expected, raw: bool = False, what: str = "") -> None:
    for text, row in zip(texts, data):
        want = expected[text][1 if raw else 0]
        for item in row:
            diff = abs(item["score"] - want[item["label"]])
            assert diff <= TOLERANCE, (f"{what} {item['label']} of {text[:40]!r} ({len(text.split())} words): "
                                       f"served {item['score']:.7f}, reference {want[item['label']]:.7f}")


def assert_serves(server, reference) -> None:
    texts = ["quick brown fox", "lazy dog"]
    response = classify(server, texts)
    assert response.status_code == 200, response.text
    expected = {text: (scores, None) for text, scores in zip(texts, reference.classify(texts))}
    assert_matches(check_response(response.json(), 2), texts, expected)


# --- the test set -------------------------------------------------------------------------------

def test_texts_cover_lengths(reference):
    counts = [len(reference.pipe.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert len(TEXTS) >= 100
    assert sum(n > SCORING_MAX_LENGTH for n in counts) >= 20, "too few texts need truncation"
    assert sum(n <= 16 for n in counts) >= 20, "too few short texts"


# --- parity -------------------------------------------------------------------------------------

def test_classify_matches_pipeline(scoring_server, reference_scores):
    for start in range(0, len(TEXTS), 40):
        texts = TEXTS[start:start + 40]
        response = classify(scoring_server, texts)
        assert response.status_code == 200, response.text
        assert_matches(check_response(response.json(), len(texts)), texts, reference_scores)


def test_raw_scores_are_logits(scoring_server, reference_scores):
    response = classify(scoring_server, TEXTS, raw_scores=True)
    assert response.status_code == 200, response.text
    assert_matches(check_response(response.json(), len(TEXTS)), TEXTS, reference_scores, raw=True, what="raw:")
    logits = [v for _, raw in reference_scores.values() for v in raw.values()]
    assert min(logits) < 0 or max(logits) > 1  # raw really is raw


def test_scores_are_probabilities(scoring_server):
    response = classify(scoring_server, TEXTS[:20])
    for row in check_response(response.json(), 20):
        assert abs(sum(item["score"] for item in row) - 1) < 1e-5, row
        assert all(0 <= item["score"] <= 1 for item in row), row


def test_concurrent_requests(scoring_server, reference_scores):
    rng = random.Random(4)
    jobs = []
    for i in range(32):
        texts = rng.sample(TEXTS, rng.randint(1, 12))
        jobs.append((texts, i % 2 == 1))

    def run(job):
        texts, raw = job
        return job, classify(scoring_server, texts, raw_scores=raw)

    with ThreadPoolExecutor(8) as pool:
        for (texts, raw), response in pool.map(run, jobs):
            assert response.status_code == 200, response.text
            assert_matches(check_response(response.json(), len(texts)), texts, reference_scores, raw=raw,
                           what="concurrent:")


def test_single_string_input(scoring_server, reference_scores):
    text = TEXTS[0]
    response = classify(scoring_server, text)
    assert response.status_code == 200, response.text
    assert_matches(check_response(response.json(), 1), [text], reference_scores)


def test_order_of_inputs_is_kept(scoring_server, reference_scores):
    texts = TEXTS[:30]
    for order in (texts, texts[::-1]):
        response = classify(scoring_server, order)
        assert response.status_code == 200, response.text
        assert_matches(check_response(response.json(), len(order)), order, reference_scores)


def test_usage_counts_real_tokens(scoring_server, reference):
    texts = TEXTS[:25]
    response = classify(scoring_server, texts)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    expected = sum(reference.token_count(t) for t in texts)
    assert usage["prompt_tokens"] == expected, usage
    assert usage["total_tokens"] == expected, usage


@pytest.mark.parametrize("path", CLASSIFY_PATHS[1:])
def test_unprefixed_path(scoring_server, reference_scores, path):
    texts = TEXTS[5:9]
    response = classify(scoring_server, texts, path=path)
    assert response.status_code == 200, response.text
    assert_matches(check_response(response.json(), len(texts)), texts, reference_scores, what=path)


def test_huge_input_is_truncated(scoring_server, reference):
    rng = random.Random(8)
    texts = [scoring_text(rng, 20_000), "lazy dog"]
    response = classify(scoring_server, texts)
    assert response.status_code == 200, response.text
    want = reference.classify(texts)
    assert_matches(check_response(response.json(), 2), texts,
                   {t: (w, None) for t, w in zip(texts, want)}, what="huge:")
    assert response.json()["usage"]["prompt_tokens"] == SCORING_MAX_LENGTH + reference.token_count("lazy dog")


# --- a one-label model forced to classify ----------------------------------------------------

def test_one_label_model_forced_to_classify(scoring_server, models_root):
    """kind = "classify" on the one-label cross-encoder: one label per input (config.json's
    LABEL_0), raw_scores the model's logit on the single text."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = str(models_root / "reranker")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts = TEXTS[:12]
    encoded = tokenizer(texts, truncation=True, max_length=SCORING_MAX_LENGTH, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[:, 0].tolist()

    response = classify(scoring_server, texts, model=FORCED_CLASSIFIER_NAME, raw_scores=True)
    assert response.status_code == 200, response.text
    data = check_response(response.json(), len(texts), labels=("LABEL_0",), model=FORCED_CLASSIFIER_NAME)
    for row, logit in zip(data, logits):
        assert abs(row[0]["score"] - logit) <= TOLERANCE, (row, logit)

    response = classify(scoring_server, texts, model=FORCED_CLASSIFIER_NAME)
    assert response.status_code == 200, response.text
    data = check_response(response.json(), len(texts), labels=("LABEL_0",), model=FORCED_CLASSIFIER_NAME)
    for row in data:
        assert 0 <= row[0]["score"] <= 1, row


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [[], ["fine", 5], [None], [["nested"]], 5, None, {"text": "x"}],
                         ids=["empty-list", "str-and-int", "null-item", "nested", "bare-int", "null", "object"])
def test_bad_input_is_422(scoring_server, reference, value):
    """Not a string or a list of strings. (A list of ints is left out: like /v1/embeddings,
    the server takes it as token ids.)"""
    assert_error(classify(scoring_server, value), 422)
    assert_serves(scoring_server, reference)


def test_missing_input_is_422(scoring_server, reference):
    assert_error(scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME}), 422)
    assert_serves(scoring_server, reference)


def test_too_many_inputs_is_422(scoring_server, reference):
    texts = ["lazy dog"] * (MAX_ITEMS_PER_REQUEST + 1)
    error = assert_error(classify(scoring_server, texts), 422)
    assert str(MAX_ITEMS_PER_REQUEST) in error["message"], error
    assert_serves(scoring_server, reference)


def test_empty_string_is_no_server_error(scoring_server, reference):
    response = classify(scoring_server, ["", "dog"])
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        assert_error(response, 422)
    assert_serves(scoring_server, reference)


def test_unknown_model_is_404(scoring_server, reference):
    assert_error(classify(scoring_server, ["dog"], model="no-such-classifier"), 404)
    assert_serves(scoring_server, reference)


# --- kinds -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", CLASSIFY_PATHS)
def test_embedding_model_on_classify_is_400(scoring_server, reference, path):
    error = assert_error(classify(scoring_server, ["dog"], model=MODEL_NAME, path=path), 400)
    message = error["message"]
    assert "embed" in message and "embeddings" in message, message
    assert_serves(scoring_server, reference)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_classifier_on_embeddings_is_400(scoring_server, reference, path):
    error = assert_error(scoring_server.post(path, {"model": CLASSIFIER_NAME, "input": ["dog"]}), 400)
    assert "classify" in error["message"], error
    assert_serves(scoring_server, reference)


def test_classifier_on_rerank_names_its_route(scoring_server, reference):
    response = scoring_server.post("/v1/rerank", {"model": CLASSIFIER_NAME, "query": "fox", "documents": ["dog"]})
    error = assert_error(response, 400)
    assert "classify" in error["message"], error
    assert_serves(scoring_server, reference)
