"""End to end: every client mistake, limit and refusal is answered with the JSON error
shape and the right status (never a 5xx), and the server keeps serving afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from tests.support.answers import assert_error, decode_embedding
from tests.support.reference import MAX_LENGTH, MODEL_NAME, assert_close, reference_embed
from tests.support.server import API_KEY, running_server

pytestmark = pytest.mark.timeout(300)

STRICT_MAX_ITEMS = 8
STRICT_MAX_QUEUED = 4
STRICT_MAX_BYTES = 8192
STRICT_CONFIG = f"""
[server]
max_items_per_request = {STRICT_MAX_ITEMS}
max_queued_items = {STRICT_MAX_QUEUED}
max_request_bytes = {STRICT_MAX_BYTES}

[[models]]
name = "{MODEL_NAME}"
source = "default"
truncate = false
"""


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """Small limits, and truncation off: inputs over max_length are refused."""
    with running_server(config=STRICT_CONFIG, log_dir=tmp_path_factory.mktemp("strict-server"),
                        shared=True) as proc:
        yield proc


def assert_serves(server, count: int = 2, **headers) -> None:
    """The server still answers a normal request correctly."""
    response = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": ["still serving"] * count},
                           headers=headers or None)
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["data"]) == count
    vector = decode_embedding(body["data"][0]["embedding"])
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4


def post_raw(server, data, path="/v1/embeddings", **kwargs) -> requests.Response:
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return requests.post(server.url(path), data=data, headers=headers, timeout=60, **kwargs)


# --- malformed and mistyped bodies ------------------------------------------------------------

@pytest.mark.parametrize("body", [
    b'{"input": ',
    b"not json at all",
    b'{"input": "a",}',
    b"\xff\xfe{}",
    b'{"input": "\\ud800 lone surrogate"}',
])
def test_malformed_json_is_400(server, body):
    assert_error(post_raw(server, body), 400)
    assert_serves(server)


def test_empty_body_is_400(server):
    assert_error(post_raw(server, b""), 400)


def test_deeply_nested_body_is_400(server):
    depth = 20_000
    error = assert_error(post_raw(server, b'{"input": ' + b"[" * depth + b"]" * depth + b"}"), 400)
    assert "nested" in error["message"]
    assert_serves(server)


@pytest.mark.parametrize("body, param", [
    (b'{"input": "a", "input": "b"}', "input"),
    (b'{"model": "%s", "input": "a", "model": "other"}' % MODEL_NAME.encode(), "model"),
    (b'{"input": "a", "\\u0069nput": 5}', "input"),
    (b'{"input": "a", "input": "a"}', "input"),
    (b' { "a": 1 , "a" : 2 } ', "a"),
    (b'{"x": {}, "x": []}', "x"),
])
def test_repeated_keys_are_400(server, body, param):
    error = assert_error(post_raw(server, body), 400)
    assert error["param"] == param and "more than once" in error["message"]


@pytest.mark.parametrize("body, param", [
    (b'{"input": [1e400]}', "input"),
    (b'{"input": "a", "dimensions": 1e400}', "dimensions"),
    (b'{"input": "a", "dimensions": 123456789012345678901234567890}', "dimensions"),
    (b'{"input": [123456789012345678901234567890]}', "input"),
])
def test_huge_numbers_are_422(server, body, param):
    error = assert_error(post_raw(server, body), 422)
    assert error["param"] == param


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_by_its_content_type_is_415(server, content_type):
    response = post_raw(server, b'{"input": "a"}', headers={"Content-Type": content_type})
    error = assert_error(response, 415)
    assert "application/json" in error["message"]


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "application/vnd.api+json"}])
def test_json_bodies_with_or_without_a_json_content_type_are_served(server, headers):
    response = requests.post(server.url("/v1/embeddings"), data=b'{"input": "a"}', headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def test_a_compressed_body_larger_than_the_limit_once_inflated_is_413(strict_server):
    import gzip

    inflated = b'{"input": "' + b"a" * (STRICT_MAX_BYTES * 4) + b'"}'
    error = assert_error(post_raw(strict_server, gzip.compress(inflated), headers={"Content-Encoding": "gzip"}), 413)
    assert str(STRICT_MAX_BYTES) in error["message"]
    assert_error(post_raw(strict_server, b"not gzip at all", headers={"Content-Encoding": "gzip"}), 400)
    assert_serves(strict_server)
    assert "Traceback" not in strict_server.log_text()


def test_a_body_that_ends_before_its_length_leaves_the_server_serving(server):
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"input\": ")
        sock.shutdown(socket.SHUT_WR)
        answer = sock.recv(65536)
    assert not answer.startswith(b"HTTP/1.1 5"), answer
    assert_serves(server)
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL_NAME, "input": 5}, "input"),
    ({"model": MODEL_NAME, "input": [1.5]}, "input"),
    ({"model": MODEL_NAME, "input": {"a": 1}}, "input"),
    ({"model": MODEL_NAME, "input": None}, "input"),
    ({"model": MODEL_NAME, "input": True}, "input"),
    ({"model": MODEL_NAME, "input": [True, False]}, "input"),
    ({"model": MODEL_NAME, "input": ["a", 1]}, "input"),
    ({"model": MODEL_NAME, "input": [[1, "a"]]}, "input"),
    ({"model": MODEL_NAME, "input": [["a"]]}, "input"),
    ({"model": MODEL_NAME, "input": [[]]}, "input"),
    ({"model": MODEL_NAME, "input": [[101, 102], []]}, "input"),
    ({"model": MODEL_NAME, "input": [None]}, "input"),
    ({"model": 3, "input": "hello"}, "model"),
    ({"model": MODEL_NAME, "input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"model": MODEL_NAME, "input": "hello", "dimensions": "ten"}, "dimensions"),
    ({"model": MODEL_NAME, "input": "hello", "dimensions": 1.5}, "dimensions"),
])
def test_wrong_types_are_422(server, body, param):
    error = assert_error(server.post("/v1/embeddings", body), 422)
    assert error["param"] == param, error
    assert_serves(server)


def test_missing_input_is_422(server):
    error = assert_error(server.post("/v1/embeddings", {"model": MODEL_NAME}), 422)
    assert "input" in error["message"]


def test_body_that_is_not_an_object_is_422(server):
    assert_error(server.post("/v1/embeddings", [1, 2]), 422)
    assert_error(server.post("/v1/embeddings", "hello"), 422)


@pytest.mark.parametrize("value", ["", [""], ["ok", ""], []])
def test_empty_input_is_422(server, value):
    error = assert_error(server.post("/v1/embeddings", {"model": MODEL_NAME, "input": value}), 422)
    assert error["param"] == "input"
    assert_serves(server)


def test_more_items_than_the_default_limit_is_422(server):
    error = assert_error(server.embed(["a"] * 2049), 422)
    assert error["param"] == "input"
    assert "2048" in error["message"]
    # The limit itself is fine.
    response = server.embed(["a"] * 2048)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["data"]) == 2048


def test_unknown_model_is_404_and_lists_served_models(server):
    error = assert_error(server.embed(["hello"], model="no-such-model"), 404)
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]
    assert MODEL_NAME in error["message"]
    assert_serves(server)


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/no-such-route"),
    ("POST", "/v2/embeddings"),
    ("GET", "/v2"),
    ("POST", "/v1/embeddings/extra"),
])
def test_unknown_route_is_404_json(server, method, path):
    error = assert_error(requests.request(method, server.url(path), timeout=30), 404)
    assert path in error["message"]


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/embeddings", "POST"),
    ("PUT", "/v1/embeddings", "POST"),
    ("DELETE", "/embeddings", "POST"),
    ("POST", "/v1/models", "GET"),
    ("POST", "/health", "GET"),
    ("PUT", "/", "POST"),  # TEI's Hugging Face inference form (GET / redirects to /docs)
])
def test_wrong_method_is_405_json(server, method, path, allowed):
    response = requests.request(method, server.url(path), timeout=30)
    assert_error(response, 405)
    assert allowed in response.headers.get("Allow", "")


@pytest.mark.parametrize("dimensions", [-1, 385, 10 ** 6, 2 ** 70])
def test_dimensions_out_of_range_is_422(server, dimensions):
    error = assert_error(server.embed(["hello"], dimensions=dimensions), 422)
    assert error["param"] == "dimensions"
    assert "384" in error["message"]


def test_dimensions_0_asks_for_all_of_them_as_in_infinity(server):
    """infinity's generated client sends `dimensions: 0` unless told otherwise."""
    whole, zero = server.embed(["hello"]).json(), server.embed(["hello"], dimensions=0).json()
    assert len(zero["data"][0]["embedding"]) == 384
    np.testing.assert_allclose(zero["data"][0]["embedding"], whole["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("ids", [
    [[101, 30522, 102]],  # the vocabulary is 0..30521
    [[101, -1, 102]],
    [101, 10 ** 9, 102],
    [[101, 102], [101, 2 ** 40, 102]],
])
def test_token_ids_outside_vocabulary_are_422(server, ids):
    error = assert_error(server.embed(ids), 422)
    assert error["param"] == "input"
    assert "vocabulary" in error["message"]
    assert_serves(server)


