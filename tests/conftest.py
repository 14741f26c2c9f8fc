"""Shared fixtures of the end-to-end tests: the real server started as a subprocess, and
the reference model (sentence-transformers on the same model folder) it must agree with.

`ServerProcess` starts `python -m infinity serve` on a free port, waits for `/health`,
keeps its output in a log file (attached to the report of a failing test), and stops it
with a signal; whatever happens, it leaves no process and no `/dev/shm` segment behind.
Most tests share the session-scoped `server`; tests that need a special configuration,
or that kill processes, start their own with `start_server`.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # so `workers` / `infinity` import however pytest is run
    sys.path.insert(0, str(REPO))

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_LENGTH = 256
DIM = 384
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
SHM_DIR = Path("/dev/shm")
# Minimum cosine similarity between a served vector and the reference one.
MIN_COSINE = 0.99999

_READY_LINE = re.compile(r"\[front\] (?P<name>[\w.:-]+) ready \(pid (?P<pid>\d+)\)")
# Every server started this session, with the test that started it (None: a fixture of
# wider scope), so a failing test's report can show their logs.
_SERVERS: list[tuple[str | None, "ServerProcess"]] = []
_CURRENT_TEST: list[str | None] = [None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children."""
    children: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.update(int(p) for p in path.read_text().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    return children


def descendant_pids(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), to tell a recycled pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def shm_segments(pid: int) -> list[str]:
    """Everything under /dev/shm of the server whose front end is `pid`: its folders and
    what is in them (arenas, the lock, socket files), as paths relative to /dev/shm."""
    found = []
    for folder in SHM_DIR.glob(f"infinity-emb-{pid}-*"):
        found.append(folder.name)
        if folder.is_dir():
            found.extend(str(p.relative_to(SHM_DIR)) for p in folder.iterdir())
    return sorted(found)


def shm_arenas(pid: int) -> list[str]:
    """The result arenas of the server whose front end is `pid`."""
    return sorted(str(p.relative_to(SHM_DIR)) for p in SHM_DIR.glob(f"infinity-emb-{pid}-*/*")
                  if p.is_file() and p.name != "lock")


def remove_shm(pid: int) -> None:
    """Remove what the server whose front end is `pid` left under /dev/shm."""
    for folder in SHM_DIR.glob(f"infinity-emb-{pid}-*"):
        shutil.rmtree(folder, ignore_errors=True)


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """One `python -m infinity serve` subprocess."""

    def __init__(self, args: list[str] | tuple[str, ...] = (), *, port: int | None = None,
                 env: dict[str, str] | None = None, config: str | None = None,
                 pass_port: bool = True, host: str | None = "127.0.0.1",
                 log_dir: Path | None = None, shared: bool = False) -> None:
        self.extra_args = list(args)
        self.port = port if port is not None else free_port()
        self.pass_port = pass_port
        self.host = host
        # faulthandler: a child that crashes (SIGSEGV, SIGABRT) prints its Python stacks
        # into the log, so a failing test shows where.
        # float32 unless a test asks otherwise: the parity tests hold our vectors to float32
        # references within 1e-5, which bfloat16 is not meant to meet; on CPUs that compute
        # bfloat16 natively `dtype = "auto"` could choose it (tests/test_bfloat16.py).
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", "INFINITY_AUTO_BFLOAT16": "false", **(env or {})}
        for key in [k for k, v in self.env.items() if v is None]:
            del self.env[key]  # env={"INFINITY_PORT": None} removes a variable
        self.config_text = config
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infinity-e2e-"))
        self.log_path = self.log_dir / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.known_children: set[int] = set()
        self._child_start_times: dict[int, int | None] = {}
        self.url_prefix = ""
        self.shared = shared  # its log goes with the report of every failing test

    # --- start / stop ---------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "infinity", "serve"]
        if self.config_text is not None:
            path = self.log_dir / f"models-{self.port}.toml"
            path.write_text(self.config_text)
            cmd += ["--config", str(path)]
        if self.host is not None:
            cmd += ["--host", self.host]
        if self.pass_port:
            cmd += ["--port", str(self.port)]
        return cmd + self.extra_args

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=_stop_with_parent)
        _SERVERS.append((None if self.shared else _CURRENT_TEST[0], self))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{self.url_prefix}{path}"

    def health_status(self, timeout: float = 2.0) -> int | None:
        try:
            return requests.get(self.url("/health"), timeout=timeout).status_code
        except requests.RequestException:
            return None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        """Wait for GET /health == 200; raise (with the log) if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerFailed(f"server exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_text()}")
            if self.health_status() == 200:
                self.record_children()
                return self
            time.sleep(0.1)
        raise ServerFailed(f"server not ready within {timeout:.0f}s:\n{self.log_text()}")

    def record_children(self) -> set[int]:
        if self.proc is not None and self.proc.poll() is None:
            for pid in descendant_pids(self.pid) - self.known_children:
                self.known_children.add(pid)
                self._child_start_times[pid] = start_time(pid)
        return self.known_children

    def send_signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Send `signum`, wait for the exit; return the exit code (None: it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.record_children()
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        """Last resort: SIGKILL the server and every child it had; remove its segments."""
        if self.proc is not None:
            self.record_children()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.known_children:
            if pid_alive(pid) and start_time(pid) == self._child_start_times.get(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def cleanup(self) -> None:
        """Stop (if needed) and remove whatever the server left; never raises."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
            self.kill()
        finally:
            if self.proc is not None:
                remove_shm(self.pid)
            if hasattr(self, "_log"):
                self._log.close()

    # --- what the server said ---------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def unix_sockets(self) -> list[str]:
        """The path of each Unix socket the front end has open ("" for one without)."""
        inodes = set()
        for fd in Path(f"/proc/{self.pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        return [fields[7] if len(fields) >= 8 else ""
                for fields in (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
                if fields[6] in inodes]

    def run_dir(self) -> Path | None:
        """The folder of the server's channel sockets (found through the unix sockets
        its front end has open), or None."""
        return next((Path(path).parent for path in self.unix_sockets() if path.startswith("/")), None)

    def worker_pids(self) -> dict[str, list[int]]:
        """Child name -> pids from its 'ready' log lines, in order (restarts append)."""
        pids: dict[str, list[int]] = {}
        for match in _READY_LINE.finditer(self.log_text()):
            pids.setdefault(match["name"], []).append(int(match["pid"]))
        return pids

    def wait_for_log(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str] | None:
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []

        def seen() -> bool:
            match = regex.search(self.log_text(), start)
            if match:
                found.append(match)
            return bool(match)

        wait_until(seen, timeout, 0.1)
        return found[0] if found else None

    # --- requests -------------------------------------------------------------------------

    def post(self, path: str, json: Any = None, timeout: float = 60, **kwargs: Any) -> requests.Response:
        return requests.post(self.url(path), json=json, timeout=timeout, **kwargs)

    def get(self, path: str, timeout: float = 30, **kwargs: Any) -> requests.Response:
        return requests.get(self.url(path), timeout=timeout, **kwargs)

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until no model has inputs in flight (what earlier tests left running would
        share batches with the next request, and batch shapes move float results by an ulp)."""
        def idle() -> bool:
            models = self.get("/v1/models").json()["data"]
            return all(model["stats"]["results_pending"] == 0 for model in models)

        assert wait_until(idle, timeout, 0.1), f"the server still computes after {timeout:.0f} s"

    def embed(self, input: Any, timeout: float = 120, **fields: Any) -> requests.Response:
        return self.post("/v1/embeddings", {"model": MODEL_NAME, "input": input, **fields},
                         timeout=timeout)


def _stop_with_parent() -> None:
    """In the server before exec: SIGTERM it (a clean stop) if the test process dies, so a
    killed test run leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_server_process(*args: str, ready: bool = True, started: list[ServerProcess] | None = None,
                         **kwargs: Any) -> ServerProcess:
    """Start a server (and, if `ready`, wait for /health == 200); retry on another port if
    the chosen one was taken meanwhile. Each started server is appended to `started`."""
    for attempt in range(3):
        server = ServerProcess(args, **kwargs).start()
        if started is not None:
            started.append(server)
        if not ready:
            return server
        try:
            return server.wait_ready()
        except ServerFailed:
            text = server.log_text()
            server.cleanup()
            if "address already in use" in text.lower() and "port" not in kwargs and attempt < 2:
                continue
            raise
        except BaseException:  # e.g. the test's timeout
            server.cleanup()
            raise
    raise AssertionError("unreachable")


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The default server (packaged all-MiniLM-L6-v2, default limits) shared by the session."""
    proc = start_server_process(log_dir=tmp_path_factory.mktemp("session-server"), shared=True)
    try:
        yield proc
    finally:
        proc.cleanup()


API_KEY = "e2e-secret-key"


@pytest.fixture(scope="session")
def api_key_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """A default server started with --api-key (`.api_key` holds the key)."""
    proc = start_server_process("--api-key", API_KEY, log_dir=tmp_path_factory.mktemp("api-key-server"),
                                shared=True)
    proc.api_key = API_KEY
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scoring-models")


@pytest.fixture(scope="session")
def scoring_server(tmp_path_factory: pytest.TempPathFactory, models_root: Path) -> ServerProcess:
    """The default embedder, a tiny reranker and a tiny classifier (see
    `tests.tiny_models.scoring_models_config`) from one models.toml, shared by the rerank
    and classify tests."""
    from tests.tiny_models import scoring_models_config

    proc = start_server_process(config=scoring_models_config(models_root, MODEL_NAME),
                                log_dir=tmp_path_factory.mktemp("scoring-server"), shared=True)
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
def start_server(tmp_path: Path):
    """Factory for servers of one test: `start_server("--api-key", "k", config=..., env=...)`.
    Every server it started is stopped and cleaned up after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, **kwargs: Any) -> ServerProcess:
        kwargs.setdefault("log_dir", tmp_path)
        return start_server_process(*args, started=started, **kwargs)

    yield start
    for proc in started:
        proc.cleanup()


