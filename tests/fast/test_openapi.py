"""The OpenAPI document as the explorer shows it, built for a server of every kind: each
route's aliases under its tag, an example request and answer for every route that its own
msgspec types decode and the document's schemas accept, each error described once; and the
explorer's routes on a server in this process (the page, its assets, `GET /` redirecting to
it, none of them behind the API key).

The browser's view of the same page is tests/e2e/serving/test_docs_page.py."""

from __future__ import annotations

import asyncio
import json
import re
import typing
from typing import Any

import msgspec
import pytest
from jsonschema import Draft202012Validator

from infinity.api import explorer, openapi
from infinity.api.app import package_version
from infinity.api.examples import EXAMPLES, MODELS_BY_KIND
from infinity.api.routes import ROUTES
from infinity.config import ApiKey
from infinity.shared.kinds import KINDS
from tests.fast.inprocess import serving

OPERATIONS = [route.operation for route in ROUTES]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return explorer.api_document("0.0.0", MODELS_BY_KIND)


def test_the_document_is_valid_openapi_3_1(document):
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    validate(document, cls=OpenAPIV31SpecValidator)
    assert set(MODELS_BY_KIND) == set(KINDS)


def test_each_route_and_its_aliases_share_one_tag(document):
    assert [tag["name"] for tag in document["tags"]] == list(dict.fromkeys(
        tag["name"] for tag in document["tags"]))  # each once
    tags = {tag["name"]: tag["description"] for tag in document["tags"]}
    for op in OPERATIONS:
        primary = document["paths"][op.path][op.method]
        (tag,) = primary["tags"]
        assert tags[tag] == primary["summary"] == op.summary
        for alias in op.aliases:
            operation = document["paths"][alias][op.method]
            assert operation["tags"] == [tag]
            assert operation["summary"] == f"The same as {op.path}"
            assert f"`{alias}`" in primary["description"]
    assert sum(len(methods) for methods in document["paths"].values()) == sum(
        1 + len(op.aliases) for op in OPERATIONS)


