"""Embedding output types (float, int8, uint8, binary, ubinary), plain and base64: the
encodings of `infinity/shared/vectors.py` against hand-computed values, then end to end on the
OpenAI route (`embedding_type`, `embedding_types`), the Cohere v1/v2 embed routes through
the official `cohere` clients, the server default, and the 422s of bad requests.

Every end-to-end check compares a quantised answer with the documented transform (written
out again below, independently of the server's code) of the server's own float answer for
the same input: exact where one set of floats made both, and otherwise within the steps that
floats `SAME_TEXTS_ATOL` apart may round to (two requests may be batched apart).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from infinity.shared.vectors import EMBEDDING_TYPES, encode, to_binary, to_int8, to_ubinary, to_uint8
from tests.support.answers import assert_error, decode_embedding
from tests.support.reference import DIM, MODEL_NAME, SAME_TEXTS_ATOL, assert_close, assert_same_vectors

pytestmark = pytest.mark.timeout(300)

QUANTISED = ("int8", "uint8", "binary", "ubinary")
BASE64_DTYPES = {"float": "<f4", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}


def documented(floats: np.ndarray, embedding_type: str) -> np.ndarray:
    """The definition of each type in docs/api.md, for rows of float32 values."""
    x = np.asarray(floats, dtype=np.float32).astype(np.float64)
    if embedding_type == "float":
        return x
    int8 = np.clip(np.round(x * 127), -127, 127)  # np.round: ties to even, as rint
    if embedding_type == "int8":
        return int8
    if embedding_type == "uint8":
        return int8 + 128
    bits = (x > 0).astype(int)
    pad = -bits.shape[1] % 8
    bits = np.concatenate([bits, np.zeros((len(bits), pad), dtype=int)], axis=1)
    ubinary = (bits.reshape(len(bits), -1, 8) * (1 << np.arange(7, -1, -1))).sum(axis=2)
    return ubinary if embedding_type == "ubinary" else ubinary - 128


def decoded(value, embedding_type: str) -> np.ndarray:
    """One row as the server sent it: a JSON list, or base64 of little-endian bytes."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype=BASE64_DTYPES[embedding_type]).astype(np.float64)
    assert all(isinstance(v, float if embedding_type == "float" else int) for v in value)
    return np.asarray(value, dtype=np.float64)


def assert_encodes(rows: list, floats: np.ndarray, embedding_type: str, atol: float = SAME_TEXTS_ATOL) -> None:
    """Each served row is the documented transform of the float row: exactly, for the
    `floats` that made it (`atol` 0), or of floats within `atol` of them where another
    request computed `floats` (its batch may round a value across a step of the type)."""
    assert_transform(np.stack([decoded(row, embedding_type) for row in rows]), floats, embedding_type, atol)


def assert_transform(got: np.ndarray, floats: np.ndarray, embedding_type: str, atol: float = SAME_TEXTS_ATOL) -> None:
    """`got`, decoded rows, is the documented transform of `floats` (as `assert_encodes`)."""
    if embedding_type in ("binary", "ubinary"):
        bits = np.unpackbits((got.astype(np.int64) + (128 if embedding_type == "binary" else 0)).astype(np.uint8),
                             axis=1)[:, :floats.shape[1]]
        # A value within atol of 0 may fall either side (with atol 0, every bit is sure).
        sure = np.abs(np.asarray(floats, dtype=np.float64)) > atol if atol else np.full(np.shape(floats), True)
        np.testing.assert_array_equal(bits[sure], (np.asarray(floats)[sure] > 0).astype(np.uint8), err_msg=embedding_type)
        np.testing.assert_array_equal(got.shape, documented(floats, embedding_type).shape)
        return
    low, high = documented(floats - atol, embedding_type), documented(floats + atol, embedding_type)
    assert got.shape == low.shape and ((low <= got) & (got <= high)).all(), (embedding_type, got, low, high)


# --- the encodings -----------------------------------------------------------------------

