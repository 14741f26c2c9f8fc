"""End to end: what one connection may hold. Slow headers and trickled bodies are cut at
their deadline with a 408, idle keep-alive connections are closed, a cap on open
connections makes room by closing idle ones (or refuses with a 503 when every connection
is inside a request), and the server keeps serving through all of it."""

from __future__ import annotations

import resource
import socket
import time

import pytest

from tests.support.reference import MODEL_NAME
from tests.support.server import running_server

pytestmark = pytest.mark.timeout(300)

HEADER_TIMEOUT = 4.0  # long enough for the cap test to open its connections on a busy machine
BODY_TIMEOUT = 2.0
KEEPALIVE_TIMEOUT = 3.0
MAX_CONNECTIONS = 50
# Deadlines are checked every half second or so; allow that and a slow machine.
SLACK = 1.5


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    with running_server("--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                        "--keepalive-timeout", str(KEEPALIVE_TIMEOUT),
                        "--max-connections", str(MAX_CONNECTIONS),
                        log_dir=tmp_path_factory.mktemp("guarded-server"), shared=True) as proc:
        yield proc


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def embed_request(body: bytes = b'{"input": "still serving"}') -> bytes:
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def assert_serves(server) -> None:
    response = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": ["still serving"]}, timeout=30)
    assert response.status_code == 200, response.text


def test_a_trickled_body_is_cut_at_its_deadline_with_408(guarded_server):
    with connect(guarded_server) as sock:
        start = time.monotonic()
        sock.sendall(embed_request(b" " * 100)[:-100])
        try:
            while time.monotonic() - start < 30:
                sock.sendall(b" ")  # one byte every 0.3 s: never idle long, never done
                time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            pass
        took = time.monotonic() - start
        answer = read_until_closed(sock)
    assert took < BODY_TIMEOUT + SLACK, f"a trickling client held its connection {took:.1f} s"
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"code":"request_timeout"' in answer and b"body" in answer
    assert_serves(guarded_server)


def test_headers_sent_too_slowly_are_cut_with_408(guarded_server):
    with connect(guarded_server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\n")
        answer = read_until_closed(sock)
        took = time.monotonic() - start
    assert HEADER_TIMEOUT - 0.1 < took < HEADER_TIMEOUT + SLACK, took
    assert answer.startswith(b"HTTP/1.1 408 ") and b"headers" in answer, answer[:200]


def test_a_connection_that_sends_nothing_is_cut_at_the_header_deadline(guarded_server):
    with connect(guarded_server) as sock:
        start = time.monotonic()
        read_until_closed(sock)
        assert time.monotonic() - start < HEADER_TIMEOUT + SLACK


def test_an_idle_keep_alive_connection_is_closed(guarded_server):
    with connect(guarded_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        took = time.monotonic() - start
    assert KEEPALIVE_TIMEOUT - 0.1 < took < KEEPALIVE_TIMEOUT + SLACK, took


def test_a_keep_alive_connection_serves_several_requests_within_its_time(guarded_server):
    with connect(guarded_server) as sock:
        for _ in range(3):
            sock.sendall(embed_request())
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            time.sleep(KEEPALIVE_TIMEOUT / 3)


def test_at_the_cap_idle_connections_make_room_for_new_clients(guarded_server):
    # A few more than the cap, not many more: a burst that overflows the kernel's accept
    # queue is admitted over seconds of SYN retries, and the oldest would meet the header
    # deadline (a 408) before a newcomer closes them.
    beyond_cap = 20
    waiting = [connect(guarded_server) for _ in range(MAX_CONNECTIONS + beyond_cap)]
    try:
        time.sleep(0.3)
        assert_serves(guarded_server)
        for number, sock in enumerate(waiting[:beyond_cap]):
            sock.settimeout(HEADER_TIMEOUT / 2)
            try:
                answer = sock.recv(65536)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", f"connection {number} of the oldest was not closed for a new one: {answer[:100]!r}"
    finally:
        for sock in waiting:
            sock.close()


def test_at_the_cap_with_every_connection_inside_a_request_a_new_one_gets_503(guarded_server):
    busy = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(guarded_server)
            sock.sendall(embed_request(b" " * 100)[:-100])  # headers sent, body pending: inside a request
            busy.append(sock)
        time.sleep(0.5)
        with connect(guarded_server) as extra:
            answer = read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b'"code":"too_many_connections"' in answer and b"Retry-After: 1" in answer
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.5)
    assert_serves(guarded_server)


def test_a_malformed_request_line_is_a_json_400(guarded_server):
    with connect(guarded_server) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")), answer[:200]
    assert b"application/json" in answer and b'"error"' in answer
    assert_serves(guarded_server)


def test_a_thousand_idle_connections_do_not_stop_a_new_client(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    idle = []
    try:
        for _ in range(1000):
            idle.append(connect(server))
        start = time.monotonic()
        response = server.embed(["a new client"], timeout=30)
        assert response.status_code == 200, response.text
        assert time.monotonic() - start < 10
    finally:
        for sock in idle:
            sock.close()