def test_every_error_is_described_once(document):
    responses = document["components"]["responses"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status, answer in operation["responses"].items():
                if status == "200":
                    continue
                name = answer["$ref"].removeprefix("#/components/responses/")
                assert name.endswith(status) and responses[name]["description"] == openapi.ERROR_MEANINGS[int(status)]
    text = json.dumps(document)
    for meaning in openapi.ERROR_MEANINGS.values():
        # Once per error shape that uses it (ours, TEI's, either), never per route.
        assert text.count(json.dumps(meaning)) <= 3, meaning


def test_every_route_has_an_example_request_and_answer(document):
    assert set(EXAMPLES) == {f"{op.method} {op.path}" for op in OPERATIONS}
    examples = document["components"]["examples"]
    for op in OPERATIONS:
        for path in (op.path, *op.aliases):
            operation = document["paths"][path][op.method]
            answers = operation["responses"]["200"]["content"]["application/json"]["examples"]
            assert answers and all(ref["$ref"].removeprefix("#/components/examples/") in examples
                                   for ref in answers.values())
            if op.body is not None:
                requests = operation["requestBody"]["content"]["application/json"]["examples"]
                assert set(requests) == set(answers)


def _decoded_types(named: Any) -> tuple[Any, ...]:
    """The types a body or answer of `named` (a Struct, a NewType, a tuple of them) may
    decode as: a NewType's named type, a union's members."""
    found: list[Any] = []
    for each in openapi._named_types(named):
        supertype = getattr(each, "__supertype__", each)
        found += typing.get_args(supertype) if typing.get_origin(supertype) is typing.Union or isinstance(
            supertype, type(int | str)) else [supertype]
    return tuple(found)


def _decodes_as(value: Any, types: tuple[Any, ...]) -> list[Any]:
    """`value` sent as JSON, decoded into each of `types` that takes it, and encoded back."""
    decoded = []
    for each in types:
        try:
            decoded.append(msgspec.to_builtins(msgspec.json.decode(msgspec.json.encode(value), type=each)))
        except msgspec.ValidationError:
            pass
    return decoded


def _within(example: Any, full: Any) -> bool:
    """Whether every key (at any depth) and value of `example` is in `full`."""
    if isinstance(example, dict):
        return isinstance(full, dict) and all(key in full and _within(value, full[key])
                                              for key, value in example.items())
    if isinstance(example, list):
        return isinstance(full, list) and len(example) == len(full) and all(map(_within, example, full))
    return example == full


def _schema_validator(document: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    """A validator of `schema` whose references resolve within `document`."""
    return Draft202012Validator({**schema, "components": document["components"]})


@pytest.mark.parametrize("op", OPERATIONS, ids=[f"{op.method} {op.path}" for op in OPERATIONS])
def test_each_example_is_of_its_routes_types_and_schemas(document, op):
    """A request example decodes into its route's body type (and names no field the type
    lacks); an answer example is exactly what the answer type encodes; both validate against
    the document's schemas; a body's `model` is a served one of the route's kinds."""
    operation = document["paths"][op.path][op.method]
    examples = document["components"]["examples"]
    answer_media = operation["responses"]["200"]["content"]["application/json"]
    for name, ref in answer_media["examples"].items():
        answer = examples[ref["$ref"].removeprefix("#/components/examples/")]["value"]
        assert answer in _decodes_as(answer, _decoded_types(op.answer)), (name, "answer")
        _schema_validator(document, answer_media["schema"]).validate(answer)
        if op.body is None:
            continue
        body_media = operation["requestBody"]["content"]["application/json"]
        request = examples[body_media["examples"][name]["$ref"].removeprefix("#/components/examples/")]["value"]
        assert any(_within(request, full) for full in _decodes_as(request, _decoded_types(op.body))), (
            name, "request")
        _schema_validator(document, body_media["schema"]).validate(request)
        if "model" in request:  # a forwarding operation's bodies are of the kinds of the operations it forwards to
            kinds = op.kinds or (MODELS_BY_KIND if op.forwards else ())
            assert request["model"] in [model for kind in kinds for model in MODELS_BY_KIND[kind]]


def test_a_served_document_names_the_served_model_in_its_examples():
    document = explorer.api_document("0.0.0", {"embed": ["mine"]})
    request = document["components"]["examples"]["post_v1_embeddings.OpenAI.request"]["value"]
    answer = document["components"]["examples"]["post_v1_embeddings.OpenAI.answer"]["value"]
    assert request["model"] == answer["model"] == "mine"


def test_the_page_without_a_server_holds_the_document_and_sends_nothing(document):
    page = explorer.page(document, "", None)
    inline = re.search(r"var inline = (\{.*?\});\n", page, re.DOTALL)
    assert inline is not None and json.loads(inline.group(1)) == document
    assert '"supportedSubmitMethods":[]' in page
    assert "</script" not in inline.group(1)


# --- the explorer's routes, on a server in this process -------------------------------------

def _get(paths: list[str], **server: Any) -> list[tuple[int, dict[str, str], bytes]]:
    """(status, headers, body) of `GET` of each of `paths`, on a server of `server`'s settings."""
    async def ask() -> list[tuple[int, dict[str, str], bytes]]:
        async with serving(**server) as client:
            answers = []
            for path in paths:
                answer = await client.get(path, allow_redirects=False)
                answers.append((answer.status, dict(answer.headers), await answer.read()))
            return answers

    return asyncio.run(ask())


def test_the_served_document_is_the_one_builders():
    """The server's `/openapi.json`, the document of its `/docs`, is what `api_document` (which
    the site's API reference is built with, tests/fast/test_site.py) makes for its models."""
    ((status, _, body),) = _get(["/openapi.json"])
    assert status == 200 and json.loads(body) == explorer.api_document(package_version(), {"embed": ["m"]})


def test_the_explorer_its_assets_and_the_redirect_to_it():
    (page, *assets, root, openapi_json) = _get(["/docs", *(f"/docs/{name}" for name in explorer.ASSETS), "/",
                                                "/openapi.json"])
    status, headers, body = page
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert set(re.findall(r"(?:src|href)='docs/([^']+)'", body.decode())) == set(explorer.ASSETS)
    for name, (status, headers, body) in zip(explorer.ASSETS, assets):
        assert status == 200 and body == (explorer.asset_folder() / name).read_bytes(), name
    assert root[0] == 302 and root[1]["Location"] == "docs"
    assert openapi_json[0] == 200


def test_with_an_api_key_the_explorer_is_open_and_the_document_is_not():
    answers = _get(["/docs", "/docs/swagger-ui-bundle.js", "/", "/openapi.json", "/v1/models"],
                   api_keys=[ApiKey(key="k")])
    assert [status for status, _, _ in answers] == [200, 200, 302, 401, 401]


def test_under_a_url_prefix():
    answers = _get(["/api/docs", "/api/docs/swagger-ui.css", "/api/", "/docs"], url_prefix="/api")
    assert [status for status, _, _ in answers] == [200, 200, 302, 404]
    # Relative: the page finds the document below the prefix, wherever a proxy serves it.
    assert 'fetch("openapi.json"' in answers[0][2].decode()
