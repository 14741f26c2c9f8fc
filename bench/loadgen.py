"""Closed-loop load generator for an OpenAI-style ``POST /v1/embeddings`` server.

``--concurrency`` workers each send requests back to back over keep-alive
connections. Every request carries ``--batch`` texts taken in turn from the
deterministic corpus (``workers.inference.corpus``), so no text repeats until the corpus is
used up and a server-side cache cannot inflate the numbers.

The run is bounded in time: ``--warmup`` seconds whose requests are discarded,
then ``--duration`` measured seconds; after that no new request starts and the
ones in flight get at most ``--timeout`` seconds. Throughput counts the requests
that completed inside the measured window; latency is measured from sending the
request to having parsed and checked the whole response. A response counts as
an error unless it is HTTP 200 with one embedding per input text, all of the
same non-zero dimension.

Only loopback URLs are accepted.

``closed_loop`` is the same loop for any JSON route and request shape
(``bench.rerank`` drives ``/v1/rerank`` with it).

Usage:
    python -m bench.loadgen --url http://127.0.0.1:7997 --concurrency 16 --batch 1 --json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from infinity.api.binary import CONTENT_TYPE, read_embeddings
from workers.inference.corpus import sentences

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class LoadConfig:
    """One load shape against one server."""

    url: str = "http://127.0.0.1:7997"
    model: str = DEFAULT_MODEL
    concurrency: int = 1
    batch: int = 1
    duration: float = 20.0
    warmup: float = 3.0
    encoding_format: str = "float"
    corpus_size: int = 20_000
    seed: int = 0
    timeout: float = 60.0


@dataclass(frozen=True)
class LoadResult:
    """Measured outcome of one load run (latencies in milliseconds)."""

    concurrency: int
    batch: int
    encoding_format: str
    duration_s: float
    requests: int
    sentences: int
    errors: int
    requests_per_s: float
    sentences_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    first_error: str | None


def check_loopback(url: str) -> str:
    """Return ``url`` without a trailing slash, or raise if it is not a loopback http URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"refusing non-loopback URL {url!r}: use http://127.0.0.1:PORT")
    return url.rstrip("/")


def _embedding_dim(item: dict[str, object], encoding_format: str) -> int:
    embedding = item["embedding"]
    if encoding_format == "base64":
        if not isinstance(embedding, str):
            raise ValueError("base64 embedding is not a string")
        return len(base64.b64decode(embedding)) // 4
    if not isinstance(embedding, list):
        raise ValueError("float embedding is not a list")
    return len(embedding)


def check_response(payload: object, expected: int, encoding_format: str) -> None:
    """Raise ``ValueError`` unless ``payload`` holds ``expected`` embeddings of one dimension
    (``bytes``: a binary answer, read whole)."""
    if isinstance(payload, bytes):
        vectors, _ = read_embeddings(payload)
        if vectors.shape[0] != expected or vectors.shape[1] == 0:
            raise ValueError(f"expected {expected} embeddings, got shape {vectors.shape}")
        return
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("response has no 'data' list")
    data = payload["data"]
    if len(data) != expected:
        raise ValueError(f"expected {expected} embeddings, got {len(data)}")
    dims = {_embedding_dim(item, encoding_format) for item in data}
    if len(dims) != 1 or 0 in dims:
        raise ValueError(f"embedding dimensions {sorted(dims)}")


class Corpus:
    """Hands out consecutive slices of the corpus, wrapping around at the end."""

    def __init__(self, texts: list[str]) -> None:
        self._texts = texts
        self._next = 0

    def take(self, count: int) -> list[str]:
        start = self._next
        self._next = (start + count) % len(self._texts)
        return [self._texts[(start + i) % len(self._texts)] for i in range(count)]


#: Builds the next request of a closed-loop worker: its JSON body, and a check that
#: raises ``ValueError`` (or ``KeyError``/``TypeError``) unless the decoded answer is right.
NextRequest = Callable[[], tuple[dict[str, object], Callable[[object], None]]]


@dataclass(frozen=True)
class Window:
    """Requests of a closed-loop run that completed inside the measured window."""

    good: int
    errors: int
    latencies_ms: np.ndarray  # of the good requests
    first_error: str | None

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.good else float("nan")

    def mean_ms(self) -> float:
        return float(self.latencies_ms.mean()) if self.good else float("nan")


