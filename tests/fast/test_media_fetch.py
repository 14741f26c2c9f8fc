"""Fetching media by URL against a local aiohttp server: bodies, upstream errors,
redirects, slow drips and oversize bodies; and what the default policy refuses to dial
(loopback in its spellings, link-local metadata addresses, a redirect to a private
address), each a client error naming the item.

The fetcher's connector reaches loopback only here: a URL of any other host (a private or
link-local address, a name other than localhost) fails the test before it is resolved or
dialled, so a refusal that regressed fails a test instead of reaching the network.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.connector import Connection

from infinity.config import MediaConfig
from infinity.api.errors import ServingError
from infinity.api.media_fetch import MediaFetcher, is_public
from infinity.shared.protocol import ErrorKind

BODY = b"\x89PNG not really" * 100


def _app() -> web.Application:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(body=BODY)

    async def missing(_: web.Request) -> web.Response:
        return web.Response(status=404)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query.get("to", "/ok"))

    async def loop(_: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def drip(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"x")
            await asyncio.sleep(0.2)
        return response

    async def big(request: web.Request) -> web.StreamResponse:
        if "length" in request.query:
            return web.Response(body=b"x" * 5000)
        response = web.StreamResponse()  # chunked: no Content-Length
        await response.prepare(request)
        for _ in range(50):
            await response.write(b"x" * 100)
        return response

    app = web.Application()
    for path, handler in (("/ok", ok), ("/missing", missing), ("/moved", moved), ("/loop", loop),
                          ("/drip", drip), ("/big", big)):
        app.router.add_get(path, handler)
    return app


def _is_loopback(host: str | None) -> bool:
    """Whether `host` names loopback as the socket layer reads it (legacy IPv4 forms such as
    2130706433 included: should aiohttp stop refusing them, that is where they would go)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host or ""))
        except OSError:
            return False  # a name: it would be resolved
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class _LoopbackOnly(aiohttp.TCPConnector):
    """The fetcher's connector in these tests. A connection to any host but loopback is
    recorded in `attempts` and fails with an AssertionError (which the fetcher does not
    turn into a client error) before the host is resolved or dialled."""

    def __init__(self, *, attempts: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._attempts = attempts

    async def connect(self, req: aiohttp.ClientRequest, traces: list[Any],
                      timeout: aiohttp.ClientTimeout) -> Connection:
        if not _is_loopback(req.url.host):
            self._attempts.append(str(req.url))
            raise AssertionError(f"the fetcher tried to connect to {req.url}")
        return await super().connect(req, traces, timeout)


def _run(config: MediaConfig, test: Callable[[MediaFetcher, str], Awaitable[None]],
         allowed: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool] | None = None) -> None:
    """Run `test` with a fetcher and the base URL of the local server; the fetcher's
    connector is `_LoopbackOnly`, and no test may have tried any other host."""
    attempts: list[str] = []

    async def main() -> None:
        runner = web.AppRunner(_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fetcher = MediaFetcher(config, allowed)
        try:
            await test(fetcher, f"http://127.0.0.1:{port}")
        finally:
            await fetcher.close()
            await runner.cleanup()

    with mock.patch.object(aiohttp, "TCPConnector", functools.partial(_LoopbackOnly, attempts=attempts)):
        asyncio.run(main())
    assert not attempts, f"the fetcher tried to connect to {attempts}"


def _refused(message_part: str) -> Callable[[Awaitable[bytes]], Awaitable[None]]:
    async def check(fetch: Awaitable[bytes]) -> None:
        with pytest.raises(ServingError) as caught:
            await fetch
        assert caught.value.kind is ErrorKind.INVALID_INPUT and caught.value.param == "input"
        assert "input[0]" in caught.value.message and message_part in caught.value.message, caught.value.message
    return check


PRIVATE_ALLOWED = MediaConfig(allow_private_networks=True, fetch_timeout=1.5)


def test_a_body_is_fetched_and_redirects_followed():
    async def test(fetcher: MediaFetcher, base: str) -> None:
        assert await fetcher.fetch(f"{base}/ok", "input[0]", 10_000) == BODY
        assert await fetcher.fetch(f"{base}/moved", "input[0]", 10_000) == BODY

    _run(PRIVATE_ALLOWED, test)


def test_upstream_errors_timeouts_and_oversize_bodies_are_the_clients():
    async def test(fetcher: MediaFetcher, base: str) -> None:
        await _refused("answered HTTP 404")(fetcher.fetch(f"{base}/missing", "input[0]", 10_000))
        await _refused("more than 3 redirects")(fetcher.fetch(f"{base}/loop", "input[0]", 10_000))
        await _refused("did not answer within 1.5 s")(fetcher.fetch(f"{base}/drip", "input[0]", 10_000))
        for query in ("?length=1", ""):  # with and without Content-Length
            await _refused("larger than 1000 bytes")(fetcher.fetch(f"{base}/big{query}", "input[0]", 1000))
        await _refused("could not be fetched")(fetcher.fetch("http://127.0.0.1:9/ok", "input[0]", 1000))

    _run(PRIVATE_ALLOWED, test)


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "file:///etc/passwd", "http://user:pw@example.com/a",
                                 "http:///a.png"])