def test_int8_and_uint8_by_hand():
    x = np.array([[0.0, -0.0, 1.0, -1.0, 0.1, -0.1, 0.5, -0.5, 0.25, 2.0, -3.0]], dtype=np.float32)
    int8 = [0, 0, 127, -127, 13, -13, 64, -64, 32, 127, -127]  # 63.5 -> 64 (ties to even), 31.75 -> 32
    assert to_int8(x).dtype == np.int8 and to_int8(x).tolist() == [int8]
    assert to_uint8(x).dtype == np.uint8 and to_uint8(x).tolist() == [[v + 128 for v in int8]]
    assert to_int8(np.array([[1e30, -1e30]], dtype=np.float32)).tolist() == [[127, -127]]


def test_binary_by_hand():
    # bits 0 0 1 0 1 1 1 0 | 1 then seven padding zeros
    x = np.array([[0.0, -0.0, 0.2, -0.2, 1e-30, 3.0, 0.5, -1e-30, 0.7]], dtype=np.float32)
    assert to_ubinary(x).dtype == np.uint8 and to_ubinary(x).tolist() == [[0b00101110, 0b10000000]]
    assert to_binary(x).dtype == np.int8 and to_binary(x).tolist() == [[0b00101110 - 128, 0]]
    assert to_ubinary(np.ones((1, 8), dtype=np.float32)).tolist() == [[255]]
    assert to_binary(np.ones((1, 8), dtype=np.float32)).tolist() == [[127]]
    assert to_binary(-np.ones((1, 8), dtype=np.float32)).tolist() == [[-128]]


@pytest.mark.parametrize("dim, packed", [(1, 1), (7, 1), (8, 1), (9, 2), (20, 3), (384, 48)])
def test_packed_length(dim, packed):
    rows = np.random.default_rng(dim).standard_normal((3, dim)).astype(np.float32)
    for embedding_type in ("binary", "ubinary"):
        assert np.asarray(encode(rows, embedding_type)).shape == (3, packed)
        assert_encodes(encode(rows, embedding_type), rows, embedding_type, atol=0)


@pytest.mark.parametrize("embedding_type", EMBEDDING_TYPES)
def test_encode_matches_the_documented_transform(embedding_type):
    rows = np.random.default_rng(7).uniform(-1.2, 1.2, (5, 37)).astype(np.float32)
    rows[0, :4] = [0.0, -0.0, 1.0, -1.0]
    assert_encodes(encode(rows, embedding_type), rows, embedding_type, atol=0)
    as_base64 = encode(rows, embedding_type, as_base64=True)
    assert all(isinstance(s, str) for s in as_base64)
    assert_encodes(as_base64, rows, embedding_type, atol=0)


def test_base64_is_one_byte_per_value_and_little_endian_float():
    rows = np.array([[0.5, -1.0, 0.0]], dtype=np.float32)
    assert base64.b64decode(encode(rows, "float", True)[0]) == b"\x00\x00\x00\x3f\x00\x00\x80\xbf\x00\x00\x00\x00"
    assert base64.b64decode(encode(rows, "int8", True)[0]) == bytes([64, 256 - 127, 0])
    assert base64.b64decode(encode(rows, "uint8", True)[0]) == bytes([192, 1, 128])
    assert base64.b64decode(encode(rows, "ubinary", True)[0]) == bytes([0b10000000])
    assert base64.b64decode(encode(rows, "binary", True)[0]) == bytes([0])


def test_server_default_from_env_flag_and_file(tmp_path):
    from infinity.cli import build_parser
    from infinity.config import ConfigError, load_config

    assert load_config(env={}).server.embedding_type == "float"
    assert load_config(env={"INFINITY_EMBEDDING_TYPE": "ubinary"}).server.embedding_type == "ubinary"
    args = build_parser().parse_args(["serve", "--embedding-type", "int8"])
    assert args.embedding_type == "int8"
    toml = tmp_path / "models.toml"
    toml.write_text('[server]\nembedding_type = "nibble"\n')
    with pytest.raises(ConfigError, match="embedding_type"):
        load_config(toml, env={})


# --- the OpenAI route ----------------------------------------------------------------------

TEXTS = ["the quick brown fox", "Zürich café 東京 🙂", "a", "embedding servers batch by tokens " * 20]