async def _worker(
    session: aiohttp.ClientSession,
    endpoint: str,
    next_request: NextRequest,
    deadline: float,
    records: list[tuple[float, float, bool]],
    errors: list[str],
    think: float = 0.0,
) -> None:
    while time.perf_counter() < deadline:
        body, check = next_request()
        start = time.perf_counter()
        ok = False
        try:
            async with session.post(endpoint, json=body) as response:
                raw = await response.read()
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {raw[:200]!r}")
            check(raw if response.content_type == CONTENT_TYPE else json.loads(raw))
            ok = True
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        end = time.perf_counter()
        records.append((start, end, ok))
        if not ok:
            # Do not spin on a server that refuses connections.
            await asyncio.sleep(0.05)
        elif think:
            await asyncio.sleep(think)


async def closed_loop(
    url: str,
    route: str,
    next_request: NextRequest,
    *,
    concurrency: int,
    duration: float,
    warmup: float,
    timeout: float,
    think: float = 0.0,
) -> Window:
    """``concurrency`` workers POST ``next_request()`` bodies to ``url + route`` back to
    back (or ``think`` seconds after each answer) for ``warmup + duration`` seconds; the
    requests that complete in the last ``duration`` seconds are measured."""
    endpoint = f"{check_loopback(url)}{route}"
    records: list[tuple[float, float, bool]] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        measure_from = time.perf_counter() + warmup
        measure_to = measure_from + duration
        workers = [
            _worker(session, endpoint, next_request, measure_to, records, errors, think)
            for _ in range(concurrency)
        ]
        await asyncio.gather(*workers)
    window = [r for r in records if measure_from <= r[1] <= measure_to]
    latencies = np.array([(end - start) * 1000.0 for start, end, ok in window if ok])
    return Window(len(latencies), len(window) - len(latencies), latencies,
                  errors[0] if errors else None)  # fmt: skip


async def run_load(config: LoadConfig) -> LoadResult:
    """Run one bounded load against ``config.url`` and return its measurements."""
    url = check_loopback(config.url)
    config = LoadConfig(**{**asdict(config), "url": url})
    corpus = Corpus(sentences(config.corpus_size, config.seed))

    def check(payload: object) -> None:
        check_response(payload, config.batch, config.encoding_format)

    def next_request() -> tuple[dict[str, object], Callable[[object], None]]:
        body = {
            "model": config.model,
            "input": corpus.take(config.batch),
            "encoding_format": config.encoding_format,
        }
        return body, check

    window = await closed_loop(
        url,
        "/v1/embeddings",
        next_request,
        concurrency=config.concurrency,
        duration=config.duration,
        warmup=config.warmup,
        timeout=config.timeout,
    )
    good = window.good
    return LoadResult(
        concurrency=config.concurrency,
        batch=config.batch,
        encoding_format=config.encoding_format,
        duration_s=config.duration,
        requests=good,
        sentences=good * config.batch,
        errors=window.errors,
        requests_per_s=good / config.duration,
        sentences_per_s=good * config.batch / config.duration,
        p50_ms=window.percentile(50),
        p99_ms=window.percentile(99),
        mean_ms=window.mean_ms(),
        first_error=window.first_error,
    )


def _parse_args() -> argparse.Namespace:
    defaults = LoadConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=defaults.url, help="server base URL (loopback only)")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="texts per request")
    parser.add_argument("--duration", type=float, default=defaults.duration, help="measured s")
    parser.add_argument("--warmup", type=float, default=defaults.warmup, help="discarded s")
    parser.add_argument(
        "--encoding-format", choices=("float", "base64", "bytes"), default=defaults.encoding_format
    )
    parser.add_argument("--corpus-size", type=int, default=defaults.corpus_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout, help="per-request limit, seconds"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.concurrency < 1 or args.batch < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--concurrency and --batch must be >= 1, --duration > 0, --warmup >= 0")
    return args


def main() -> None:
    """Command-line entry point."""
    args = _parse_args()
    config = LoadConfig(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        batch=args.batch,
        duration=args.duration,
        warmup=args.warmup,
        encoding_format=args.encoding_format,
        corpus_size=args.corpus_size,
        seed=args.seed,
        timeout=args.timeout,
    )
    result = asyncio.run(run_load(config))
    if args.json:
        print(json.dumps(asdict(result)))
        return
    print(
        f"concurrency={result.concurrency} batch={result.batch} "
        f"format={result.encoding_format} duration={result.duration_s:g}s\n"
        f"  requests/s  {result.requests_per_s:10.1f}\n"
        f"  sentences/s {result.sentences_per_s:10.1f}\n"
        f"  p50         {result.p50_ms:10.1f} ms\n"
        f"  p99         {result.p99_ms:10.1f} ms\n"
        f"  errors      {result.errors:10d}"
    )
    if result.first_error:
        print(f"  first error: {result.first_error}")


if __name__ == "__main__":
    main()