def test_only_plain_http_urls_are_fetched(url):
    async def test(fetcher: MediaFetcher, _: str) -> None:
        await _refused("input[0]")(fetcher.fetch(url, "input[0]", 1000))

    _run(PRIVATE_ALLOWED, test)


@pytest.mark.parametrize(("host", "reason"), [
    ("127.0.0.1", "not a public address"), ("[::1]", "not a public address"),
    ("[::ffff:127.0.0.1]", "not a public address"), ("169.254.169.254", "not a public address"),
    ("10.0.0.1", "not a public address"), ("0.0.0.0", "not a public address"), ("localhost", "not a public address"),
    # 127.0.0.1 as one number: refused by aiohttp's connector before any resolver would see it
    ("2130706433", "not a canonical IPv4 address")])
def test_the_default_policy_dials_public_addresses_only(host, reason):
    async def test(fetcher: MediaFetcher, base: str) -> None:
        port = base.rsplit(":", 1)[1]
        await _refused(reason)(fetcher.fetch(f"http://{host}:{port}/ok", "input[0]", 1000))

    _run(MediaConfig(fetch_timeout=1.5), test)


def test_every_redirect_hop_is_checked():
    """The test server's own address stands in for a public one; its redirect to a
    private address is refused before anything is dialled."""
    def loopback_only(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return address == ipaddress.ip_address("127.0.0.1")

    async def test(fetcher: MediaFetcher, base: str) -> None:
        assert await fetcher.fetch(f"{base}/moved", "input[0]", 10_000) == BODY
        for target in ("http://169.254.169.254/latest/meta-data", "http://[::1]/", "http://10.1.2.3/"):
            await _refused("not a public address")(fetcher.fetch(f"{base}/moved?to={target}", "input[0]", 1000))

    _run(MediaConfig(fetch_timeout=1.5), test, allowed=loopback_only)


def test_allowed_domains_and_the_off_switch():
    async def test_domains(fetcher: MediaFetcher, base: str) -> None:
        await _refused("not among this server's allowed domains")(fetcher.fetch(f"{base}/ok", "input[0]", 1000))
        await _refused("not among")(fetcher.fetch("http://evil-example.com/a", "input[0]", 1000))

    _run(MediaConfig(allow_private_networks=True, allowed_domains=["example.com"]), test_domains)

    async def test_off(fetcher: MediaFetcher, base: str) -> None:
        await _refused("does not fetch URLs")(fetcher.fetch(f"{base}/ok", "input[0]", 1000))

    _run(MediaConfig(fetch_urls=False), test_off)


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("100.64.0.1", False), ("169.254.169.254", False), ("224.0.0.1", False), ("2002:7f00:1::", False),
    ("64:ff9b::7f00:1", False), ("fe80::1", False), ("fc00::1", False), ("0.0.0.0", False)])
def test_what_counts_as_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public