def test_long_input_with_truncation_on_is_cut(server, reference_model):
    text = "overflowing " * 1000
    body = server.embed([text, "short"]).json()
    assert body["usage"]["prompt_tokens"] == MAX_LENGTH + 3
    assert_close(decode_embedding(body["data"][0]["embedding"]), reference_embed(reference_model, [text])[0])


def test_a_16_mib_input_is_embedded_from_its_first_tokens(server, reference_model):
    """One maximal input costs the tokenizer a prefix of it, not 16 MiB of work, and gives
    the vector and usage of the whole text cut to max_length."""
    text = ("all work and no play makes jack a dull boy " * 400_000)[:16 * 2 ** 20 - 200]
    response = server.embed(text)
    assert response.status_code == 200, response.text[:300]
    body = response.json()
    assert body["usage"]["prompt_tokens"] == MAX_LENGTH
    assert body["usage"]["truncated_inputs"] == 1
    assert_close(decode_embedding(body["data"][0]["embedding"]), reference_embed(reference_model, [text[:4000]])[0])


# --- the huge-token-id crash leaked queue slots: the strict server's queue holds 4 ----------------

def test_token_ids_beyond_64_bits_are_422_and_leak_nothing(strict_server):
    for ids in ([[101, 2 ** 70, 102]], [101, -(2 ** 70), 102]):
        for _ in range(2):
            assert_error(strict_server.embed(ids), 422)
    full = strict_server.embed(["still serving"] * STRICT_MAX_QUEUED)  # needs every queue slot back
    assert full.status_code == 200, f"queue slots leaked by the failed requests: {full.text[:200]}"


