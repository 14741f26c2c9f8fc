"""The corpus job through a running server (`embed --url`): its rows go to the server's
`/v1/embeddings` at a priority below the default (1 unless told), so that one deployment
serves search and ingest and the search goes first (the server admits and batches higher
priority first, and bounds the low-priority queue on its own).

Each batch comes back as raw float32 rows (`infinity.api.binary`) where the model answers
rows of one width, as JSON for sparse and multi-vector models, with each input's tokens and
the inputs cut (`input_usage`): the parts hold what a local run writes. A status that says
the server is busy or away (429, 503, a refused connection) is waited out; one that says
the job is wrong (401, 403, 404) stops it (`ServerRefused`); any other is the batch's,
tried again row by row. `ServerAnswerer` sends an OpenAI batch file's bodies the same way."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np

from infinity.api.binary import CONTENT_TYPE, read_embeddings
from infinity.api.errors import APIError, error_body
from infinity.client.engine_client import ServingError
from infinity.config import MediaConfig
from infinity.corpus.encoder import (READY_TIMEOUT_S, TRANSIENT, VECTOR_SETTINGS, Batch, Encoder, ModelUnavailable,
                                    Serving)
from infinity.shared.kinds import KINDS, KindSpec
from infinity.shared.protocol import ErrorKind

DEFAULT_PRIORITY = 1  # below a query's default 0
# An answer this much slower than the fastest means the job's batches queue in the server:
# one waiting there past the scheduler's AGING_S (5 s) rises to the queries' class and
# beyond, and they wait behind it (bench/results/priority.md).
TARGET_WAIT_S = 2.0
_POLL_S = 0.5  # between looks at a server that is away
_BUSY_S = 1.0  # after a 429 or 503 (the server's Retry-After)


class ServerRefused(Exception):
    """The server refuses the job itself (a wrong key, a model it does not serve)."""


class ServerClient:
    """HTTP to one server: its base URL and API key, one connection pool."""

    def __init__(self, url: str, api_key: str | None) -> None:
        # An OpenAI client's base URL ends in /v1; the routes are found below the server's own.
        self.url = url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No read limit: a low-priority batch waits in the server's queue while queries go first.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, body: bytes | None = None,
                      accept: str = "application/json") -> tuple[int, str, bytes]:
        """(status, content type, body) of one request; a server that cannot be reached is a
        `ServingError` of kind not_ready (waited out like a 503)."""
        headers = {**self._headers, "Accept": accept}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._open().request(method, self.url + path, data=body, headers=headers) as answer:
                return answer.status, answer.content_type, await answer.read()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise ServingError(ErrorKind.NOT_READY, f"cannot reach {self.url}: {exc or type(exc).__name__}") from None

    async def get_json(self, path: str) -> Any:
        status, _, body = await self.request("GET", path)
        if status != 200:
            raise_for(status, body)
        return msgspec.json.decode(body)


def _error_of(status: int, body: bytes) -> tuple[str, str | None]:
    """The message and code of an error answer (the server's JSON error, else its text)."""
    try:
        error = msgspec.json.decode(body).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        error = {}
    message = str(error.get("message") or body[:200].decode("utf-8", "replace") or f"HTTP {status}")
    return message, error.get("code")


def raise_for(status: int, body: bytes) -> None:
    """Raise what a status other than 200 means to the job: `ServerRefused` where the job
    itself is wrong, else the `ServingError` of the kind the server answered."""
    message, code = _error_of(status, body)
    if status in (401, 403, 404, 405):
        raise ServerRefused(f"the server answered {status}: {message}")
    if status in (429, 503):
        try:
            kind = ErrorKind(code)
        except ValueError:
            kind = ErrorKind.OVERLOADED if status == 429 else ErrorKind.NOT_READY
        raise ServingError(ErrorKind.NOT_READY if kind == ErrorKind.SHUTTING_DOWN else kind, message)
    raise ServingError(ErrorKind.INVALID_INPUT if 400 <= status < 500 else ErrorKind.INTERNAL, message)


async def model_card(server: ServerClient, wanted: str | None, done: Callable[[dict[str, Any]], bool],
                     what: str) -> dict[str, Any]:
    """The card (`/v1/models`) of the model `wanted` (None: the server's only one) once
    `done(card)`, waiting while the server is away or busy (`what` it has not yet done)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    while True:
        try:
            cards = (await server.get_json("/v1/models"))["data"]
            card = _named(server, cards, wanted)
            if done(card):
                return card
            reason = f"the server has not yet {what}"
        except ServingError as exc:
            reason = exc.message
        if loop.time() > deadline:
            raise ModelUnavailable(f"{reason} after {READY_TIMEOUT_S:g} s")
        await asyncio.sleep(_POLL_S)


# What a card of a server of this version holds that the job reads (`digest` came with
# `input_usage`): another server, or an older one, is refused before any row is sent.
_CARD_KEYS = {"id", "kind", "capabilities", "ready", "backend", "dtype", "dimensions", "digest", *VECTOR_SETTINGS}


def _named(server: ServerClient, cards: list[dict[str, Any]], wanted: str | None) -> dict[str, Any]:
    missing = sorted({key for card in cards for key in _CARD_KEYS - set(card)})
    if missing:
        raise ServerRefused(f"{server.url}/v1/models lacks {', '.join(missing)}: it is not an infinity server of this "
                            "version (upgrade it, or run the job here without --url)")
    names = [card["id"] for card in cards]
    if wanted is None and len(cards) != 1:
        raise ServerRefused(f"{server.url} serves {len(cards)} models ({', '.join(names)}): name one with --model")
    card = cards[0] if wanted is None else next((c for c in cards if c["id"] == wanted), None)
    if card is None:
        raise ServerRefused(f"{server.url} does not serve a model '{wanted}'; it serves {', '.join(names)}")
    return card


class InFlight:
    """How many batches a job keeps in the server at once, as TCP Vegas's window: one
    more per window of answers that come back within `TARGET_WAIT_S` of the fastest (the
    pass alone, as near as the job sees it), half as many after one that waited longer or
    was refused as busy. Alone the server is kept fed (a deeper queue answers slower but
    no faster); beside queries the job backs off before its requests age past them."""

    def __init__(self, first: float = 2.0, most: int = 16, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = first
        self._most = most
        self._clock = clock
        self._running = 0
        self._fastest = float("inf")
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one batch's place while it is in the server."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._running < int(self.size))
            self._running += 1
        started = self._clock()
        congested: bool | None = None  # None: the answer says nothing of the load (a bad input)
        try:
            yield
            seconds = self._clock() - started
            self._fastest = min(self._fastest, seconds)
            congested = seconds - self._fastest > TARGET_WAIT_S
        except ServingError as exc:
            congested = True if exc.kind in TRANSIENT else None
            raise
        finally:
            async with self._changed:
                self._running -= 1
                if congested is not None:
                    self.size = (max(1.0, self.size / 2) if congested
                                 else min(float(self._most), self.size + 1 / self.size))
                self._changed.notify_all()


class ServerEncoder(Encoder):
    """The model `model` (None: the server's only one) of the server at `url`, sent
    batches at `priority`."""

    def __init__(self, url: str, model: str | None, api_key: str | None, priority: int = DEFAULT_PRIORITY,
                 media: MediaConfig | None = None) -> None:
        super().__init__(media or MediaConfig())
        self._server = ServerClient(url, api_key)
        self._wanted = model
        self._priority = priority
        self._card: dict[str, Any] | None = None
        self._in_flight = InFlight()

    @property
    def kind(self) -> KindSpec:
        assert self._card is not None, "identity() first"
        return KINDS[self._card["kind"]]

    async def identity(self) -> dict[str, Any]:
        card = await model_card(self._server, self._wanted, lambda card: card["digest"] is not None,
                                "hashed its model folder")
        self._card = card
        return {"name": card["id"], "kind": card["kind"], "digest": card["digest"],
                **{setting: card[setting] for setting in VECTOR_SETTINGS}}

    @property
    def serving(self) -> Serving:
        assert self._card is not None and self._card["dimensions"] is not None, "start() first"
        return Serving(self._card["backend"], self._card["dtype"], self._card["dimensions"])

    async def start(self) -> None:
        self._card = await model_card(self._server, self._wanted, lambda card: card["ready"], "loaded the model")

    async def stop(self) -> None:
        await super().stop()
        await self._server.close()

    async def _once(self, inputs: list[str | bytes], medium: str) -> Batch:
        kind = self.kind
        body: dict[str, Any] = {"model": self._card["id"], "priority": self._priority,  # type: ignore[index]
                                "input_usage": True, "input": [_as_input(item, medium) for item in inputs]}
        if medium != "text":
            body["modality"] = medium
        rows_of_one_width = not kind.ragged or bool(kind.vector_types)
        if rows_of_one_width:
            body["encoding_format"] = "bytes"
        async with self._in_flight.slot():
            status, content_type, answer = await self._server.request(
                "POST", "/v1/embeddings", msgspec.json.encode(body), CONTENT_TYPE if rows_of_one_width else
                "application/json")
            if status != 200:
                raise_for(status, answer)
        if content_type == CONTENT_TYPE:
            vectors, header = read_embeddings(answer)
            outputs, usage = list(vectors), header["usage"]
        else:
            decoded = msgspec.json.decode(answer)
            outputs = [_output(item, kind) for item in decoded["data"]]
            usage = decoded["usage"]
        return Batch(outputs, usage["input_tokens"], set(usage["truncated_indices"]))

    async def _ready(self) -> None:
        await asyncio.sleep(_BUSY_S)


def _as_input(item: str | bytes, medium: str) -> str:
    """An input as `/v1/embeddings` takes it: a text, or a medium's bytes as a data: URI
    (one given as a data: URI already, as it was)."""
    if isinstance(item, str):
        return item
    if item.startswith(b"data:"):
        return item.decode("ascii", "replace")
    return f"data:{medium}/octet-stream;base64,{base64.b64encode(item).decode('ascii')}"


_SPARSE = np.dtype([("index", "<i4"), ("value", "<f4")])


def _output(item: dict[str, Any], kind: KindSpec) -> np.ndarray:
    """One JSON answer's output as a local run holds it: a sparse model's records of
    `index` and `value`, a multi-vector model's matrix."""
    embedding = item["embedding"]
    if kind.sparse:
        entries = np.empty(len(embedding["indices"]), _SPARSE)
        entries["index"], entries["value"] = embedding["indices"], embedding["values"]
        return entries
    return np.asarray(embedding, np.float32).reshape(item["shape"])


class ServerAnswerer:
    """Answers an OpenAI batch file's bodies (`infinity.corpus.batch_file`) by sending each
    to the server's `/v1/embeddings` at `priority` (where the body names none), for the
    model `model` (where it names none); a busy or restarting server is waited out."""

    def __init__(self, server: ServerClient, model: str, priority: int = DEFAULT_PRIORITY) -> None:
        self._server, self._model, self._priority = server, model, priority

    async def answer(self, body: msgspec.Raw) -> tuple[int, bytes]:
        """The status and JSON body the server gives for `body`."""
        try:
            members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError):
            sent = bytes(body)  # the server says what is wrong with it
        else:
            members.setdefault("priority", msgspec.Raw(str(self._priority).encode()))
            members.setdefault("model", msgspec.Raw(msgspec.json.encode(self._model)))
            sent = msgspec.json.encode(members)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        crashed = False
        while True:
            try:
                status, content_type, answer = await self._server.request("POST", "/v1/embeddings", sent)
            except ServingError as exc:  # the server cannot be reached
                if loop.time() > deadline:
                    raise ModelUnavailable(f"{exc.message} for {READY_TIMEOUT_S:g} s") from None
                await asyncio.sleep(_POLL_S)
                continue
            if status in (401, 403):
                raise_for(status, answer)
            died = _error_of(status, answer)[1] == ErrorKind.WORKER_DIED.value
            # An inference process that died under it, once more: was it this body, or another?
            busy = status == 429 or (status == 503 and not (died and crashed))
            if status == 200 and content_type != "application/json":
                return 422, error_body(APIError(422, "encoding_format \"bytes\" is an HTTP answer of its own; in a "
                                                     "batch file, use \"float\" or \"base64\"",
                                                param="encoding_format"))
            if not busy or loop.time() > deadline:
                return status, answer
            crashed |= died
            await asyncio.sleep(_BUSY_S)
