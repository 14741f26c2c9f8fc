"""The real server as the end-to-end tests run it: `python -m infinity serve` started as a
subprocess on a free port, waited for until `/health` answers 200, its output kept in a
log file, stopped with a signal; whatever happens, it leaves no process and no `/dev/shm`
segment behind.

Every server started is registered with the test that started it (or with none: a
fixture of wider scope), so the hooks in tests/conftest.py can attach the logs to a
failing test's report and clean up every server when the session ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from tests.support.processes import descendant_pids, pid_alive, start_time, wait_until
from tests.support.reference import MODEL_NAME
from tests.support.shm import remove_shm

REPO = Path(__file__).resolve().parents[2]
API_KEY = "e2e-secret-key"  # the key of the session's `api_key_server`
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# How much of a server's log a failing test's report shows (its end).
REPORT_LOG_CHARS = 20000

_READY_LINE = re.compile(r"\[front\] (?P<name>[\w.:-]+) ready \(pid (?P<pid>\d+)\)")
# Every server started this session, with the test that started it (None: a fixture of
# wider scope), so a failing test's report can show their logs.
_SERVERS: list[tuple[str | None, "ServerProcess"]] = []
_CURRENT_TEST: list[str | None] = [None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        # bfloat16 natively `dtype = "auto"` could choose it (tests/e2e/engines/test_bfloat16.py).
        # Models prepared before the server is ready unless a test asks otherwise: a test's
        # requests all meet the engine it expects, never one handed over mid-test
        # (tests/e2e/engines/test_converted_engines.py serves one in the background).
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", "INFINITY_AUTO_BFLOAT16": "false",
                    "INFINITY_PREPARE": "before_serving", **(env or {})}
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
                                     preexec_fn=stop_with_parent)
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


def stop_with_parent() -> None:
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


@contextlib.contextmanager
def running_server(*args: str, **kwargs: Any) -> Iterator[ServerProcess]:
    """`start_server_process` for a fixture of module or session scope: the server,
    cleaned up when the block ends."""
    proc = start_server_process(*args, **kwargs)
    try:
        yield proc
    finally:
        proc.cleanup()


def models_toml(sources: dict[str, Any]) -> str:
    """A models.toml with one `[[models]]` table per name and source folder."""
    return "".join(f'[[models]]\nname = "{name}"\nsource = "{source}"\n' for name, source in sources.items())


# --- the registry of servers -------------------------------------------------------------------

@contextlib.contextmanager
def started_by(nodeid: str) -> Iterator[None]:
    """Servers started inside the block (by other than a shared fixture) belong to the
    test `nodeid`: their logs go with its report."""
    _CURRENT_TEST[0] = nodeid
    try:
        yield
    finally:
        _CURRENT_TEST[0] = None


def log_sections(nodeid: str) -> list[tuple[str, str]]:
    """(title, the end of the log) of each server whose log goes with the report of the
    test `nodeid`: the servers it started and the shared ones."""
    sections = []
    for owner, proc in _SERVERS:
        if owner is None or owner == nodeid:
            text = proc.log_text()
            if len(text) > REPORT_LOG_CHARS:
                text = "...\n" + text[-REPORT_LOG_CHARS:]
            sections.append((f"server log (port {proc.port}, {' '.join(proc.command()[2:])})", text))
    return sections


def clean_up_every_server() -> None:
    """Stop every server started this session and remove what it left."""
    for _, proc in _SERVERS:
        proc.cleanup()