# --- limits of the strict server --------------------------------------------------------------

def test_strict_more_items_than_per_request_limit_is_422(strict_server):
    error = assert_error(strict_server.embed(["a"] * (STRICT_MAX_ITEMS + 1)), 422)
    assert error["param"] == "input"
    assert_serves(strict_server)


def test_strict_more_items_than_the_queue_can_hold_is_422(strict_server):
    """A request larger than the model's whole queue could never be admitted, so it is a
    client error rather than a 429 to retry forever."""
    error = assert_error(strict_server.embed(["a"] * (STRICT_MAX_QUEUED + 1)), 422)
    assert error["param"] == "input"
    assert str(STRICT_MAX_QUEUED) in error["message"]
    assert_serves(strict_server, count=STRICT_MAX_QUEUED)


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_size_limit_is_413_json(strict_server, chunked):
    payload = ('{"model": "%s", "input": ["%s"]}' % (MODEL_NAME, "x" * (STRICT_MAX_BYTES * 2))).encode()
    data = iter([payload[i:i + 1024] for i in range(0, len(payload), 1024)]) if chunked else payload
    error = assert_error(post_raw(strict_server, data), 413)
    assert str(STRICT_MAX_BYTES) in error["message"]
    assert_serves(strict_server)


def test_body_just_under_the_size_limit_is_served(strict_server):
    text = "word " * 200  # ~200 tokens, under max_length
    payload = ('{"model": "%s", "input": ["%s"]}' % (MODEL_NAME, text)).encode()
    assert len(payload) < STRICT_MAX_BYTES
    assert post_raw(strict_server, payload).status_code == 200


def test_input_over_max_length_with_truncation_off_is_422(strict_server):
    text = "overflowing " * 400
    error = assert_error(strict_server.embed(["short one", text]), 422)
    assert error["param"] == "input"
    assert str(MAX_LENGTH) in error["message"]
    assert "input[1]" in error["message"]
    assert_serves(strict_server)


def test_token_ids_over_max_length_with_truncation_off_are_422(strict_server):
    ids = [101] + [7592] * MAX_LENGTH + [102]
    error = assert_error(strict_server.embed([ids]), 422)
    assert str(MAX_LENGTH) in error["message"]
    assert strict_server.embed([ids[:MAX_LENGTH - 1] + [102]]).status_code == 200


def test_input_of_exactly_max_length_with_truncation_off_is_served(strict_server, reference_tokenizer,
                                                                     reference_model):
    # Find a text of exactly MAX_LENGTH tokens (with [CLS] and [SEP]).
    text = "exact " * (MAX_LENGTH - 2)
    assert len(reference_tokenizer(text)["input_ids"]) == MAX_LENGTH
    response = strict_server.embed([text])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == MAX_LENGTH
    assert_close(decode_embedding(response.json()["data"][0]["embedding"]),
                 reference_embed(reference_model, [text])[0])


