"""Soak test with faults: the real server under a mixed load while its children are killed.

Not part of CI. It starts ``python -m infinity serve`` as a subprocess with three models,
each on two CPU replicas (``device = ["cpu:0", "cpu:1"]``) and two tokenizer processes, so
that no single dead process takes a model offline:

- the packaged default embedder ``all-MiniLM-L6-v2``;
- a tiny reranker and a tiny classifier built at start (``tests.support.tiny_models``).

Then, for ``--duration`` seconds, ``--concurrency`` closed-loop aiohttp workers send a
mix of requests, each with a client-side ``--timeout``: embeddings of one text and of
8-32 texts (``encoding_format`` float and base64, every text unique), rerank, classify,
batched embeddings whose client disconnects a few milliseconds after sending, and about
10% malformed requests, which must be answered with a 4xx JSON error
``{"error": {"message", "type", "param", "code"}}``.

The first ``--warmup`` seconds are a warm-up without faults; the load then pauses and the
baseline is measured on the idle server: resident memory (VmRSS) of the front end and of
each child by name, the front end's open file descriptors, and its ``/dev/shm``
entries. For the rest of the run, every ``--kill-every`` seconds one random child
(tokenizer or inference process; never the front end) gets SIGKILL, once every child is
ready; the server restarts it by itself.

What is checked:

- every answered embedding has the right count, dimension and unit norm; a sample (every
  ``--sample-every``-th embeddings request, all rows) is compared, after the server has
  stopped, with sentence-transformers on the same model folder (cosine >= 0.9999);
- every rerank and classify answer has the right number of finite scores, and a
  (query, document) pair or an input always gets the score it got first (within 1e-5);
- after the load: the server is whole again (``/health`` 200, every child ready), then,
  idle, memory, descriptors and ``/dev/shm`` entries are measured again; each model's
  slot pool must be whole (a request that needs every slot is answered 200);
- SIGTERM: the server exits 0 within 30 s and leaves no ``/dev/shm`` entry and no child.

The summary counts requests by kind and outcome (200, 4xx by status, 503 by error code,
other 5xx, connection error, client timeout; deliberate disconnects on their own), hangs,
wrong vectors and scores, kills (with how long each child took to come back), memory,
descriptors, ``/dev/shm`` entries, the exit, and the server log's unexpected errors.
The exit status is 0 only if every check passed.

Usage (from the repository root):
    .venv/bin/python -m bench.soak --duration 600 --json bench/out/soak.json
    .venv/bin/python -m bench.soak --duration 90 --kill-every 20   # a short trial
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from workers.inference.corpus import sentences
from tests.support.answers import decode_embedding
from tests.support.processes import descendant_pids, pid_alive, start_time, wait_until
from tests.support.reference import DIM, MODEL_NAME, reference_embed
from tests.support.server import ServerProcess, start_server_process
from tests.support.shm import shm_segments
from tests.support.tiny_models import (CLASSIFIER_LABELS, CLASSIFIER_NAME, RERANKER_NAME, SCORING_MAX_LENGTH,
                                       save_tiny_classifier, save_tiny_cross_encoder, scoring_text)

FRONT = "front"
REPLICA_DEVICES = '["cpu:0", "cpu:1"]'
TOKENIZER_WORKERS = 2
# Each model's slot pool (max_queued_items); at the end one request of this many inputs
# must be admitted, which it is only if no slot leaked.
POOL_SLOTS = 1024
MIN_COSINE = 0.9999
SCORE_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-3
MAX_FRONT_RSS_GROWTH_PCT = 5.0
IDLE_BEFORE_MEASURE_S = 5.0
RECOVERY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
MAX_EXAMPLES = 10
# Share of each request kind in the mix (embeddings kinds are split by encoding format).
KIND_WEIGHTS = {
    "embed_single": 0.22,
    "embed_batch": 0.23,
    "rerank": 0.175,
    "classify": 0.175,
    "disconnect": 0.10,
    "malformed": 0.10,
}
# The server's expected log line when a killed child is noticed.
_RESTART_LINE = re.compile(r"exited with code -9; \d+ requests failed; restarting")
_LOG_PROBLEM = re.compile(r" (ERROR|CRITICAL) |Traceback|Warning: ")


# --- the server -------------------------------------------------------------------------------

def models_config(root: Path) -> str:
    """Build the tiny reranker and classifier under `root`; return the models.toml that
    serves them and the packaged embedder, each on two CPU replicas."""
    reranker = save_tiny_cross_encoder(root / "reranker")
    classifier = save_tiny_classifier(root / "classifier", model_max_length=SCORING_MAX_LENGTH)
    return f"""