def _floats(server, **fields) -> np.ndarray:
    """The float rows of TEXTS, from an idle server: the request they are compared with
    then runs in the same batch shape and gives the same floats to the bit."""
    server.wait_idle()
    response = server.embed(TEXTS, **fields)
    assert response.status_code == 200, response.text
    return np.stack([decode_embedding(item["embedding"]) for item in response.json()["data"]])


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("embedding_type", EMBEDDING_TYPES)
def test_embedding_type(server, embedding_type, encoding_format):
    floats = _floats(server)
    response = server.embed(TEXTS, embedding_type=embedding_type, encoding_format=encoding_format)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == list(range(len(TEXTS)))
    assert all(set(item) == {"object", "index", "embedding"} for item in body["data"])
    rows = [item["embedding"] for item in body["data"]]
    if embedding_type == "float":  # another request's floats: equal within the tolerance of two requests
        assert_same_vectors(np.stack([decoded(row, "float") for row in rows]), floats)
    else:
        assert_encodes(rows, floats, embedding_type)
    assert body["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embedding_types_with_dimensions_not_a_multiple_of_8(server, encoding_format):
    """Several types in one answer, all from the same float rows; 20 dimensions pack into
    3 bytes."""
    types = ["ubinary", "float", "int8", "binary", "uint8"]
    response = server.embed(TEXTS, embedding_types=types, encoding_format=encoding_format, dimensions=20)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert all(set(item) == {"object", "index", "embeddings"} for item in data)
    assert all(list(item["embeddings"]) == types for item in data)
    floats = np.stack([decoded(item["embeddings"]["float"], "float") for item in data])
    assert floats.shape == (len(TEXTS), 20)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    assert_close(floats[0], _floats(server, dimensions=20)[0])
    for embedding_type in types:
        rows = [item["embeddings"][embedding_type] for item in data]
        assert_encodes(rows, floats, embedding_type)
        if embedding_type in ("binary", "ubinary"):
            assert all(len(decoded(row, embedding_type)) == 3 for row in rows)


def test_duplicate_types_are_answered_once(server):
    response = server.embed(["hello"], embedding_types=["int8", "float", "int8"])
    assert response.status_code == 200, response.text
    assert list(response.json()["data"][0]["embeddings"]) == ["int8", "float"]


def test_openai_client_with_embedding_type(server):
    """The `openai` client passes `embedding_type` through `extra_body`; with an explicit
    encoding_format it leaves the values alone (its default base64 would be read as float32),
    except that its `List[float]` model turns the integers into floats."""
    import openai

    floats = _floats(server)
    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120) as client:
        as_list = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float",
                                           extra_body={"embedding_type": "int8"})
        assert_transform(np.asarray([item.embedding for item in as_list.data]), floats, "int8")
        as_base64 = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="base64",
                                             extra_body={"embedding_type": "int8"})
        assert_encodes([item.embedding for item in as_base64.data], floats, "int8")
        default = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # float32 base64, decoded by the client
        assert_same_vectors(np.array([item.embedding for item in default.data]), floats)


@pytest.mark.parametrize("fields, param", [
    ({"embedding_type": "int4"}, "embedding_type"),
    ({"embedding_type": "base64"}, "embedding_type"),
    ({"embedding_type": ["int8"]}, "embedding_type"),
    ({"embedding_types": ["int8", "fp8"]}, "embedding_types"),
    ({"embedding_types": "int8"}, "embedding_types"),
    ({"embedding_types": []}, "embedding_types"),
    ({"embedding_type": "int8", "embedding_types": ["int8"]}, "embedding_types"),
])
def test_bad_embedding_type_is_422(server, fields, param):
    error = assert_error(server.embed(["hello"], **fields), 422)
    assert error["param"] == param


# --- the Cohere routes ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cohere_clients(server):
    import cohere

    return (cohere.Client(base_url=server.url(), api_key="x", timeout=120),
            cohere.ClientV2(base_url=server.url(), api_key="x", timeout=120))


def test_cohere_v1_floats(server, cohere_clients):
    client, _ = cohere_clients
    response = client.embed(texts=TEXTS, model=MODEL_NAME, input_type="search_document")
    assert response.response_type == "embeddings_floats"
    assert response.texts == TEXTS
    vectors = np.asarray(response.embeddings, dtype=np.float32)
    assert vectors.shape == (len(TEXTS), DIM)
    for served, openai_vector in zip(vectors, _floats(server)):
        assert_close(served, openai_vector)
    assert response.meta.billed_units.input_tokens > 0


