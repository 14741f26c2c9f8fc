"""Fetching media items given by URL, safely, in the front end (the only I/O a media item
needs; decoding happens in the preprocessing processes, never here).

A URL may point anywhere, so every fetch is bounded: http and https only, no credentials
in the URL; every address dialled must be a global unicast one unless private networks
are allowed (IP literals are checked before connecting, names where they are resolved,
so the address checked is the address dialled and DNS rebinding cannot pass), redirects
are followed by hand, a few at most, each hop checked again; an optional allow-list of
domains; no proxy or cookies from the environment; connect and total timeouts; a byte
cap checked on Content-Length and while streaming; and a limit on fetches in flight for
the whole server. What goes wrong is the client's input: a `ServingError` of kind
invalid_input naming the item (a 4xx at the edge), never the server's failure.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from infinity.config import MediaConfig
from infinity.api.errors import ServingError
from infinity.shared.protocol import ErrorKind

USER_AGENT = "infinity-serve media fetcher"
READ_CHUNK = 64 * 1024
# Global in Python's sense but not reachable as themselves: 6to4 and NAT64 addresses
# embed an IPv4 address that may be private.
_TRANSLATED = [ipaddress.ip_network(net) for net in ("2002::/16", "64:ff9b::/96", "64:ff9b:1::/48")]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_public(address: Address) -> bool:
    """A global unicast address, after unwrapping an IPv4-mapped IPv6 one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if not address.is_global or address.is_multicast:
        return False
    return not any(address in net for net in _TRANSLATED if net.version == address.version)


class _CheckedResolver(AbstractResolver):
    """Resolves names as aiohttp does, then refuses any address the policy does not allow:
    the addresses returned are the ones dialled."""

    def __init__(self, allowed: Callable[[Address], bool]) -> None:
        self._inner = aiohttp.ThreadedResolver()
        self._allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        infos = await self._inner.resolve(host, port, family)
        for info in infos:
            if not self._allowed(ipaddress.ip_address(info["host"])):
                raise _Refused(f"{host} resolves to {info['host']}, which is not a public address")
        return infos

    async def close(self) -> None:
        await self._inner.close()


class _Refused(OSError):
    """An address the policy does not allow (an OSError, so aiohttp reports it as a
    connection error and no connection is made)."""


class MediaFetcher:
    """Fetches media URLs under `MediaConfig`'s limits; one per server (one connection
    pool, one limit on fetches in flight). `allowed_address` decides which addresses may
    be dialled (default: public ones, or any if private networks are allowed)."""

    def __init__(self, config: MediaConfig, allowed_address: Callable[[Address], bool] | None = None) -> None:
        self._config = config
        self._allowed = allowed_address or ((lambda _: True) if config.allow_private_networks else is_public)
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(config.max_concurrent_fetches)

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self._allowed),
                                             limit=self._config.max_concurrent_fetches)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": USER_AGENT}, auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=self._config.fetch_timeout,
                                              sock_connect=self._config.connect_timeout))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, item: str, max_bytes: int) -> bytes:
        """The body of `url` (the request's `item`, named in errors), at most `max_bytes`."""
        if not self._config.fetch_urls:
            raise _invalid(f"{item}: this server does not fetch URLs (media.fetch_urls is off); send the "
                           "media as a data: URI")
        async with self._slots:
            try:
                async with asyncio.timeout(self._config.fetch_timeout):
                    return await self._follow(URL(url), item, max_bytes)
            except TimeoutError:
                raise _invalid(f"{item}: {url} did not answer within {self._config.fetch_timeout:g} s") from None
            except _Refused as exc:
                raise _invalid(f"{item}: {exc}") from None
            except (aiohttp.ClientError, OSError) as exc:
                cause = exc.__cause__ if isinstance(exc.__cause__, _Refused) else exc
                raise _invalid(f"{item}: {url} could not be fetched ({cause})") from None

    async def _follow(self, url: URL, item: str, max_bytes: int) -> bytes:
        """Fetch, following at most `max_redirects` redirects by hand, each hop checked."""
        session = self._open_session()
        for _ in range(self._config.max_redirects + 1):
            self._check(url, item)
            async with session.get(url, allow_redirects=False) as response:
                if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
                    url = url.join(URL(response.headers["Location"]))
                    continue
                if not 200 <= response.status < 300:
                    raise _invalid(f"{item}: {url} answered HTTP {response.status}")
                return await _read_capped(response, url, item, max_bytes)
        raise _invalid(f"{item}: more than {self._config.max_redirects} redirects")

    def _check(self, url: URL, item: str) -> None:
        """A URL this server may dial: its scheme, credentials, host and (for an IP
        literal) address."""
        if url.scheme not in ("http", "https"):
            raise _invalid(f"{item}: only http and https URLs are fetched, not {url.scheme or 'this'!r}")
        if url.user is not None or url.password is not None:
            raise _invalid(f"{item}: a URL with credentials is not fetched")
        host = (url.host or "").rstrip(".").lower()
        if not host:
            raise _invalid(f"{item}: the URL has no host")
        domains = self._config.allowed_domains
        if domains and not any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in domains)):
            raise _invalid(f"{item}: {host} is not among this server's allowed domains")
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return  # a name: checked where it is resolved
        if not self._allowed(address):
            raise _invalid(f"{item}: {host} is not a public address")


async def _read_capped(response: aiohttp.ClientResponse, url: URL, item: str, max_bytes: int) -> bytes:
    too_big = f"{item}: {url} is larger than {max_bytes} bytes, the most this server takes of one item"
    if response.content_length is not None and response.content_length > max_bytes:
        raise _invalid(too_big)
    body = bytearray()
    async for chunk in response.content.iter_chunked(READ_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise _invalid(too_big)
    return bytes(body)


def _invalid(message: str) -> ServingError:
    return ServingError(ErrorKind.INVALID_INPUT, message, param="input")


async def media_bytes(fetcher: MediaFetcher, items: object, max_bytes: int, max_items: int) -> list[bytes]:
    """A request's media `input` (a string or a list of them: data: URIs, passed on as
    they are for the preprocessing processes to decode, or http(s) URLs, fetched here
    at once) as the bytes `protocol.Tokenize.media` carries."""
    listed = [items] if isinstance(items, str) else items
    if not isinstance(listed, list) or not listed or not all(isinstance(item, str) and item for item in listed):
        raise _invalid("input must be a data: URI or an http(s) URL, or a non-empty list of them")
    if len(listed) > max_items:
        raise _invalid(f"input has {len(listed)} items, more than the limit of {max_items} per request")
    for i, item in enumerate(listed):
        if not item.startswith(("data:", "http://", "https://")):
            raise _invalid(f"input[{i}] is neither a data: URI nor an http(s) URL")
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the other fetches
            tasks = [group.create_task(fetcher.fetch(item, f"input[{i}]", max_bytes))
                     for i, item in enumerate(listed) if not item.startswith("data:")]
    except* ServingError as failed:
        raise failed.exceptions[0] from None
    fetched = iter(task.result() for task in tasks)
    return [item.encode("ascii", "replace") if item.startswith("data:") else next(fetched) for item in listed]