@pytest.fixture(scope="session")
def model_folder() -> Path:
    from infinity.folders.resolve import packaged_model_folder

    return packaged_model_folder()


@pytest.fixture(scope="session")
def reference_model(model_folder: Path):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = SentenceTransformer(str(model_folder), device="cpu")
    assert model.max_seq_length == MAX_LENGTH
    return model


@pytest.fixture(scope="session")
def reference_tokenizer(reference_model):
    return reference_model.tokenizer


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, truncation=True, max_length=MAX_LENGTH)["input_ids"])


def reference_embed(model, texts: list[str]) -> np.ndarray:
    return np.asarray(model.encode(texts, normalize_embeddings=True, batch_size=32,
                                   convert_to_numpy=True), dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_close(served: np.ndarray, reference: np.ndarray, what: str = "") -> None:
    assert served.shape == reference.shape, f"{what}: shape {served.shape} != {reference.shape}"
    sim = cosine(served, reference)
    assert sim >= MIN_COSINE, f"{what}: cosine {sim:.7f} < {MIN_COSINE}"


def decode_embedding(value: Any) -> np.ndarray:
    """An `embedding` field, float list or base64 of raw little-endian float32."""
    import base64

    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float32)
    return np.asarray(value, dtype=np.float32)


def assert_error(response: requests.Response, status: int) -> dict[str, Any]:
    """`response` is the JSON error shape with `status`; return its `error` object."""
    assert response.status_code == status, (
        f"expected {status}, got {response.status_code}: {response.text[:500]}")
    assert response.headers.get("Content-Type", "").startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


