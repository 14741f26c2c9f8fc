"""OpenAI batch files for the corpus job: `python -m infinity embed batch.jsonl out.jsonl`
where each line of the input is a batch request (`custom_id`, `method`, `url`, `body`)
for `/v1/embeddings`. Owns telling such a file from a corpus, reading its lines, answering
each body as the server's `/v1/embeddings` route does (`infinity.api.embedding`, the
route's own decoding and error bodies) or, with `embed --url`, sending it to a running
server's (`infinity.corpus.remote.ServerAnswerer`), and writing OpenAI's batch output file:
one line per input line, in input order, written to a temporary file and renamed at the
end.

A body is answered whole or fails whole, as an HTTP request would (its status code and
the server's error body in `response`); a line that is no request at all (not JSON, no
`custom_id`, another method or URL, a repeated `custom_id`) gets `error` instead. There
is no resume: a batch file is run again from its first line."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from tqdm import tqdm

from infinity.api.decode import decode_body
from infinity.api.embedding import Embedder
from infinity.api.errors import APIError, error_body, from_kind
from infinity.api.media_fetch import MediaFetcher
from infinity.api.types.embeddings import EmbeddingRequest, EmbeddingResponse
from infinity.client.engine_client import EngineClient, ServingError, at_priority
from infinity.client.topology import ServedModel
from infinity.config import Config
from infinity.corpus.encoder import TRANSIENT
from infinity.corpus.remote import ServerAnswerer, ServerClient, model_card
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ErrorKind, ModelSpec

log = logging.getLogger(__name__)

URLS = ("/v1/embeddings", "/embeddings")
IN_FLIGHT = 16  # requests run at once
_WINDOW = 4 * IN_FLIGHT  # requests begun but not yet written: a slow one holds back the file's order only so far
_TRANSIENT_TRIES = 50


class BatchFileError(Exception):
    """The batch file cannot be run as asked (a model that does not embed, an OUTPUT that is a folder)."""


def is_batch_file(path: str) -> bool:
    """Whether `path` is an OpenAI batch input file: a `.jsonl` file whose first non-blank
    line is an object with `custom_id` and `body`."""
    if not path.endswith(".jsonl") or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
    try:
        members = msgspec.json.decode(first, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return "custom_id" in members and "body" in members


class _Response(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class _LineError(msgspec.Struct):
    code: str
    message: str


class OutputLine(msgspec.Struct):
    """One line of OpenAI's batch output file."""

    id: str
    custom_id: str | None
    response: _Response | None
    error: _LineError | None


@dataclass
class BatchSummary:
    requests: int = 0
    failed: int = 0  # an error status or an invalid line
    seconds: float = 0.0
    output: str = ""

    def __str__(self) -> str:
        rate = self.requests / self.seconds if self.seconds else 0.0
        return (f"answered {self.requests - self.failed} of {self.requests} batch requests ({self.failed} failed) "
                f"in {self.seconds:.1f} s: {rate:.1f} requests/s; written to {self.output}")


