"""What one HTTP connection may hold: deadlines for a request's headers and its whole body,
a limit on idle keep-alive time, and a cap on open connections.

aiohttp bounds none of these on its own (a client trickling its body a byte at a time
holds its connection and its handler for as long as it likes; a per-read timeout, as
nginx's `client_body_timeout`, never cuts it). Here each connection is in one phase:

- `HEADERS` from its first byte (or from accept) until aiohttp has read a request's
  headers: at most `header_timeout`;
- `BODY` until the request's whole body is read: at most `body_timeout`;
- `BUSY` while the server computes the answer: no deadline (the server bounds its own work);
- `IDLE` after the answer, waiting for the next request: at most `keepalive_timeout`
  (this also bounds a client too slow to read its answer).

A connection past its deadline gets a 408 JSON error (or, when idle, nothing) and is
closed. At `max_connections`, a new connection closes the connection that has waited
longest outside a request (idle, or still sending headers); if every connection is inside
a request, the new one is answered 503 and closed.

`GuardedSite` serves an aiohttp `AppRunner` through connections that keep this account;
`track_request` is the middleware that moves a connection through its phases.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from infinity.api.errors import APIError, error_response, raw_error_response

log = logging.getLogger(__name__)

# What a route or middleware is to aiohttp: a request in, a response out.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Phase(enum.Enum):
    HEADERS = "headers"
    BODY = "body"
    BUSY = "busy"
    IDLE = "idle"


class ConnectionLimits(msgspec.Struct, frozen=True):
    """Seconds a connection may spend in each phase, and how many may be open."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int


class GuardedConnection(web.RequestHandler):
    """aiohttp's handler of one connection, keeping its phase and when it began."""

    __slots__ = ("_guard", "phase", "since", "entered", "_refused")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self.phase = Phase.HEADERS
        self.since = 0.0
        self.entered = 0
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit(self):
            self._refused = True
            refusal = APIError(503, "the server has as many connections open as it allows; retry shortly",
                               code="too_many_connections", headers={"Retry-After": "1"})
            transport.write(raw_error_response(refusal))  # type: ignore[attr-defined]
            transport.close()
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.IDLE:
            self.enter(Phase.HEADERS)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._guard.forget(self)
        super().connection_lost(exc)

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        self.since = self._guard.now()
        self.entered = self._guard.next_entry()

    def close_now(self, answer_late: bool) -> None:
        """Close the connection: past its deadline (a request that came too slowly is
        answered 408 first, if `answer_late`), or silently, to make room for a new one."""
        if self.transport is None:
            return
        if answer_late and self.phase in (Phase.HEADERS, Phase.BODY):
            what = "headers" if self.phase is Phase.HEADERS else "body"
            limit = self._guard.deadline_of(self.phase)
            self.transport.write(raw_error_response(APIError(
                408, f"the request's {what} did not arrive within {limit:g} s", code="request_timeout")))
        self.force_close()

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """A body that could not be read was answered 400 already; aiohttp meets the error
        again as it drains the connection, which is no fault of the server."""
        if isinstance(kwargs.get("exc_info"), web.RequestPayloadError):
            log.debug("request body could not be read: %s", kwargs["exc_info"])
            return
        super().log_exception(*args, **kwargs)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Requests aiohttp cannot parse (a bad request line or headers) get the JSON error
        too; aiohttp closes the connection after it."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.debug("unparsable request: %s", message or exc)
        response = error_response(APIError(status, f"malformed HTTP request: {message or exc}"))
        response.force_close()
        return response


class ConnectionGuard:
    """The open connections of one server, their deadlines, and the cap on their number."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: set[GuardedConnection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        # Which connection entered its phase first: uvloop's clock ticks in milliseconds, so
        # connections accepted together share one `since` and cannot be ordered by it.
        self._entries = itertools.count()
        self._deadlines = {Phase.HEADERS: limits.header_timeout, Phase.BODY: limits.body_timeout,
                           Phase.IDLE: limits.keepalive_timeout}
        # Deadlines are checked this often: a connection is cut at most this late.
        self._interval = min(1.0, *(t / 4 for t in self._deadlines.values()))

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def next_entry(self) -> int:
        return next(self._entries)

    def deadline_of(self, phase: Phase) -> float:
        return self._deadlines[phase]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._sweeper = loop.call_later(self._interval, self._sweep)

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def admit(self, connection: GuardedConnection) -> bool:
        """Take a new connection, making room if the cap is reached; False: refuse it."""
        if len(self._open) >= self.limits.max_connections:
            waiting = [c for c in self._open if c.phase in (Phase.IDLE, Phase.HEADERS)]
            if not waiting:
                log.warning("%d connections open, all inside a request: refusing a new one", len(self._open))
                return False
            oldest = min(waiting, key=lambda c: c.entered)
            self._open.discard(oldest)
            oldest.close_now(answer_late=False)
        connection.enter(Phase.HEADERS)
        self._open.add(connection)
        return True

    def forget(self, connection: GuardedConnection) -> None:
        self._open.discard(connection)

    def _sweep(self) -> None:
        now = self.now()
        for connection in list(self._open):
            limit = self._deadlines.get(connection.phase)
            if limit is not None and now - connection.since > limit:
                connection.close_now(answer_late=True)
        assert self._loop is not None
        self._sweeper = self._loop.call_later(self._interval, self._sweep)


BODY = web.RequestKey("body", bytearray)


@web.middleware
async def track_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Move the request's connection through its phases: its body is read here (into
    `request[BODY]`), under the body deadline, before the route runs; the connection is idle
    once the route returns."""
    connection = request.protocol
    guarded = isinstance(connection, GuardedConnection)  # else served some other way (a test client)
    if guarded:
        connection.enter(Phase.BODY)
    try:
        request[BODY] = await _read_body(request)
        if guarded:
            connection.enter(Phase.BUSY)
        return await handler(request)
    finally:
        if guarded:
            connection.enter(Phase.IDLE)


async def _read_body(request: web.Request) -> bytearray:
    """The whole body, appended chunk by chunk as it arrives: joining the chunks at the
    end would copy a large body in one step and stall every other request meanwhile."""
    body, limit = bytearray(), request.client_max_size
    try:
        async for chunk in request.content.iter_any():
            if len(body) + len(chunk) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body) + len(chunk))
            body += chunk
    except web.RequestPayloadError as exc:
        raise APIError(400, f"the request body could not be read: {exc}") from None
    return body


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are `GuardedConnection`s kept by `guard`."""

    __slots__ = ("_host", "_port", "_guard", "_options")

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard,
                 backlog: int = 1024, **handler_options: Any) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard
        self._options = handler_options

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._guard.start(loop)
        self._server = await loop.create_server(
            # aiohttp's own keep-alive timer is left at its default, far beyond the guard's.
            lambda: GuardedConnection(server, self._guard, loop=loop, **self._options),
            self._host, self._port, backlog=self._backlog, reuse_address=True)

    async def stop(self) -> None:
        self._guard.stop()
        await super().stop()
