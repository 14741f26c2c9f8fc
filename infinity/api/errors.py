"""The error shapes: OpenAI's `{"error": {...}}` that every route answers, TEI's
`{"error", "error_type"}` for TEI's bodies; and the one place where a kind of error (from a
child or the engine client) becomes an HTTP status."""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

import msgspec
from aiohttp import web

from infinity.client.engine_client import ServingError
from infinity.shared.protocol import ErrorKind

_REASON_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as JSON with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


# What a client is answered for each kind: the status, and whether to retry after a second.
KIND_STATUS = {
    ErrorKind.INVALID_INPUT: 422,
    ErrorKind.INTERNAL: 500,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.MODEL_NOT_READY: 503,
    ErrorKind.NOT_READY: 503,
    ErrorKind.WORKER_DIED: 503,
    ErrorKind.SHUTTING_DOWN: 503,
}
_RETRY_LATER = {ErrorKind.OVERLOADED, ErrorKind.MODEL_NOT_READY, ErrorKind.NOT_READY, ErrorKind.WORKER_DIED}


def from_kind(error: ServingError) -> APIError:
    """The client's answer to a request that failed for `error.kind`."""
    kind = error.kind
    code = None if kind in (ErrorKind.INVALID_INPUT, ErrorKind.INTERNAL) else kind.value
    return APIError(KIND_STATUS[kind], error.message, param=error.param, code=code,
                    headers={"Retry-After": "1"} if kind in _RETRY_LATER else None)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    param: str | None  # the request field at fault, if one is
    code: str | int  # a short name of the error, or its status


class ErrorResponse(msgspec.Struct):
    """Every error answer of the API."""

    error: ErrorDetail


def error_body(error: APIError) -> bytes:
    kind = _REASON_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return msgspec.json.encode(ErrorResponse(ErrorDetail(error.message, kind, error.param,
                                                         error.code or error.status)))


# TEI's kind of each status this server answers (TEI's own statuses for them are the same
# but for its 400 "Empty", which is a 422 Validation here like any other invalid input).
_TEI_TYPES = {429: "Overloaded", 503: "Unhealthy"}


class TEIErrorResponse(msgspec.Struct):
    """TEI's error: its message, and its kind (Validation, Overloaded, Unhealthy, Backend;
    TEI's others, Tokenizer and Empty, are Validation here)."""

    error: str
    error_type: str


def tei_error_body(error: APIError) -> bytes:
    """`error` in TEI's shape: its message and TEI's kind of it."""
    kind = _TEI_TYPES.get(error.status, "Backend" if error.status >= 500 else "Validation")
    return msgspec.json.encode(TEIErrorResponse(error.message, kind))


# Each error shape's encoder: a route whose operation declares one shape answers every
# error in it, those raised before its body is read (401, 413, ...) too.
ENCODERS = {ErrorResponse: error_body, TEIErrorResponse: tei_error_body}
# How a request's errors are encoded, where not in the one shape (`error_body`): set by
# the route, by its operation's shape or, where a path takes several dialects, its body's.
ERROR_BODY = web.RequestKey("error_body", object)


def error_response(error: APIError, encode: Callable[[APIError], bytes] = error_body) -> web.Response:
    return web.Response(body=encode(error), status=error.status, content_type="application/json",
                        headers=error.headers)


def raw_error_response(error: APIError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes the connection, for answers written
    straight to a connection that no request handler owns."""
    body = error_body(error)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close",
               **error.headers}
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n{head}\r\n".encode() + body