@contextlib.contextmanager
def files_site(files: list[bytes], suffix: str) -> Iterator[str]:
    """A plain HTTP server on loopback answering `/<i><suffix>` with `files[i]` (404 for
    any other path); yields its base URL."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            index = self.path.strip("/").removesuffix(suffix)
            if not index.isdigit() or int(index) >= len(files):
                self.send_error(404)
                return
            body = files[int(index)]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


def make_sentences(count: int = 240, seed: int = 1234) -> list[str]:
    """Deterministic sentences from one word to well over 256 tokens, with unicode,
    punctuation, numbers and mixed case."""
    rng = random.Random(seed)
    words = (
        "the quick brown fox jumps over lazy dog embedding server batch token vector "
        "model search query document ranking semantic similarity retrieval latency "
        "throughput process queue memory shared socket message Python Rust GPU CPU "
        "Zürich café naïve résumé façade Ångström São Paulo Kraków Straße "
        "東京 北京 数据 模型 日本語 한국어 Москва привет мир Ελλάδα γειά "
        "مرحبا שלום नमस्ते ☕ 🙂 🚀 ∑ ∞ ≈ π µs °C € £ ¥ "
        "don't it's e-mail state-of-the-art U.S.A. Dr. Mr. O'Neil "
        "42 3.14159 1,000,000 2024-06-01 12:30 -7 +15% 0xFF #hashtag @user "
        "https://example.com/path?q=1 foo_bar CamelCase ALLCAPS"
    ).split()
    punctuation = [".", ",", "!", "?", ";", ":", " -", " (see above)", "...", " —", "\"", "'"]
    fixed = [
        "hello",
        "a",
        "🙂",
        "東京",
        "42",
        "?!",
        "Hello, world!",
        "The café in Zürich serves crème brûlée for €4.50.",
        "   leading and trailing spaces   ",
        " ",  # whitespace only: just [CLS] [SEP]
        "\u00a0\u200b",  # no-break and zero-width spaces
        "ÀÉÎÕÜ àéîõü ÇçÑñ",  # accents the uncased tokenizer strips
        "\x00 control \x07 characters \x1f",
        "tabs\tand\nnewlines\r\nin one input",
        "A" * 300,
        " ".join(["word"] * 400),  # well over the 256-token limit
    ]
    out = list(fixed)
    while len(out) < count:
        bucket = rng.random()
        if bucket < 0.25:
            n = rng.randint(1, 4)
        elif bucket < 0.6:
            n = rng.randint(5, 30)
        elif bucket < 0.85:
            n = rng.randint(31, 150)
        else:
            n = rng.randint(200, 450)  # longer than max_length: truncated
        parts = []
        for _ in range(n):
            word = rng.choice(words)
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.12:
                word += rng.choice(punctuation)
            parts.append(word)
        out.append(" ".join(parts))
    return out


SENTENCES = make_sentences()


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return SENTENCES


@pytest.fixture(scope="session")
def reference_vectors(reference_model, sentences: list[str]) -> np.ndarray:
    return reference_embed(reference_model, sentences)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """However the session ends, no server outlives it."""
    for _, proc in _SERVERS:
        proc.cleanup()


# --- reporting -------------------------------------------------------------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _CURRENT_TEST[0] = item.nodeid
    try:
        yield
    finally:
        _CURRENT_TEST[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for owner, proc in _SERVERS:
        if owner is None or owner == item.nodeid:
            text = proc.log_text()
            if len(text) > 20000:
                text = "...\n" + text[-20000:]
            report.sections.append((f"server log (port {proc.port}, {' '.join(proc.command()[2:])})", text))
