"""No field silently ignored (infinity/api/peer_fields.py): every request type a route
decodes has its table of the fields the peers name, each honoured (a field of the type)
or refused with why; every field of a type is in its table; a refused field and a key no
peer names are 422s naming them (the latter unless `[server] unknown_fields = "ignore"`);
docs/api.md carries the same table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from infinity.api.decode import decode_body
from infinity.api.errors import APIError
from infinity.api.peer_fields import FIELDS, markdown
from infinity.api.routes import ROUTES
from infinity.config import ModelConfig
from tests.fast.inprocess import serving_on_its_own_loop

ROOT = Path(__file__).resolve().parents[2]


def _body_types(route) -> tuple[type[msgspec.Struct], ...]:
    body = route.operation.body
    return body if isinstance(body, tuple) else () if body is None else (body,)


def test_every_body_type_of_every_route_has_its_table():
    assert {body_type for route in ROUTES for body_type in _body_types(route)} == set(FIELDS)


@pytest.mark.parametrize("request_type", FIELDS, ids=lambda request_type: request_type.__name__)
def test_a_types_fields_are_its_tables_honoured_ones(request_type):
    own = {field.encode_name for field in msgspec.structs.fields(request_type)}
    table = FIELDS[request_type]
    assert own == {name for name, field in table.items() if not field.refused}
    for field in table.values():
        assert field.peers and field.does


# A valid body of each type, which a test adds one key to.
MINIMAL = {"EmbeddingRequest": {"input": "a"}, "CohereEmbedRequest": {"texts": ["a"]},
           "SparseEmbedRequest": {"inputs": "a"}, "RerankRequest": {"query": "a", "documents": ["b"]},
           "ClassifyRequest": {"input": "a"}, "ScoreRequest": {"text_1": "a", "text_2": "b"},
           "PoolingRequest": {"input": "a"}, "TokenizeRequest": {"prompt": "a"}, "DetokenizeRequest": {"tokens": [1]},
           "TEIEmbedRequest": {"inputs": "a"}, "TEIEmbedAllRequest": {"inputs": "a"},
           "TEIRerankRequest": {"query": "a", "texts": ["b"]}, "TEIPredictRequest": {"inputs": "a"},
           "TEISimilarityRequest": {"inputs": {"source_sentence": "a", "sentences": ["b"]}},
           "TEIDecodeRequest": {"ids": [1]}}
REFUSED = [(request_type, name) for request_type, fields in FIELDS.items()
           for name, field in fields.items() if field.refused]


def test_each_type_has_a_minimal_body():
    assert set(MINIMAL) == {request_type.__name__ for request_type in FIELDS}
    for request_type in FIELDS:
        decode_body(msgspec.json.encode(MINIMAL[request_type.__name__]), request_type)


@pytest.mark.parametrize("request_type, name", REFUSED, ids=lambda value: getattr(value, "__name__", value))
def test_a_refused_peer_field_is_a_422_naming_it_and_why(request_type, name):
    body = msgspec.json.encode({**MINIMAL[request_type.__name__], name: None})
    for unknown_fields in ("refuse", "ignore"):
        with pytest.raises(APIError) as refused:
            decode_body(body, request_type, unknown_fields=unknown_fields)
        assert (refused.value.status, refused.value.param) == (422, name)
        assert FIELDS[request_type][name].does in refused.value.message


@pytest.mark.parametrize("request_type", FIELDS, ids=lambda request_type: request_type.__name__)
def test_a_key_no_peer_names_is_refused_unless_ignored(request_type):
    body = msgspec.json.encode({**MINIMAL[request_type.__name__], "colour": "blue"})
    with pytest.raises(APIError) as refused:
        decode_body(body, request_type)
    assert (refused.value.status, refused.value.param) == (422, "colour") and "unknown_fields" in refused.value.message
    assert isinstance(decode_body(body, request_type, unknown_fields="ignore"), request_type)


def test_the_docs_carry_the_table():
    text = (ROOT / "docs" / "api.md").read_text()
    start, end = "<!-- peer fields: start -->\n", "\n<!-- peer fields: end -->"
    assert text[text.index(start) + len(start):text.index(end)] == markdown(ROUTES), (
        "docs/api.md's table of peer fields differs from infinity/api/peer_fields.py: regenerate it with "
        "`python -m infinity.api.peer_fields`")


def test_over_http_in_each_dialects_error_shape():
    with serving_on_its_own_loop(model=[ModelConfig(name="m", engine="torch")]) as client:
        status, error = client.ask("POST", "/v1/embeddings", {"input": "a", "normalize": False})
        assert status == 422 and error["error"]["param"] == "normalize" and "use_activation" in error["error"]["message"]
        status, error = client.ask("POST", "/v1/embeddings", {"input": "a", "colour": "blue"})
        assert status == 422 and error["error"]["param"] == "colour"
        status, error = client.ask("POST", "/embed", {"inputs": "a", "colour": "blue"})
        assert status == 422 and set(error) == {"error", "error_type"} and "colour" in error["error"]
        status, answer = client.ask("POST", "/v1/embeddings", {"input": "a", "output_dimension": 8})
        assert status == 200 and len(answer["data"][0]["embedding"]) == 8
    with serving_on_its_own_loop(model=[ModelConfig(name="m", engine="torch")], unknown_fields="ignore") as client:
        status, _ = client.ask("POST", "/v1/embeddings", {"input": "a", "colour": "blue"})
        assert status == 200
        status, error = client.ask("POST", "/v1/embeddings", {"input": "a", "normalize": False})
        assert status == 422 and error["error"]["param"] == "normalize"



def test_keys_inside_nested_objects_are_checked_by_their_path():
    from infinity.api.types.embeddings import CohereEmbedRequest, EmbeddingRequest
    from infinity.api.types.tei import TEISimilarityRequest

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for request_type, body, param in (
            (EmbeddingRequest, {"messages": [{"role": "user", "content": [image, {**image, "image_url": {
                "url": "x", "detail": "low"}}]}]}, "messages[0].content[1].image_url.detail"),
            (EmbeddingRequest, {"messages": [{"content": "a", "name": "me"}]}, "messages[0].name"),
            (EmbeddingRequest, {"messages": [{"content": [{"type": "text", "text": "a", "colour": 1}]}]},
             "messages[0].content[0].colour"),
            (CohereEmbedRequest, {"inputs": [{"content": [{"type": "text", "text": "a"}], "colour": 1}]},
             "inputs[0].colour"),
            (TEISimilarityRequest, {"inputs": {"source_sentence": "a", "sentences": ["b"], "colour": 1}},
             "inputs.colour"),
            (TEISimilarityRequest, {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                                    "parameters": {"truncate": True, "colour": 1}}, "parameters.colour")):
        encoded = msgspec.json.encode(body)
        with pytest.raises(APIError) as refused:
            decode_body(encoded, request_type)
        assert (refused.value.status, refused.value.param) == (422, param), refused.value.message
        if not param.endswith(("detail", "name")):  # a key no peer names: ignored where told to
            decode_body(encoded, request_type, unknown_fields="ignore")
    decode_body(msgspec.json.encode({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "a"}]}]}),
                EmbeddingRequest)
