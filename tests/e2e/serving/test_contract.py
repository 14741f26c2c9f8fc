"""The API's contract, end to end: `/openapi.json` is a valid OpenAPI 3.1 document that
names every route the server answers, with the JSON error shape for every error; `/docs`
renders it; and infinity's own generated client (`infinity_client`) works whole against the
server: health, models, embeddings, rerank and classify."""

from __future__ import annotations

import re

import numpy as np
import pytest
import requests

from tests.support.reference import MODEL_NAME, assert_close
from tests.support.tiny_models import CLASSIFIER_NAME, FORCED_CLASSIFIER_NAME, RERANKER_NAME

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def document(scoring_server) -> dict:
    response = scoring_server.get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    return response.json()


def test_the_document_is_valid_openapi_3_1(document):
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    assert document["openapi"] == "3.1.0"
    validate(document, cls=OpenAPIV31SpecValidator)


def test_every_documented_route_is_served(scoring_server, document):
    operations = [(method, path) for path, methods in document["paths"].items() for method in methods]
    assert {("post", "/v1/embeddings"), ("post", "/embeddings"), ("post", "/v1/embed"), ("post", "/v2/embed"),
            ("post", "/v1/rerank"), ("post", "/v2/rerank"), ("post", "/v1/classify"), ("get", "/v1/models"),
            ("get", "/models"), ("get", "/health")} <= set(operations)
    for method, path in operations:
        response = requests.request(method, scoring_server.url(path), json={}, timeout=30)
        # An empty body is refused for what it lacks, never for want of a route.
        assert response.status_code in (200, 422), (method, path, response.status_code, response.text[:200])


def _resolved(document: dict, item: dict) -> dict:
    """`item`, or the component its `$ref` names."""
    if "$ref" not in item:
        return item
    section, name = item["$ref"].removeprefix("#/components/").split("/")
    return document["components"][section][name]


