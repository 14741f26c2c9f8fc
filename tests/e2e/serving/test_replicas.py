"""Replicas behind a real nginx: `python -m infinity replicas` with `config/nginx.conf`.

Under steady load, one replica's whole process group is SIGKILLed: no client request
fails (nginx resends those the dead replica held to the other), the survivor carries the
load, and the launcher restarts the killed replica, which rejoins. An overloaded
replica's 429 reaches the client with its Retry-After (not turned into a 502 or retried
away). The launcher stops cleanly on SIGTERM. nginx comes from Debian (`.ci/run`
installs it).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.answers import assert_error
from tests.support.processes import descendant_pids, pid_alive, wait_until
from tests.support.reference import MODEL_NAME
from tests.support.server import REPO, free_port, stop_with_parent
from tests.support.shm import shm_segments

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None,
                                reason="needs nginx on PATH (Debian: apt-get install nginx; .ci/run installs it)")

REPLICAS = 2
# Small queues, so that the overload test can fill one with a few requests.
MAX_QUEUED = 64
_PID_LINE = re.compile(r"replica (?P<index>\d+): pid (?P<pid>\d+), port (?P<port>\d+)")


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        first = random.randrange(20000, 60000 - count)
        try:
            sockets = []
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


class Launcher:
    """One `python -m infinity replicas` subprocess and what its log says."""

    def __init__(self, replicas: int, serve_args: list[str]) -> None:
        self.listen = free_port()
        self.first_port = _free_port_run(replicas)
        self.log_path = Path(tempfile.mkdtemp(prefix="infinity-replicas-")) / "launcher.log"
        self._log = open(self.log_path, "ab")
        command = [sys.executable, "-m", "infinity", "replicas", "--replicas", str(replicas),
                   "--listen", str(self.listen), "--first-port", str(self.first_port),
                   "--shutdown-timeout", "10", "--", *serve_args]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=stop_with_parent)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen}{path}"

    def replica_url(self, index: int, path: str) -> str:
        return f"http://127.0.0.1:{self.first_port + index}{path}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replica_pids(self, index: int) -> list[int]:
        """Every pid replica `index` has had, in start order."""
        return [int(m["pid"]) for m in _PID_LINE.finditer(self.log_text()) if int(m["index"]) == index]

    def ready(self, index: int) -> bool:
        try:
            return requests.get(self.replica_url(index, "/health"), timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def served(self, index: int) -> float:
        """Embedding requests replica `index` answered 200 (since it last started)."""
        text = requests.get(self.replica_url(index, "/metrics"), timeout=10).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "infinity_requests"
                   for sample in family.samples
                   if sample.name == "infinity_requests_total" and sample.labels.get("route") == "/v1/embeddings"
                   and sample.labels.get("status") == "200")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in descendant_pids(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def balancer():
    launcher = Launcher(REPLICAS, ["--host", "127.0.0.1", "--max-queued-items", str(MAX_QUEUED),
                                   "--max-items-per-request", str(MAX_QUEUED)])
    try:
        ok = wait_until(lambda: all(launcher.ready(i) for i in range(REPLICAS)), 180, interval=0.5)
        assert ok and launcher.proc.poll() is None, launcher.log_text()[-5000:]
        yield launcher
    finally:
        launcher.cleanup()


class Load:
    """Clients sending embedding requests through the balancer in a loop, counting the
    status codes they get."""

    def __init__(self, url: str, clients: int, inputs: int, text: str) -> None:
        self.url, self.inputs, self.text = url, inputs, text
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.retry_after: list[str | None] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, client: int) -> None:
        session = requests.Session()
        n = 0
        while not self._stop.is_set():
            body = {"model": MODEL_NAME, "input": [f"{self.text} {client} {n} {i}" for i in range(self.inputs)]}
            n += 1
            try:
                response = session.post(self.url, json=body, timeout=60)
            except requests.RequestException as exc:
                with self._lock:
                    self.failures.append(repr(exc))
                continue
            with self._lock:
                self.statuses[response.status_code] += 1
                if response.status_code == 200:
                    assert len(response.json()["data"]) == self.inputs
                elif response.status_code == 429:
                    assert_error(response, 429)
                    self.retry_after.append(response.headers.get("Retry-After"))
                else:
                    self.failures.append(f"{response.status_code}: {response.text[:300]}")

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def test_an_overloaded_replica_429_reaches_the_client(balancer):
    """Each request nearly fills a replica's queue: with more clients than replicas, some
    get 429 with Retry-After, as the replica answered it; none gets a 5xx from nginx."""
    with Load(balancer.url("/v1/embeddings"), clients=8, inputs=MAX_QUEUED // 2 + 8,
              text="a sentence long enough to keep the model busy for a while " * 4) as load:
        assert wait_until(lambda: load.statuses[429] >= 3, 60, interval=0.1), (load.statuses, load.failures)
    assert not load.failures, load.failures[:5]
    assert set(load.statuses) <= {200, 429}, load.statuses
    assert load.statuses[200] > 0, load.statuses
    assert all(value and int(value) >= 1 for value in load.retry_after), load.retry_after


def test_killing_a_replica_under_load_fails_no_request(balancer):
    victim, survivor = 0, 1
    (old_pid,) = balancer.replica_pids(victim)[-1:]
    old_group = {old_pid, *descendant_pids(old_pid)}
    assert len(old_group) >= 3, "the replica's front end, tokenizer and inference processes"
    with Load(balancer.url("/v1/embeddings"), clients=4, inputs=4, text="steady load") as load:
        assert wait_until(lambda: load.statuses[200] >= 20, 30), (load.statuses, load.failures)
        survivor_before = balancer.served(survivor)
        os.killpg(old_pid, signal.SIGKILL)
        assert wait_until(lambda: not any(pid_alive(pid) for pid in old_group), 10), "the whole group dies"
        during_outage = load.statuses[200]
        # The launcher starts it again; it loads, nginx tries it again and it takes requests.
        assert wait_until(lambda: len(balancer.replica_pids(victim)) == 2, 30), balancer.log_text()[-3000:]
        assert wait_until(lambda: balancer.ready(victim), 120, interval=0.2), balancer.log_text()[-3000:]
        assert wait_until(lambda: balancer.served(victim) >= 5, 60, interval=0.2), balancer.log_text()[-3000:]
        survivor_after = balancer.served(survivor)
    assert not load.failures, load.failures[:5]
    assert set(load.statuses) == {200}, load.statuses
    assert load.statuses[200] > during_outage, "requests went on being answered after the kill"
    assert survivor_after - survivor_before >= 20, "the survivor carried the load meanwhile"
    new_pid = balancer.replica_pids(victim)[-1]
    assert new_pid != old_pid and pid_alive(new_pid)
    # The restarted replica removed what the killed one left in /dev/shm.
    assert shm_segments(old_pid) == []
    assert "replica 0 (port" in balancer.log_text() and "exited with code -9" in balancer.log_text()


def test_through_the_balancer_health_answers_and_metrics_are_refused(balancer):
    assert requests.get(balancer.url("/health"), timeout=10).status_code == 200
    error = assert_error(requests.get(balancer.url("/metrics"), timeout=10), 404)
    assert "each replica" in error["message"]
    too_large = requests.post(balancer.url("/v1/embeddings"), data=b"x" * (17 * 1024 * 1024),
                              headers={"Content-Type": "application/json"}, timeout=60)
    assert assert_error(too_large, 413)["code"] == "request_too_large"


def test_the_launcher_stops_cleanly(balancer):
    """SIGTERM: nginx and every replica (with its children) stop, and the launcher exits 0."""
    processes = descendant_pids(balancer.proc.pid)
    assert len(processes) >= 2 * 3 + 2, "two replicas of three processes each, nginx and a worker"
    replica_fronts = [balancer.replica_pids(i)[-1] for i in range(REPLICAS)]
    balancer.proc.send_signal(signal.SIGTERM)
    assert balancer.proc.wait(60) == 0, balancer.log_text()[-3000:]
    assert wait_until(lambda: not any(pid_alive(pid) for pid in processes), 10)
    assert all(shm_segments(pid) == [] for pid in replica_fronts)