[server]
tokenizer_workers = {TOKENIZER_WORKERS}
max_queued_items = {POOL_SLOTS}

[[models]]
name = "{MODEL_NAME}"
source = "default"
device = {REPLICA_DEVICES}

[[models]]
name = "{RERANKER_NAME}"
source = "{reranker}"
max_length = {SCORING_MAX_LENGTH}
device = {REPLICA_DEVICES}

[[models]]
name = "{CLASSIFIER_NAME}"
source = "{classifier}"
device = {REPLICA_DEVICES}
"""


def rss_kib(pid: int) -> int | None:
    """Resident memory of `pid` in KiB (VmRSS), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Snapshot:
    """What an idle server holds: memory per process name, the processes measured, the
    front end's descriptors and the entries under /dev/shm of this server."""

    rss_kib: dict[str, int]
    pids: dict[str, int]
    front_fds: int
    shm_entries: int


@dataclass
class Kill:
    at_s: float  # since the load started
    name: str
    pid: int
    back_after_s: float | None = None  # until its successor said it was ready


class ServerWatch:
    """The server's children by name (from its `[front] <name> ready (pid N)` log lines;
    restarts append) and every process it ever had, to find leftovers after it exits."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen: set[tuple[int, int | None]] = set()  # (pid, start time)
        self.kills: list[Kill] = []
        self.load_started = time.monotonic()

    def newest_pids(self) -> dict[str, int]:
        return {name: pids[-1] for name, pids in self.server.worker_pids().items()}

    def observe(self) -> None:
        """Remember the current descendants; note when killed children came back."""
        for pid in descendant_pids(self.server.pid):
            self.seen.add((pid, start_time(pid)))
        newest = self.newest_pids()
        for kill in self.kills:
            if kill.back_after_s is None and newest.get(kill.name) != kill.pid:
                kill.back_after_s = round(time.monotonic() - self.load_started - kill.at_s, 1)

    def whole(self) -> bool:
        """/health is 200 and every child's newest incarnation is alive."""
        self.observe()
        return (self.server.health_status() == 200
                and all(pid_alive(pid) for pid in self.newest_pids().values()))

    def kill_random_child(self, rng: random.Random) -> Kill | None:
        children = {name: pid for name, pid in self.newest_pids().items()
                    if pid_alive(pid) and pid in descendant_pids(self.server.pid)}
        if not children:
            return None
        name = rng.choice(sorted(children))
        os.kill(children[name], signal.SIGKILL)
        kill = Kill(round(time.monotonic() - self.load_started, 1), name, children[name])
        self.kills.append(kill)
        return kill

    def snapshot(self) -> Snapshot:
        pids = {FRONT: self.server.pid, **self.newest_pids()}
        rss = {name: rss_kib(pid) for name, pid in pids.items()}
        return Snapshot({name: kib for name, kib in rss.items() if kib is not None}, pids,
                        fd_count(self.server.pid), len(shm_segments(self.server.pid)))

    def leftover_children(self) -> list[int]:
        return sorted(pid for pid, started in self.seen if pid_alive(pid) and start_time(pid) == started)

    def log_problems(self) -> list[str]:
        """Error and warning lines and tracebacks of the log, but for the expected notes of
        killed children."""
        return [line for line in self.server.log_text().splitlines()
                if _LOG_PROBLEM.search(line) and not _RESTART_LINE.search(line)]


# --- requests -------------------------------------------------------------------------------

class WrongAnswer(Exception):
    """A 200 answer whose content is wrong: `count` wrong vectors or scores."""

    def __init__(self, message: str, count: int = 1) -> None:
        super().__init__(message)
        self.count = count


@dataclass
class PlannedRequest:
    kind: str
    method: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    # Raises WrongAnswer unless the decoded 200 answer is right; None: a malformed request.
    check: Callable[[Any], None] | None = None
    # Disconnects only: the client aborts the connection this long after sending.
    abort_after_s: float | None = None
    # Malformed requests only: the client mistake it makes.
    mistake: str | None = None