def test_overload_is_429_with_retry_after(strict_server):
    """Many concurrent requests against a queue of 4 inputs: some are refused with 429 and
    Retry-After, the admitted ones are right, and afterwards the whole queue is free."""
    texts = [f"overload test sentence number {i} " + "with several extra words " * 25 for i in range(3)]
    threads = 24
    barrier = threading.Barrier(threads)

    def one(_):
        barrier.wait()
        return strict_server.embed(texts)

    with ThreadPoolExecutor(threads) as pool:
        responses = list(pool.map(one, range(threads)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert 429 in statuses and 200 in statuses, statuses
    first_ok = next(r for r in responses if r.status_code == 200).json()
    for response in responses:
        if response.status_code == 429:
            error = assert_error(response, 429)
            assert error["type"] == "rate_limit_error"
            retry_after = response.headers.get("Retry-After")
            assert retry_after is not None and float(retry_after) >= 0
        else:
            assert response.json()["data"] == first_ok["data"] or all(
                np.allclose(decode_embedding(a["embedding"]), decode_embedding(b["embedding"]), atol=1e-5)
                for a, b in zip(response.json()["data"], first_ok["data"]))
    # Every slot is back: a request as large as the whole queue is admitted.
    time.sleep(0.2)
    assert_serves(strict_server, count=STRICT_MAX_QUEUED)


def test_client_going_away_frees_its_queue_slots(strict_server):
    """Clients that hang up mid-request do not leak queue slots."""
    texts = ["a client that leaves early " + "and takes a while to embed " * 30] * STRICT_MAX_QUEUED
    left = 0
    for _ in range(5):
        try:
            response = requests.post(strict_server.url("/v1/embeddings"),
                                     json={"model": MODEL_NAME, "input": texts}, timeout=(5, 0.02))
        except requests.exceptions.ReadTimeout:
            left += 1
        else:  # answered within 20 ms, or refused: the previous client's work holds the queue
            if response.status_code != 200:
                assert_error(response, 429)
    assert left >= 1
    deadline = time.monotonic() + 30
    while True:
        response = strict_server.embed(texts)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        assert response.status_code == 429, response.text
        time.sleep(0.2)
    assert response.status_code == 200, f"queue slots still taken 30 s after the clients left: {response.text}"


# --- API key ---------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": API_KEY},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": f"Bearer {API_KEY}x"},
])
def test_missing_or_wrong_api_key_is_401(api_key_server, headers):
    for path in ("/v1/embeddings", "/embeddings"):
        response = requests.post(api_key_server.url(path), json={"model": MODEL_NAME, "input": ["hi"]},
                                 headers=headers, timeout=30)
        error = assert_error(response, 401)
        assert error["type"] == "authentication_error"
    assert_error(requests.get(api_key_server.url("/v1/models"), headers=headers, timeout=30), 401)


def test_right_api_key_is_served(api_key_server, sentences, reference_vectors):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = requests.post(api_key_server.url("/v1/embeddings"),
                             json={"model": MODEL_NAME, "input": sentences[:3]}, headers=auth, timeout=60)
    assert response.status_code == 200, response.text
    for i, item in enumerate(response.json()["data"]):
        assert_close(decode_embedding(item["embedding"]), reference_vectors[i])
    assert requests.get(api_key_server.url("/v1/models"), headers=auth, timeout=30).status_code == 200


def test_probes_need_no_api_key(api_key_server):
    for path in ("/health", "/v1/health", "/live", "/v1/live"):
        assert requests.get(api_key_server.url(path), timeout=30).status_code == 200


def test_errors_behind_the_api_key_are_json(api_key_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert_error(requests.post(api_key_server.url("/v1/embeddings"), data=b"{", headers=auth, timeout=30), 400)
    assert_error(requests.post(api_key_server.url("/v1/embeddings"), json={"model": MODEL_NAME, "input": ""},
                               headers=auth, timeout=30), 422)
    assert_serves(api_key_server, Authorization=f"Bearer {API_KEY}")


def test_server_still_serves_after_all_of_the_above(server, sentences, reference_vectors):
    body = server.embed(sentences[:4]).json()
    for i, item in enumerate(body["data"]):
        assert_close(decode_embedding(item["embedding"]), reference_vectors[i])
