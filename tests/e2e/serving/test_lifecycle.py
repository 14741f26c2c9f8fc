"""End to end: the server's processes start, stop and crash as the design says: a clean
stop on SIGTERM/SIGINT leaves no process and no shared-memory segment; /health is 503
until the models are loaded; a child killed with -9 fails exactly the requests it held
with a 503 (no hang), is restarted, and the server serves again."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from infinity.client.engine_client import INLINE_IDLE_MAX_CHARS
from tests.support.answers import assert_error, decode_embedding
from tests.support.processes import pid_alive, wait_until
from tests.support.reference import MODEL_NAME, assert_close
from tests.support.server import running_server
from tests.support.shm import SHM_DIR, shm_arenas, shm_segments

pytestmark = pytest.mark.timeout(400)

# A clean stop takes about a second; the bound leaves room for a busy 2-core machine and
# stays below the front end's 10 s grace before it kills a child that does not stop.
STOP_WITHIN_S = 8.0
# A request held by a killed child must be answered within this.
FAIL_WITHIN_S = 10.0
_CRASH_MARKERS = ("Assertion failed", "Fatal Python error", "Traceback", "Segmentation fault")


def crash_output(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(marker in line for marker in _CRASH_MARKERS)]


def assert_clean_exit(server, signum: int) -> None:
    """Stop `server` with `signum`; it exits 0 quickly, its children are gone, its
    segments removed, and nothing crashed on the way."""
    pid = server.pid
    children = server.record_children()
    assert len(children) >= 2, f"expected a tokenizer and an inference child, found {children}"
    names = {Path(f"/proc/{child}/comm").read_text().strip() for child in children if pid_alive(child)}
    assert {name.split("-")[0] for name in names} >= {"tokenizer", "inference"}, f"children named {names}"
    assert shm_arenas(pid), "a running server has its arena in /dev/shm"
    run_dir = server.run_dir()
    assert run_dir is not None and run_dir.is_dir(), "the front end's ipc sockets live in a folder"
    start = time.monotonic()
    server.send_signal(signum)
    try:
        code = server.proc.wait(STOP_WITHIN_S + 30)
    except Exception:
        pytest.fail(f"server did not exit within {STOP_WITHIN_S + 30:.0f}s of {signum!r}")
    took = time.monotonic() - start
    assert code == 0, f"exit code {code} after {signal.Signals(signum).name}"
    assert took < STOP_WITHIN_S, f"took {took:.1f}s to stop"
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 3), (
        f"children left running: {[c for c in children if pid_alive(c)]}")
    assert shm_segments(pid) == [], f"segments left in {SHM_DIR}: {shm_segments(pid)}"
    assert not run_dir.exists(), f"ipc folder {run_dir} left behind"
    crashed = crash_output(server.log_text())
    assert not crashed, f"crash output during a clean stop: {crashed}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_clean_stop(start_server, signum, sentences, reference_vectors):
    server = start_server()
    response = server.embed(sentences[:8])
    assert response.status_code == 200
    assert_close(decode_embedding(response.json()["data"][0]["embedding"]), reference_vectors[0])
    assert_clean_exit(server, signum)


def test_health_is_503_until_models_are_loaded(start_server):
    """Poll from the moment the process starts: the first answer of /health is a 503 JSON
    error (the inference child takes seconds to load), then 200."""
    server = start_server(ready=False)
    first = None
    deadline = time.monotonic() + 120
    while first is None and time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log_text()
        try:
            first = requests.get(server.url("/health"), timeout=5)
        except requests.ConnectionError:
            time.sleep(0.01)
    assert first is not None, "the server never answered"
    error = assert_error(first, 503)
    assert first.headers.get("Retry-After")
    assert error["message"]
    # The liveness probe answers 200 all along: a slow load is no reason to restart.
    assert requests.get(server.url("/live"), timeout=5).status_code == 200
    # While loading, an embeddings request is refused the same way (not a hang, not a 5xx crash).
    early = requests.post(server.url("/v1/embeddings"), json={"model": MODEL_NAME, "input": ["early"]},
                          timeout=30)
    if early.status_code != 200:  # it may have finished loading meanwhile
        assert_error(early, 503)
    server.wait_ready()
    assert server.embed(["ready now"]).status_code == 200


def test_stop_while_loading_leaves_nothing(start_server):
    server = start_server(ready=False)
    assert wait_until(lambda: server.health_status(timeout=1) is not None, 60), server.log_text()
    time.sleep(0.5)  # children are spawned and loading
    children = server.record_children()
    assert children, "children are started with the listener"
    code = server.stop(signal.SIGTERM, timeout=STOP_WITHIN_S + 30)
    assert code == 0, server.log_text()
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 3)
    assert shm_segments(server.pid) == []


def test_stop_with_requests_in_flight(start_server, sentences):
    """SIGTERM while a long request runs: the request is answered (served, or a 503 JSON
    error), the server exits 0 and leaves nothing behind."""
    server = start_server()
    texts = [sentences[i % len(sentences)] + " extra words" * 20 for i in range(256)]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(server.embed, texts)
        time.sleep(1.0)
        children = server.record_children()
        server.send_signal(signal.SIGTERM)
        response = future.result(timeout=60)
        code = server.proc.wait(60)
    assert response.status_code in (200, 503), response.text[:300]
    if response.status_code == 503:
        assert_error(response, 503)
    else:
        assert len(response.json()["data"]) == len(texts)
    assert code == 0
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 3)
    assert shm_segments(server.pid) == []
    assert not crash_output(server.log_text())


def test_a_stopping_server_finishes_what_it_holds_and_refuses_new_work(start_server, sentences):
    """SIGTERM: /health and new requests get 503 at once (a balancer moves on), the
    request held is answered whole, then the server exits 0."""
    server = start_server()
    texts = [sentences[i % len(sentences)] + " extra words" * 20 for i in range(256)]
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(server.embed, texts)
        time.sleep(1.0)
        server.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert not held.done(), "the held request should outlast the checks below"
        assert assert_error(requests.get(server.url("/health"), timeout=10), 503)["code"] == "shutting_down"
        assert requests.get(server.url("/live"), timeout=10).status_code == 200
        refused = server.embed(["a new request"])
        assert assert_error(refused, 503)["code"] == "shutting_down"
        response = held.result(timeout=60)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["data"]) == len(texts)
    assert server.proc.wait(60) == 0
    assert "stopping: 1 requests held" in server.log_text()


# --- crashes of one child ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def crash_server(tmp_path_factory):
    # A cache of its own: the inference process converts the model at its first start, as
    # on a fresh machine (the converter's progress bars once left a semaphore behind).
    cache = tmp_path_factory.mktemp("crash-server-cache")
    with running_server(log_dir=tmp_path_factory.mktemp("crash-server"), shared=True,
                        env={"INFINITY_CACHE_DIR": str(cache)}) as proc:
        yield proc


def _kill_child_under_load(server, child: str, make_inputs, count: int, kill_after_s: float,
                           freeze: bool = False):
    """Send `count` concurrent requests, SIGKILL the child `child` after `kill_after_s`
    (with `freeze`, stopped with SIGSTOP before the requests, so they wait in it);
    return (killed pid, [(response or exception, seconds after the kill)])."""
    pids = server.worker_pids()[child]
    victim = pids[-1]
    assert pid_alive(victim), f"{child} pid {victim} from the log is not running"
    assert victim in server.record_children()
    if freeze:
        os.kill(victim, signal.SIGSTOP)
    killed_at: list[float] = []
    barrier = threading.Barrier(count + 1)

    def one(i: int):
        barrier.wait()
        try:
            response = requests.post(server.url("/v1/embeddings"),
                                     json={"model": MODEL_NAME, "input": make_inputs(i)}, timeout=120)
        except requests.RequestException as exc:
            response = exc
        return response, time.monotonic()

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        barrier.wait()
        time.sleep(kill_after_s)
        for future in futures:
            assert not future.done(), (f"a request finished before the kill: {future.result()[0]!r}; "
                                       "the test needs slower requests")
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)
        results = [future.result(timeout=150) for future in futures]
    return victim, [(response, end - killed_at[0]) for response, end in results]


def _check_recovery(server, child: str, victim: int, log_mark: int, sentences, reference_vectors,
                    channels: list[str]) -> None:
    """`channels`: the front end's Unix sockets (its ZeroMQ ipc connections among them) before the kill; the
    restart leaves as many."""
    # Right after the crash the server says it is not ready (the restart takes seconds).
    health = requests.get(server.url("/health"), timeout=10)
    assert_error(health, 503)
    # It restarts the child and serves again.
    assert server.wait_for_log(rf"{re.escape(child)} ready \(pid (?!{victim}\b)\d+\)", 120, log_mark), (
        f"{child} was not restarted:\n{server.log_text()[log_mark:]}")
    server.wait_ready(120)
    new_pid = server.worker_pids()[child][-1]
    assert new_pid != victim and pid_alive(new_pid)
    assert not pid_alive(victim)
    assert new_pid in server.record_children()
    response = server.embed(sentences[:16])
    assert response.status_code == 200, response.text
    for i, item in enumerate(response.json()["data"]):
        assert_close(decode_embedding(item["embedding"]), reference_vectors[i], f"input {i} after restart")
    # The dead child's channel was closed: as many channel sockets as before.
    assert len(server.unix_sockets()) == len(channels), (channels, server.unix_sockets())
    # One arena per model, the restarted child's; the dead one's was removed.
    assert len(shm_arenas(server.pid)) == 1, shm_arenas(server.pid)
    # The restart shows in the metrics.
    from prometheus_client.parser import text_string_to_metric_families

    exposition = requests.get(server.url("/metrics"), timeout=10).text
    restarts = {sample.labels["child"]: sample.value for family in text_string_to_metric_families(exposition)
                for sample in family.samples if sample.name == "infinity_child_restarts_total"}
    assert restarts[child] >= 1, restarts


def _assert_failed_quickly(results) -> None:
    for response, after in results:
        assert isinstance(response, requests.Response), f"no HTTP answer: {response!r}"
        assert response.status_code == 503, f"{response.status_code}: {response.text[:300]}"
        error = assert_error(response, 503)
        assert error["message"]
        assert response.headers.get("Retry-After")
        assert after < FAIL_WITHIN_S, f"answered {after:.1f}s after the kill"


def test_small_requests_are_tokenized_in_the_front_end(crash_server, sentences, reference_vectors):
    """With the only tokenizer process stopped (SIGSTOP), a one-text request of a few words
    is still answered: the front end tokenizes it. Texts beyond what the front end
    tokenizes even when idle (all the sentences: over 100,000 characters) wait for the
    tokenizer."""
    server = crash_server
    tokenizer = server.worker_pids()["tokenizer-0"][-1]
    assert sum(map(len, sentences)) > INLINE_IDLE_MAX_CHARS
    with ThreadPoolExecutor(1) as pool:
        os.kill(tokenizer, signal.SIGSTOP)
        try:
            waiting = pool.submit(server.embed, sentences)
            small = server.embed(sentences[3], timeout=20)
            assert small.status_code == 200, small.text
            assert_close(decode_embedding(small.json()["data"][0]["embedding"]), reference_vectors[3], "small")
            tokens = server.embed([[101, 7592, 102]], timeout=20)  # one token-id sequence: also inline
            assert tokens.status_code == 200 and tokens.json()["usage"]["prompt_tokens"] == 3
            assert not waiting.done()
        finally:
            os.kill(tokenizer, signal.SIGCONT)
        response = waiting.result(timeout=60)
    assert response.status_code == 200, response.text
    for i, item in enumerate(response.json()["data"]):
        assert_close(decode_embedding(item["embedding"]), reference_vectors[i], f"input {i}")


def test_kill_inference_child(crash_server, sentences, reference_vectors):
    server = crash_server
    mark = len(server.log_text())
    long_texts = [s + " padding words to make it long" * 12 for s in sentences]

    def inputs(i: int) -> list[str]:  # 128 inputs near max_length: seconds of compute each
        return [long_texts[(i * 128 + j) % len(long_texts)] for j in range(128)]

    channels = server.unix_sockets()
    victim, results = _kill_child_under_load(server, "inference-cpu", inputs, count=4, kill_after_s=1.5)
    _assert_failed_quickly(results)
    _check_recovery(server, "inference-cpu", victim, mark, sentences, reference_vectors, channels)


def test_kill_tokenizer_child(crash_server, sentences, reference_vectors):
    server = crash_server
    assert len(server.worker_pids()) >= 2
    mark = len(server.log_text())
    # Tokenizing is quick (a long input is read only up to what the model uses), so the
    # tokenizer is stopped first: the requests wait in it, then it is killed. Each request
    # holds more text than the front end tokenizes itself, even with nothing in flight.

    def inputs(i: int) -> list[str]:
        return [f"{i} {sentences[i]}", "word " * INLINE_IDLE_MAX_CHARS]

    channels = server.unix_sockets()
    victim, results = _kill_child_under_load(server, "tokenizer-0", inputs, count=3, kill_after_s=1.0,
                                             freeze=True)
    _assert_failed_quickly(results)
    _check_recovery(server, "tokenizer-0", victim, mark, sentences, reference_vectors, channels)


def test_crashed_children_leave_nothing_after_stop(crash_server):
    """After the crashes above, a clean stop still leaves no process and no segment."""
    children = crash_server.record_children()
    code = crash_server.stop(signal.SIGTERM)
    assert code == 0
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 3)
    assert shm_segments(crash_server.pid) == []
    # A killed child leaves no named semaphore for multiprocessing's tracker to find.
    assert "leaked semaphore" not in crash_server.log_text()
    assert "exited with code None" not in crash_server.log_text()


def test_kill_front_end_children_follow_and_next_start_cleans_up(start_server):
    """kill -9 of the front end: its children die with it, and the next server removes the
    segments it could not."""
    server = start_server()
    assert server.embed(["before the crash"]).status_code == 200
    children = server.record_children()
    segments = shm_segments(server.pid)
    assert segments
    run_dir = server.run_dir()
    server.proc.kill()
    server.proc.wait(10)
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 10), (
        f"children outlived their front end: {[c for c in children if pid_alive(c)]}")
    assert all((SHM_DIR / name).exists() for name in segments)  # nobody could remove them yet
    second = start_server()
    assert second.embed(["after the crash"]).status_code == 200
    assert not any((SHM_DIR / name).exists() for name in segments), "stale segments not removed at start"
    assert run_dir is not None and not run_dir.exists(), f"stale ipc folder {run_dir} not removed at start"