def test_every_error_is_documented_with_the_error_shape(document):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status, answer in operation["responses"].items():
                schema = _resolved(document, answer)["content"]["application/json"]["schema"]
                names = {ref["$ref"].rsplit("/", 1)[-1] for ref in schema.get("anyOf", [schema])}
                # TEI's bodies answer TEI's error shape; a path both dialects share, either.
                errors = names & {"ErrorResponse", "TEIErrorResponse"}
                assert (errors == names) == (status != "200"), (method, path, status)
            if method == "post":
                assert {"400", "413", "415", "422", "429", "503"} <= set(operation["responses"]), path
    error = document["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_the_documented_answers_are_the_ones_sent(scoring_server, document):
    """A served answer of each kind has exactly the properties its schema lists (bar
    optional ones)."""
    schemas = document["components"]["schemas"]
    answer = scoring_server.embed(["hello"]).json()
    assert set(answer) == set(schemas["EmbeddingResponse"]["properties"])
    assert set(answer["data"][0]) <= set(schemas["EmbeddingData"]["properties"])
    models = scoring_server.get("/v1/models").json()
    assert set(models["data"][0]) == set(schemas["ModelCard"]["properties"])


def test_models_list_kinds(scoring_server):
    """`/v1/models` (and `/models`) names each model with its kind and the capabilities
    of that kind alone: embed, rerank and classify, a reranker forced to classify too."""
    response = scoring_server.get("/v1/models")
    assert response.status_code == 200, response.text
    models = {m["id"]: m for m in response.json()["data"]}
    expected = {MODEL_NAME: "embed", RERANKER_NAME: "rerank", CLASSIFIER_NAME: "classify",
                FORCED_CLASSIFIER_NAME: "classify"}
    assert set(models) == set(expected), models
    others = {"embed", "rerank", "classify"}
    for name, kind in expected.items():
        model = models[name]
        assert model["kind"] == kind, model
        capabilities = model["capabilities"]
        assert isinstance(capabilities, list) and kind in capabilities, model
        assert not (set(capabilities) & (others - {kind})), model
    unprefixed = scoring_server.get("/models")
    assert unprefixed.status_code == 200, unprefixed.text
    assert {m["id"]: m["kind"] for m in unprefixed.json()["data"]} == expected


def test_docs_page_shows_every_route_without_fetching_anything(scoring_server, document):
    """The explorer's page names every route (for a browser without JavaScript too), and
    loads nothing from elsewhere: its scripts and styles are the server's own (the browser
    check, tests/e2e/serving/test_docs_page.py, watches what it fetches)."""
    response = scoring_server.get("/docs")
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/html")
    page = response.text
    for path, methods in document["paths"].items():
        for method in methods:
            assert f"{method.upper()} {path}" in page
    assert "http://" not in page and "https://" not in page
    for asset in re.findall(r"(?:src|href)='([^']+)'", page):
        assert scoring_server.get(f"/{asset}").status_code == 200, asset


def test_the_api_key_is_documented_when_one_is_set(api_key_server):
    document = requests.get(api_key_server.url("/openapi.json"), timeout=30,
                            headers={"Authorization": f"Bearer {api_key_server.api_key}"}).json()
    assert document["security"] == [{"bearer": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
    assert "401" in document["paths"]["/v1/embeddings"]["post"]["responses"]


# --- infinity's generated client -------------------------------------------------------------------

@pytest.fixture(scope="module")
def infinity_client(scoring_server):
    from infinity_client import Client

    with Client(base_url=scoring_server.url(""), raise_on_unexpected_status=True, timeout=60) as client:
        yield client


def test_infinity_client_health_and_models(infinity_client):
    from infinity_client.api.default import health, models

    assert health.sync_detailed(client=infinity_client).status_code == 200
    listed = models.sync(client=infinity_client)
    by_id = {model.id: model for model in listed.data}
    assert {MODEL_NAME, RERANKER_NAME, CLASSIFIER_NAME} <= set(by_id)
    embedder = by_id[MODEL_NAME]
    assert embedder.capabilities == ["embed"] and embedder.backend
    assert embedder.stats["queue_absolute"] == 0 and embedder.stats["batch_size"] > 0


def test_infinity_client_embeddings(infinity_client, reference_model, sentences):
    from infinity_client.api.default import embeddings
    from infinity_client.models import OpenAIEmbeddingInputText

    from tests.support.reference import reference_embed

    texts = sentences[:3]
    # No model named and `dimensions` 0: what the client sends unless told otherwise.
    answer = embeddings.sync(client=infinity_client, body=OpenAIEmbeddingInputText(input_=texts))
    expected = reference_embed(reference_model, texts)
    for item in answer.data:
        assert_close(np.asarray(item.embedding, dtype=np.float32), expected[item.index])
    assert answer.usage.prompt_tokens > 0


def test_infinity_client_rerank(scoring_server, infinity_client):
    from infinity_client.api.default import rerank
    from infinity_client.models import RerankInput

    query, documents = "the quick fox", ["a lazy dog", "quick brown fox jumps", "seven wizards"]
    answer = rerank.sync(client=infinity_client, body=RerankInput(query=query, documents=documents, top_n=2))
    ours = scoring_server.post("/v1/rerank", {"model": RERANKER_NAME, "query": query, "documents": documents,
                                              "top_n": 2}).json()
    assert [(r.index, r.relevance_score) for r in answer.results] == [
        (r["index"], pytest.approx(r["relevance_score"], abs=1e-6)) for r in ours["results"]]


def test_a_returned_document_is_infinitys_text_on_its_path_and_cohere_s_object_on_theirs(scoring_server,
                                                                                       infinity_client):
    """infinity's client (and LiteLLM's infinity provider) read `document` as a string on
    /rerank; Cohere's SDK and Jina read `{"text"}` on /v1/rerank and /v2/rerank."""
    from infinity_client.api.default import rerank
    from infinity_client.models import RerankInput

    query, documents = "the quick fox", ["a lazy dog", "quick brown fox jumps"]
    answer = rerank.sync(client=infinity_client, body=RerankInput(query=query, documents=documents,
                                                                  return_documents=True))
    assert sorted(r.document for r in answer.results) == sorted(documents)
    for path in ("/v1/rerank", "/v2/rerank"):
        cohere = scoring_server.post(path, {"model": RERANKER_NAME, "query": query, "documents": documents,
                                            "return_documents": True}).json()
        assert sorted(r["document"]["text"] for r in cohere["results"]) == sorted(documents)


def test_infinity_client_classify(scoring_server, infinity_client):
    from infinity_client.api.default import classify
    from infinity_client.models import ClassifyInput

    texts = ["the quick fox", "a lazy dog"]
    answer = classify.sync(client=infinity_client, body=ClassifyInput(input_=texts, model=CLASSIFIER_NAME))
    ours = scoring_server.post("/v1/classify", {"model": CLASSIFIER_NAME, "input": texts}).json()
    assert [[(c.label, c.score) for c in row] for row in answer.data] == [
        [(c["label"], pytest.approx(c["score"], abs=1e-6)) for c in row] for row in ours["data"]]