def parse_line(line: bytes, seen: set[str]) -> tuple[str | None, msgspec.Raw | _LineError]:
    """A line's `custom_id` (None where it has none) and its body, or why the line is no
    request; `seen`: the custom_ids so far, this line's added."""
    try:
        members = msgspec.json.decode(line, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        return None, _LineError("invalid_request", "the line is not a JSON object")
    except msgspec.DecodeError as exc:
        return None, _LineError("invalid_json", f"the line is not valid JSON: {exc}")
    custom_id = _decoded(members.get("custom_id"))
    if not isinstance(custom_id, str) or not custom_id:
        return None, _LineError("invalid_request", "custom_id must be a non-empty string")
    if custom_id in seen:
        return custom_id, _LineError("duplicate_custom_id", f"custom_id '{custom_id}' names an earlier line too")
    seen.add(custom_id)
    method, url = _decoded(members.get("method")), _decoded(members.get("url"))
    if method != "POST":
        return custom_id, _LineError("invalid_method", f"method must be POST, not {method!r}")
    if url not in URLS:
        return custom_id, _LineError("invalid_url", f"url must be {' or '.join(URLS)}, not {url!r}")
    if "body" not in members:
        return custom_id, _LineError("invalid_request", "body is required")
    return custom_id, members["body"]


def _decoded(raw: msgspec.Raw | None) -> object:
    return None if raw is None else msgspec.json.decode(raw)


class Answerer:
    """Answers batch bodies on one served model as `/v1/embeddings` does (`Embedder`)."""

    def __init__(self, client: EngineClient, model: ServedModel, config: Config, fetcher: MediaFetcher) -> None:
        server = config.server
        self._model = model
        self._unknown_fields = server.unknown_fields
        self._embedder = Embedder(client, fetcher, config, min(server.max_items_per_request, server.max_queued_items))

    async def answer(self, body: msgspec.Raw) -> tuple[int, bytes]:
        """The status and JSON body the route gives for `body`."""
        try:
            request = decode_body(bytes(body), EmbeddingRequest, unknown_fields=self._unknown_fields)
            name = self._model.spec.name
            if request.model is not None and request.model != name:
                raise APIError(404, f"model '{request.model}' is not served here; served models: {name}",
                               param="model", code="model_not_found")
            # A line's priority orders it among the file's others, as it would among a server's requests.
            with at_priority(0 if request.priority is msgspec.UNSET else request.priority):
                response = await self._answered(request)
        except APIError as exc:
            return exc.status, error_body(exc)
        except ServingError as exc:
            error = from_kind(exc)
            return error.status, error_body(error)
        except Exception:
            log.exception("a batch request failed")
            return 500, error_body(APIError(500, "internal server error"))
        return 200, msgspec.json.encode(response)

    async def _answered(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """The route's answer; the model full or not ready, wait and answer again: the load
        is the job's own, not the request's fault. An inference process that died under it,
        once more: was it the request, or another one of the batch running with it?"""
        crashed, attempt = False, 0
        while True:
            try:
                return await self._embedder.embeddings(self._model, request)
            except ServingError as exc:
                retry = exc.kind in TRANSIENT or (exc.kind == ErrorKind.WORKER_DIED and not crashed)
                if not retry or attempt == _TRANSIENT_TRIES - 1:
                    raise
                crashed |= exc.kind == ErrorKind.WORKER_DIED
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
                attempt += 1


def check_model(spec: ModelSpec) -> None:
    """Refuse a model `/v1/embeddings` does not serve, before it loads."""
    kind = KINDS[spec.kind]
    if "embed" not in kind.capabilities and "sparse" not in kind.capabilities:
        raise BatchFileError(f"the model is of kind '{kind.name}', which /v1/embeddings does not serve: "
                             "give an embedding model")


def run(input: str, output: str, config: Config, specs: list[ModelSpec], quiet: bool = False) -> BatchSummary:
    """Answer every line of the batch file `input` into the batch output file `output`."""
    import uvloop

    check_model(specs[0])
    return uvloop.run(_run(input, _target(output), config, specs, quiet))


def run_on_server(input: str, output: str, url: str, model: str | None, api_key: str | None, priority: int,
                  quiet: bool = False) -> BatchSummary:
    """`run`, each body sent to the server at `url` (at `priority` where it names none)."""
    import uvloop

    return uvloop.run(_run_on_server(input, _target(output), ServerClient(url, api_key), model, priority, quiet))


def _target(output: str) -> Path:
    target = Path(output)
    if target.is_dir():
        raise BatchFileError(f"{output} is a folder; a batch file's output is a file (e.g. out.jsonl)")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


async def _run_on_server(input: str, target: Path, server: ServerClient, model: str | None, priority: int,
                         quiet: bool) -> BatchSummary:
    try:
        card = await model_card(server, model, lambda card: card["ready"], "loaded the model")
        if not {"embed", "sparse"} & set(card["capabilities"]):
            raise BatchFileError(f"the model '{card['id']}' is of kind '{card['kind']}', which /v1/embeddings does "
                                 "not serve: give an embedding model")
        return await write_output(input, target, ServerAnswerer(server, card["id"], priority), quiet)
    finally:
        await server.close()


async def _run(input: str, target: Path, config: Config, specs: list[ModelSpec], quiet: bool) -> BatchSummary:
    client = EngineClient(config.server, specs, media=config.media)
    fetcher = MediaFetcher(config.media)
    await client.start()
    try:
        answerer = Answerer(client, client.models[specs[0].name], config, fetcher)
        return await write_output(input, target, answerer, quiet)
    finally:
        await fetcher.close()
        await client.stop()


async def write_output(input: str, target: Path, answerer: Answerer | ServerAnswerer,
                       quiet: bool = True) -> BatchSummary:
    """Answer the lines of `input` at most `IN_FLIGHT` at once and write them, in order, to
    `target` (through a temporary file: a run that stops leaves no half output)."""
    summary = BatchSummary(output=str(target))
    started = time.monotonic()
    slots = asyncio.Semaphore(IN_FLIGHT)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    progress = tqdm(unit="requests", dynamic_ncols=True, disable=quiet or not sys.stderr.isatty(), file=sys.stderr)

    async def answered(custom_id: str | None, parsed: msgspec.Raw | _LineError) -> OutputLine:
        if isinstance(parsed, _LineError):
            return OutputLine(f"batch_req_{uuid.uuid4().hex}", custom_id, None, parsed)
        async with slots:
            status, body = await answerer.answer(parsed)
        return OutputLine(f"batch_req_{uuid.uuid4().hex}", custom_id,
                          _Response(status, uuid.uuid4().hex, msgspec.Raw(body)), None)

    pending: deque[asyncio.Task[OutputLine]] = deque()
    try:
        with open(temporary, "wb") as out:
            async def write_first() -> None:
                line = await pending.popleft()
                out.write(msgspec.json.encode(line) + b"\n")
                summary.requests += 1
                summary.failed += line.error is not None or line.response.status_code != 200  # type: ignore[union-attr]
                progress.update()

            for custom_id, parsed in _lines(input):
                pending.append(asyncio.create_task(answered(custom_id, parsed)))
                if len(pending) >= _WINDOW:
                    await write_first()
            while pending:
                await write_first()
        os.replace(temporary, target)
    finally:
        for task in pending:
            task.cancel()
        progress.close()
        temporary.unlink(missing_ok=True)
    summary.seconds = time.monotonic() - started
    return summary


def _lines(input: str) -> Iterator[tuple[str | None, msgspec.Raw | _LineError]]:
    """Each non-blank line of `input`, parsed."""
    seen: set[str] = set()
    with open(input, "rb") as f:
        for line in f:
            if line.strip():
                yield parse_line(line, seen)