@pytest.mark.parametrize("version", [1, 2])
def test_cohere_embedding_types(cohere_clients, version):
    client = cohere_clients[version - 1]
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    kwargs = {"output_dimension": 100} if version == 2 else {}
    response = client.embed(texts=TEXTS, model=MODEL_NAME, input_type="search_query", embedding_types=types,
                            **kwargs)
    assert response.response_type == "embeddings_by_type"
    embeddings = response.embeddings
    floats = np.asarray(embeddings.float_, dtype=np.float32)
    assert floats.shape == (len(TEXTS), 100 if version == 2 else DIM)
    for embedding_type in QUANTISED:
        assert_encodes(getattr(embeddings, embedding_type), floats, embedding_type)
    assert_encodes(embeddings.base64, floats, "float")  # Cohere's base64: the float32 bytes


def test_cohere_v2_without_types_is_by_type_float(server):
    response = server.post("/v2/embed", {"model": MODEL_NAME, "texts": ["hello"], "input_type": "search_query"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["response_type"] == "embeddings_by_type"
    assert list(body["embeddings"]) == ["float"] and len(body["embeddings"]["float"][0]) == DIM
    assert server.post("/embed", {"texts": ["hello"]}).json()["response_type"] == "embeddings_floats"


@pytest.mark.parametrize("path", ["/v1/embed", "/v2/embed"])
@pytest.mark.parametrize("fields, param", [
    ({"texts": ["x"], "embedding_types": ["int4"]}, "embedding_types"),
    ({"texts": ["x"], "embedding_types": []}, "embedding_types"),
    ({"texts": ["x"], "truncate": "START"}, "truncate"),
    ({"texts": []}, "texts"),
    ({"texts": ["x", ""]}, "texts"),
    ({"texts": "x"}, "texts"),
    ({}, "texts"),
    ({"texts": ["x"], "output_dimension": DIM + 1}, "output_dimension"),
])
def test_cohere_bad_request_is_422(server, path, fields, param):
    error = assert_error(server.post(path, {"model": MODEL_NAME, **fields}), 422)
    assert error["param"] == param


def test_cohere_client_sees_errors_as_such(cohere_clients):
    from cohere.core.api_error import ApiError

    client, _ = cohere_clients
    with pytest.raises(ApiError) as info:
        client.embed(texts=["fox"], model=MODEL_NAME, embedding_types=["int4"])
    assert info.value.status_code == 422


# --- the server default ----------------------------------------------------------------------

def test_server_default_type(start_server):
    """INFINITY_EMBEDDING_TYPE sets the type of requests that name none, on both routes;
    a request's own type still wins."""
    server = start_server(env={"INFINITY_EMBEDDING_TYPE": "ubinary"})
    floats = _floats(server, embedding_type="float")
    default = server.embed(TEXTS).json()["data"]
    assert_encodes([item["embedding"] for item in default], floats, "ubinary")
    int8 = server.embed(TEXTS, embedding_types=["int8"]).json()["data"]
    assert_encodes([item["embeddings"]["int8"] for item in int8], floats, "int8")
    cohere = server.post("/v1/embed", {"texts": TEXTS}).json()
    assert cohere["response_type"] == "embeddings_by_type" and list(cohere["embeddings"]) == ["ubinary"]
    assert_encodes(cohere["embeddings"]["ubinary"], floats, "ubinary")


@pytest.mark.parametrize("embed_dtype", ["float32", "float16", "bfloat16"])
def test_binary_answers_hold_the_json_vectors(server, embed_dtype):
    from infinity.api.binary import read_embeddings

    texts = ["binary answers hold the same vectors", "second text"]
    expected = np.array([decode_embedding(item["embedding"]) for item in server.embed(texts).json()["data"]])
    answer = server.embed(texts, encoding_format="bytes", embed_dtype=embed_dtype)
    assert answer.status_code == 200 and answer.headers["Content-Type"].startswith("application/octet-stream")
    vectors, header = read_embeddings(answer.content)
    assert header["model"] == MODEL_NAME and vectors.shape == (2, DIM)
    for served, reference in zip(vectors, expected):
        assert_close(served, reference, f"binary {embed_dtype}")