def _json_body(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def malformed_requests() -> list[PlannedRequest]:
    """Client mistakes, each of which must get a 4xx JSON error."""
    def mistake(what: str, path: str, body: Any, method: str = "POST",
                content_type: str | None = "application/json") -> PlannedRequest:
        raw = body if isinstance(body, bytes) else _json_body(body)
        return PlannedRequest("malformed", method, path, raw, content_type, mistake=what)

    embeddings, rerank, classify = "/v1/embeddings", "/v1/rerank", "/v1/classify"
    return [
        mistake("truncated JSON", embeddings, b'{"model": "' + MODEL_NAME.encode() + b'", "input": '),
        mistake("not JSON", embeddings, b"this is not json"),
        mistake("input of wrong type", embeddings, {"model": MODEL_NAME, "input": 42}),
        mistake("empty input", embeddings, {"model": MODEL_NAME, "input": []}),
        mistake("missing input", embeddings, {"model": MODEL_NAME}),
        mistake("unknown model", embeddings, {"model": "no-such-model", "input": "hello"}),
        mistake("unknown encoding_format", embeddings, {"model": MODEL_NAME, "input": "hi", "encoding_format": "hex"}),
        mistake("dimensions -1", embeddings, {"model": MODEL_NAME, "input": "hello", "dimensions": -1}),
        mistake("token id out of vocabulary", embeddings, {"model": MODEL_NAME, "input": [[999_999_999]]}),
        mistake("embedder on the rerank route", rerank, {"model": MODEL_NAME, "query": "q", "documents": ["d"]}),
        mistake("rerank without documents", rerank, {"model": RERANKER_NAME, "query": "q", "documents": []}),
        mistake("rerank documents of wrong type", rerank, {"model": RERANKER_NAME, "query": "q", "documents": 5}),
        mistake("classify input of wrong type", classify, {"model": CLASSIFIER_NAME, "input": {"a": 1}}),
        mistake("unknown route", "/v1/no-such-route", {"model": MODEL_NAME, "input": "hello"}),
        mistake("wrong method", embeddings, b"", method="GET", content_type=None),
        mistake("form body", embeddings, b"input=hello", content_type="application/x-www-form-urlencoded"),
    ]


class RequestMix:
    """Draws the next request of the mix and checks its answer.

    Embeddings texts are corpus sentences prefixed by a counter, so no two requests share
    a text. Rerank and classify draw from small pools, so the same pair or input comes
    back often and must get the same score each time."""

    def __init__(self, seed: int, sample_every: int) -> None:
        self._rng = random.Random(seed)
        self._texts = sentences(4000, seed)
        self._counter = itertools.count()
        self._embeddings_requests = itertools.count()
        self._sample_every = sample_every
        self._queries = [scoring_text(self._rng, self._rng.randint(2, 5)) for _ in range(12)]
        self._documents = [scoring_text(self._rng, self._rng.randint(3, 30)) for _ in range(120)]
        self._classify_inputs = [scoring_text(self._rng, self._rng.randint(1, 40)) for _ in range(150)]
        self._malformed = malformed_requests()
        self._kinds = list(KIND_WEIGHTS)
        self._weights = list(KIND_WEIGHTS.values())
        self.rerank_scores: dict[tuple[str, str], float] = {}
        self.classify_scores: dict[tuple[str, str], float] = {}
        # (texts, served vectors) of the sampled embeddings requests.
        self.samples: list[tuple[list[str], np.ndarray]] = []

    def next(self) -> PlannedRequest:
        kind = self._rng.choices(self._kinds, self._weights)[0]
        if kind == "embed_single":
            return self.embeddings(1)
        if kind == "embed_batch":
            return self.embeddings(self._rng.randint(8, 32))
        if kind == "disconnect":
            return PlannedRequest("disconnect", "POST", "/v1/embeddings", _json_body(
                {"model": MODEL_NAME, "input": self.unique_texts(self._rng.randint(16, 32))}),
                abort_after_s=self._rng.uniform(0.002, 0.020))
        if kind == "malformed":
            return self._rng.choice(self._malformed)
        return self.rerank() if kind == "rerank" else self.classify()

    def unique_texts(self, count: int) -> list[str]:
        return [f"{next(self._counter)}: {self._rng.choice(self._texts)}" for _ in range(count)]

    def embeddings(self, count: int) -> PlannedRequest:
        texts = self.unique_texts(count)
        encoding_format = self._rng.choice(("float", "base64"))
        sampled = next(self._embeddings_requests) % self._sample_every == 0

        def check(payload: Any) -> None:
            data = payload.get("data") if isinstance(payload, dict) else None
            if not isinstance(data, list) or len(data) != count:
                raise WrongAnswer(f"expected {count} embeddings, got {payload!r:.200}", count)
            if [item.get("index") for item in data] != list(range(count)):
                raise WrongAnswer(f"indices {[item.get('index') for item in data]}", count)
            vectors = np.stack([decode_embedding(item["embedding"]) for item in data])
            if vectors.shape != (count, DIM):
                raise WrongAnswer(f"shape {vectors.shape}", count)
            norms = np.linalg.norm(vectors, axis=1)
            bad = ~np.isfinite(norms) | (np.abs(norms - 1.0) > NORM_TOLERANCE)
            if bad.any():
                raise WrongAnswer(f"norms {norms[bad][:5].tolist()} for {texts[int(np.argmax(bad))]!r:.80}",
                                  int(bad.sum()))
            if sampled:
                self.samples.append((texts, vectors))

        return PlannedRequest(f"embed_{'single' if count == 1 else 'batch'}_{encoding_format}", "POST",
                              "/v1/embeddings", _json_body({"model": MODEL_NAME, "input": texts,
                                                            "encoding_format": encoding_format}), check=check)

    def rerank(self) -> PlannedRequest:
        query = self._rng.choice(self._queries)
        documents = self._rng.sample(self._documents, self._rng.randint(2, 16))

        def check(payload: Any) -> None:
            results = payload.get("results") if isinstance(payload, dict) else None
            if not isinstance(results, list) or len(results) != len(documents):
                raise WrongAnswer(f"expected {len(documents)} results, got {payload!r:.200}", len(documents))
            if sorted(r.get("index") for r in results) != list(range(len(documents))):
                raise WrongAnswer(f"indices {[r.get('index') for r in results]}", len(documents))
            scores = [r.get("relevance_score") for r in results]
            if scores != sorted(scores, reverse=True):
                raise WrongAnswer(f"results not sorted by score: {scores}", len(documents))
            wrong = [f"{documents[r['index']]!r:.60}: {r['relevance_score']} (first {known})"
                     for r in results
                     if (known := _first_score(self.rerank_scores, (query, documents[r["index"]]),
                                               r["relevance_score"])) is not None]
            if wrong:
                raise WrongAnswer(f"query {query!r}: " + "; ".join(wrong[:3]), len(wrong))

        return PlannedRequest("rerank", "POST", "/v1/rerank", _json_body(
            {"model": RERANKER_NAME, "query": query, "documents": documents}), check=check)

    def classify(self) -> PlannedRequest:
        inputs = self._rng.sample(self._classify_inputs, self._rng.randint(1, 8))

        def check(payload: Any) -> None:
            data = payload.get("data") if isinstance(payload, dict) else None
            if not isinstance(data, list) or len(data) != len(inputs):
                raise WrongAnswer(f"expected {len(inputs)} rows, got {payload!r:.200}", len(inputs))
            wrong = []
            for text, row in zip(inputs, data, strict=True):
                labels = {entry.get("label"): entry.get("score") for entry in row}
                if set(labels) != set(CLASSIFIER_LABELS) or abs(sum(_finite(s) for s in labels.values()) - 1) > 1e-4:
                    wrong.append(f"{text!r:.60}: {row}")
                    continue
                wrong += [f"{text!r:.60} {label}: {score} (first {known})" for label, score in labels.items()
                          if (known := _first_score(self.classify_scores, (text, label), score)) is not None]
            if wrong:
                raise WrongAnswer("; ".join(wrong[:3]), len(wrong))

        return PlannedRequest("classify", "POST", "/v1/classify", _json_body(
            {"model": CLASSIFIER_NAME, "input": inputs}), check=check)


def _finite(score: Any) -> float:
    if not isinstance(score, (int, float)) or not math.isfinite(score):
        raise WrongAnswer(f"score {score!r} is not a finite number")
    return float(score)


def _first_score(book: dict[tuple[str, str], float], key: tuple[str, str], score: Any) -> float | None:
    """Remember the first score of `key`; return it if `score` differs from it, else None."""
    known = book.setdefault(key, _finite(score))
    return known if abs(_finite(score) - known) > SCORE_TOLERANCE else None


# --- the load -------------------------------------------------------------------------------

@dataclass
class LoadStats:
    """Outcomes per request kind, wrong answers, and examples of every kind of failure."""

    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    wrong_vectors: int = 0
    wrong_scores: int = 0
    bad_error_bodies: int = 0  # error answers without the JSON error shape
    malformed_not_4xx_json: int = 0
    valid_4xx: int = 0
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    started: float = field(default_factory=time.monotonic)

    def note(self, category: str, request: PlannedRequest, **details: Any) -> None:
        if len(self.examples[category]) < MAX_EXAMPLES:
            self.examples[category].append({"at_s": round(time.monotonic() - self.started, 1),
                                            "kind": request.kind, "mistake": request.mistake,
                                            "method": request.method,
                                            "path": request.path, "body": request.body[:160].decode(errors="replace"),
                                            **details})

    def count(self, outcome: str) -> int:
        return sum(outcomes[outcome] for outcomes in self.outcomes.values())


def error_object(raw: bytes, content_type: str) -> dict[str, Any] | None:
    """The `error` object of a JSON error answer, or None if the answer lacks the shape."""
    if content_type != "application/json":
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
        return None
    return error


async def send(session: aiohttp.ClientSession, base_url: str, request: PlannedRequest, stats: LoadStats) -> bool:
    """Send `request`, record its outcome; return True if it was answered 200."""
    kind = request.kind
    headers = {"Content-Type": request.content_type} if request.content_type else None
    try:
        async with session.request(request.method, base_url + request.path, data=request.body or None,
                                   headers=headers) as response:
            raw = await response.read()
    except TimeoutError:
        stats.outcomes[kind]["timeout"] += 1
        stats.note("hang", request)
        return False
    except aiohttp.ClientError as exc:
        stats.outcomes[kind]["connection_error"] += 1
        stats.note("connection_error", request, error=f"{type(exc).__name__}: {exc}")
        return False
    status = response.status
    if status == 200:
        stats.outcomes[kind]["200"] += 1
        if request.check is None:
            stats.malformed_not_4xx_json += 1
            stats.note("malformed_not_4xx_json", request, status=status, answer=raw[:300].decode(errors="replace"))
            return True
        try:
            request.check(json.loads(raw))
        except (WrongAnswer, ValueError, KeyError, TypeError, AttributeError) as exc:
            count = exc.count if isinstance(exc, WrongAnswer) else 1
            if kind.startswith("embed"):
                stats.wrong_vectors += count
            else:
                stats.wrong_scores += count
            stats.note("wrong_answer", request, problem=f"{type(exc).__name__}: {exc}")
        return True
    error = error_object(raw, response.content_type)
    stats.outcomes[kind][f"503:{error['code']}" if status == 503 and error else str(status)] += 1
    answer = {"status": status, "answer": raw[:300].decode(errors="replace")}
    if error is None:
        stats.bad_error_bodies += 1
        stats.note("bad_error_body", request, **answer)
    if kind == "malformed":
        if error is None or not 400 <= status < 500:
            stats.malformed_not_4xx_json += 1
            stats.note("malformed_not_4xx_json", request, **answer)
    elif 400 <= status < 500:
        stats.valid_4xx += 1
        stats.note("valid_request_4xx", request, **answer)
    elif status >= 500 and status != 503:
        stats.note("server_error", request, **answer)
    return False


async def send_and_disconnect(host: str, port: int, request: PlannedRequest, timeout: float) -> str:
    """Send `request` on a fresh connection and abort the connection after its
    `abort_after_s`; return the outcome (normally "aborted": no answer had begun)."""
    head = (f"{request.method} {request.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(request.body)}\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except TimeoutError:
        return "timeout"
    except OSError:
        return "connection_error"
    try:
        writer.write(head + request.body)
        await asyncio.wait_for(writer.drain(), timeout)
        first_byte = await asyncio.wait_for(reader.read(1), request.abort_after_s)
        return "answered_before_abort" if first_byte else "closed_by_server"
    except TimeoutError:
        return "aborted"
    except OSError:
        return "connection_error"
    finally:
        writer.transport.abort()


@dataclass(frozen=True)
class LoadShape:
    host: str
    port: int
    concurrency: int
    timeout: float


async def worker(session: aiohttp.ClientSession, shape: LoadShape, mix: RequestMix, stats: LoadStats,
                 stop_at: float, abort: asyncio.Event) -> None:
    """Send requests of the mix back to back until `stop_at` (loop time) or `abort`."""
    loop = asyncio.get_running_loop()
    base_url = f"http://{shape.host}:{shape.port}"
    while loop.time() < stop_at and not abort.is_set():
        request = mix.next()
        if request.abort_after_s is not None:
            outcome = await send_and_disconnect(shape.host, shape.port, request, shape.timeout)
            stats.outcomes["disconnect"][outcome] += 1
            if outcome == "timeout":
                stats.note("hang", request)
            continue
        if not await send(session, base_url, request, stats) and request.kind != "malformed":
            await asyncio.sleep(0.05)  # do not spin on a server that refuses


async def kill_children(watch: ServerWatch, every_s: float, rng: random.Random, stop_at: float,
                        abort: asyncio.Event) -> None:
    """Every `every_s` seconds, once the server is whole, SIGKILL one random child; stop
    the load (`abort`) if the server itself exits."""
    loop = asyncio.get_running_loop()
    next_kill = loop.time() + every_s
    while loop.time() < stop_at:
        await asyncio.sleep(0.5)
        if watch.server.proc is not None and watch.server.proc.poll() is not None:
            abort.set()
            return
        if loop.time() >= next_kill and await asyncio.to_thread(watch.whole):
            kill = watch.kill_random_child(rng)
            if kill is not None:
                print(f"  {kill.at_s:7.1f}s  SIGKILL {kill.name} (pid {kill.pid})", flush=True)
            next_kill = loop.time() + every_s
        else:
            await asyncio.to_thread(watch.observe)


async def run_load(shape: LoadShape, mix: RequestMix, stats: LoadStats, seconds: float,
                   watch: ServerWatch, kill_every_s: float | None, rng: random.Random) -> float:
    """`shape.concurrency` workers for `seconds`; with `kill_every_s`, children are killed.
    Return how long the load ran (in-flight requests finish after `seconds`)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop_at = loop.time() + seconds
    abort = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=shape.concurrency)
    timeout = aiohttp.ClientTimeout(total=shape.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [worker(session, shape, mix, stats, stop_at, abort) for _ in range(shape.concurrency)]
        if kill_every_s is not None:
            tasks.append(kill_children(watch, kill_every_s, rng, stop_at, abort))
        await asyncio.gather(*tasks)
    return loop.time() - started


# --- the checks after the load ---------------------------------------------------------------

def slot_pools_whole(server: ServerProcess) -> dict[str, int]:
    """One request of POOL_SLOTS inputs per model: the HTTP status of each (200 only if
    none of the model's slots leaked)."""
    inputs = [f"pool check {i}" for i in range(POOL_SLOTS)]
    bodies = {
        MODEL_NAME: ("/v1/embeddings", {"model": MODEL_NAME, "input": inputs}),
        RERANKER_NAME: ("/v1/rerank", {"model": RERANKER_NAME, "query": "pool", "documents": inputs}),
        CLASSIFIER_NAME: ("/v1/classify", {"model": CLASSIFIER_NAME, "input": inputs}),
    }
    return {name: server.post(path, body, timeout=120).status_code for name, (path, body) in bodies.items()}


@dataclass
class ReferenceCheck:
    vectors: int
    wrong: int
    worst_cosine: float | None
    examples: list[dict[str, Any]]


def compare_with_reference(samples: list[tuple[list[str], np.ndarray]]) -> ReferenceCheck:
    """Sampled served vectors against sentence-transformers on the same model folder."""
    if not samples:
        return ReferenceCheck(0, 0, None, [])
    from sentence_transformers import SentenceTransformer

    from infinity.folders.resolve import packaged_model_folder

    model = SentenceTransformer(str(packaged_model_folder()), device="cpu")
    texts = [text for batch, _ in samples for text in batch]
    served = np.concatenate([vectors for _, vectors in samples]).astype(np.float64)
    reference = reference_embed(model, texts).astype(np.float64)
    cosines = (served * reference).sum(axis=1) / (np.linalg.norm(served, axis=1) * np.linalg.norm(reference, axis=1))
    wrong = np.flatnonzero(~(cosines >= MIN_COSINE))
    examples = [{"text": texts[i][:120], "cosine": float(cosines[i])} for i in wrong[:MAX_EXAMPLES]]
    return ReferenceCheck(len(texts), len(wrong), float(np.nanmin(cosines)), examples)


@dataclass
class ServerExit:
    code: int | None  # None: it did not exit within STOP_TIMEOUT_S and was killed
    seconds: float
    shm_left: list[str]
    children_left: list[int]


def stop_server(watch: ServerWatch) -> ServerExit:
    """SIGTERM the server; how it exited and what it left behind."""
    watch.observe()
    started = time.monotonic()
    code = watch.server.stop(signal.SIGTERM, STOP_TIMEOUT_S)
    seconds = round(time.monotonic() - started, 1)
    wait_until(lambda: not watch.leftover_children(), 2.0)  # children die with the front end
    return ServerExit(code, seconds, shm_segments(watch.server.pid), watch.leftover_children())


# --- report -----------------------------------------------------------------------------------

def memory_table(baseline: Snapshot, end: Snapshot, kills: list[Kill]) -> dict[str, dict[str, Any]]:
    restarts = Counter(kill.name for kill in kills)
    table = {}
    for name in sorted(set(baseline.rss_kib) | set(end.rss_kib), key=lambda n: (n != FRONT, n)):
        before, after = baseline.rss_kib.get(name), end.rss_kib.get(name)
        growth = round(100.0 * (after - before) / before, 2) if before and after is not None else None
        table[name] = {"warmup_kib": before, "end_kib": after, "growth_pct": growth, "restarts": restarts[name],
                       "pid_warmup": baseline.pids.get(name), "pid_end": end.pids.get(name)}
    return table


def verdict(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each pass/fail check of the run, with the numbers behind it."""
    front_growth = report["memory"].get(FRONT, {}).get("growth_pct")
    server_exit = report["server_exit"]
    totals = report["totals"]
    other_5xx = sum(n for outcome, n in totals.items() if outcome.isdigit() and int(outcome) >= 500)
    checks = [
        ("no hangs", report["hangs"] == 0, f"{report['hangs']} requests timed out"),
        ("no wrong vectors", report["wrong_vectors"] == 0,
         f"{report['wrong_vectors']} wrong ({report['reference']['vectors']} checked against the reference)"),
        ("no wrong scores", report["wrong_scores"] == 0, f"{report['wrong_scores']} wrong"),
        ("no 5xx but 503", other_5xx == 0, f"{other_5xx} other 5xx"),
        ("every malformed request got a 4xx JSON error", report["malformed_not_4xx_json"] == 0,
         f"{report['malformed_not_4xx_json']} did not"),
        ("every error answer has the JSON error shape", report["bad_error_bodies"] == 0,
         f"{report['bad_error_bodies']} did not"),
        ("no 4xx for a valid request", report["valid_4xx"] == 0, f"{report['valid_4xx']} 4xx"),
        ("server whole again after the load", report["recovered"], "health 200, every child ready"),
        (f"front-end RSS growth < {MAX_FRONT_RSS_GROWTH_PCT:g}%",
         front_growth is not None and front_growth < MAX_FRONT_RSS_GROWTH_PCT, f"{front_growth}%"),
        ("front-end fds back to start", report["front_fds"]["start"] == report["front_fds"]["end"],
         f"{report['front_fds']['start']} -> {report['front_fds']['end']}"),
        ("/dev/shm entries back to start", report["shm_entries"]["start"] == report["shm_entries"]["end"],
         f"{report['shm_entries']['start']} -> {report['shm_entries']['end']}"),
        ("slot pools whole", all(status == 200 for status in report["slot_pools"].values()),
         str(report["slot_pools"])),
        ("clean exit", server_exit["code"] == 0 and not server_exit["shm_left"] and not server_exit["children_left"],
         (f"exit code {server_exit['code']} after {server_exit['seconds']}s, "
          f"/dev/shm left {server_exit['shm_left']}, children left {server_exit['children_left']}")),
    ]
    return [{"check": name, "passed": bool(passed), "detail": detail} for name, passed, detail in checks]


def print_summary(report: dict[str, Any]) -> None:
    outcomes = sorted(report["totals"], key=lambda o: (o != "200", o))
    kinds = sorted(report["requests"])
    width = max(len(kind) for kind in kinds + ["total"]) + 2
    columns = [max(len(outcome), 5) + 2 for outcome in outcomes]

    def row(label: str, counts: dict[str, int]) -> str:
        return f"{label:<{width}}" + "".join(f"{counts.get(o, 0):>{w}}" for o, w in zip(outcomes, columns, strict=True))

    print(f"\n== requests ({report['requests_per_s']:.1f}/s over {report['load_s']:.0f}s), by kind and outcome")
    print(" " * width + "".join(f"{o:>{w}}" for o, w in zip(outcomes, columns, strict=True)))
    for kind in kinds:
        print(row(kind, report["requests"][kind]))
    print(row("total", report["totals"]))
    print(f"\nhangs {report['hangs']}, wrong vectors {report['wrong_vectors']} "
          f"({report['reference']['vectors']} vectors checked against the reference, worst cosine "
          f"{report['reference']['worst_cosine']}), wrong scores {report['wrong_scores']}")
    print(f"\n== kills ({len(report['kills'])})")
    for kill in report["kills"]:
        print(f"  {kill['at_s']:7.1f}s  {kill['name']:<18} pid {kill['pid']:<8} back after {kill['back_after_s']}s")
    print("\n== memory (VmRSS, KiB; warm-up -> end)")
    for name, row in report["memory"].items():
        print(f"  {name:<18} {row['warmup_kib']!s:>9} -> {row['end_kib']!s:>9}  {row['growth_pct']!s:>6}%"
              f"  restarts {row['restarts']}")
    print(f"front-end fds {report['front_fds']['start']} -> {report['front_fds']['end']}, "
          f"/dev/shm entries {report['shm_entries']['start']} -> {report['shm_entries']['end']}, "
          f"slot pools {report['slot_pools']}")
    print(f"server exit: {report['server_exit']}")
    for category, examples in report["examples"].items():
        print(f"\n== examples: {category}")
        for example in examples:
            print(f"  {example}")
    if report["server_log_problems"]:
        print(f"\n== server log: {len(report['server_log_problems'])} unexpected error lines (first 20)")
        for line in report["server_log_problems"][:20]:
            print(f"  {line[:300]}")
    print(f"\nserver log: {report['server_log']}")
    print("\n== verdict")
    for check in report["checks"]:
        print(f"  {'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}")
    print("PASSED" if report["passed"] else "FAILED")


# --- the run ----------------------------------------------------------------------------------

def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run warm-up and soak, check and stop it; return the report."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="infinity-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"building tiny models and starting the server (files in {workdir})", flush=True)
    server = start_server_process(config=models_config(workdir / "models"), log_dir=workdir)
    watch = ServerWatch(server)
    rng = random.Random(args.seed)
    mix = RequestMix(args.seed, args.sample_every)
    stats = LoadStats()
    shape = LoadShape("127.0.0.1", server.port, args.concurrency, args.timeout)
    try:
        print(f"server ready on port {server.port}, children {watch.newest_pids()}; "
              f"warm-up {args.warmup:g}s", flush=True)
        watch.load_started = stats.started = time.monotonic()
        load_s = asyncio.run(run_load(shape, mix, stats, args.warmup, watch, None, rng))
        time.sleep(IDLE_BEFORE_MEASURE_S)
        baseline = watch.snapshot()
        print(f"baseline: RSS {baseline.rss_kib}, front-end fds {baseline.front_fds}, "
              f"/dev/shm entries {baseline.shm_entries}", flush=True)
        soak_s = args.duration - args.warmup
        print(f"soak {soak_s:g}s, a child killed every {args.kill_every:g}s", flush=True)
        load_s += asyncio.run(run_load(shape, mix, stats, soak_s, watch, args.kill_every, rng))
        print("load done; waiting for every child to be ready", flush=True)
        recovered = wait_until(watch.whole, RECOVERY_TIMEOUT_S, 0.5)
        time.sleep(IDLE_BEFORE_MEASURE_S)
        watch.observe()
        end = watch.snapshot()
        slot_pools = slot_pools_whole(server) if recovered else {}
        server_exit = stop_server(watch)
        log_problems = watch.log_problems()
    finally:
        for pid in watch.leftover_children():
            os.kill(pid, signal.SIGKILL)
        server.cleanup()
    print(f"computing reference vectors for {sum(len(t) for t, _ in mix.samples)} sampled texts", flush=True)
    reference = compare_with_reference(mix.samples)
    totals: Counter[str] = Counter()
    for outcomes in stats.outcomes.values():
        totals.update(outcomes)
    examples = dict(stats.examples)
    if reference.examples:
        examples["wrong_vector_against_reference"] = reference.examples
    report: dict[str, Any] = {
        "config": {key: value for key, value in vars(args).items() if key != "json"},
        "load_s": round(load_s, 1),
        "requests_per_s": round(sum(totals.values()) / load_s, 1),
        "requests": {kind: dict(outcomes) for kind, outcomes in sorted(stats.outcomes.items())},
        "totals": dict(totals),
        "hangs": stats.count("timeout"),
        "wrong_vectors": stats.wrong_vectors + reference.wrong,
        "reference": {"vectors": reference.vectors, "wrong": reference.wrong,
                      "worst_cosine": reference.worst_cosine},
        "wrong_scores": stats.wrong_scores,
        "malformed_not_4xx_json": stats.malformed_not_4xx_json,
        "bad_error_bodies": stats.bad_error_bodies,
        "valid_4xx": stats.valid_4xx,
        "kills": [asdict(kill) for kill in watch.kills],
        "recovered": recovered,
        "memory": memory_table(baseline, end, watch.kills),
        "front_fds": {"start": baseline.front_fds, "end": end.front_fds},
        "shm_entries": {"start": baseline.shm_entries, "end": end.shm_entries},
        "slot_pools": slot_pools,
        "server_exit": asdict(server_exit),
        "examples": examples,
        "server_log_problems": log_problems,
        "server_log": str(server.log_path),
    }
    report["checks"] = verdict(report)
    report["passed"] = all(check["passed"] for check in report["checks"])
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of load, warm-up included (default 600)")
    parser.add_argument("--warmup", type=float, default=20.0,
                        help="seconds of load without kills before the baseline is measured (default 20)")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills (default 30)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request limit, seconds (default 30)")
    parser.add_argument("--sample-every", type=int, default=10,
                        help="compare every Nth embeddings request with the reference (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="folder for the tiny models, models.toml and the server log "
                                          "(default: a new temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    if args.warmup <= 0 or args.duration <= args.warmup or args.kill_every <= 0 or args.concurrency < 1 \
            or args.timeout <= 0 or args.sample_every < 1:
        parser.error("need 0 < --warmup < --duration, --kill-every > 0, --concurrency >= 1, --timeout > 0, "
                     "--sample-every >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; the exit status is 0 only if every check passed."""
    args = parse_args(argv)
    report = soak(args)
    print_summary(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"report written to {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
