"""End to end: `python -m infinity serve` configured by a models.toml, INFINITY_*
environment variables and flags (flags win over the environment, the environment over the
file); bad configurations stop the process at once with a message naming the key;
url_prefix, several models, per-model max_length, and /v1/models."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.support.answers import assert_error, decode_embedding
from tests.support.processes import pid_alive, wait_until
from tests.support.reference import DIM, MAX_LENGTH, MODEL_NAME, assert_close, cosine
from tests.support.server import REPO, free_port
from tests.support.shm import remove_shm, shm_arenas, shm_segments

pytestmark = pytest.mark.timeout(300)


def _run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the CLI to its end; one that is still running after `timeout` (it accepted what
    it should have refused) is stopped with SIGTERM so that it cleans up after itself."""
    process = subprocess.Popen([sys.executable, "-m", "infinity", *args], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        remove_shm(process.pid)
        pytest.fail(f"{args} still ran after {timeout}s:\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _wait_listening(server, timeout: float = 60) -> int:
    """Wait until the server answers HTTP at all (models may still be loading)."""
    assert wait_until(lambda: server.proc.poll() is not None or server.health_status(timeout=1) is not None,
                      timeout, 0.05), f"nothing answered on port {server.port}:\n{server.log_text()}"
    assert server.proc.poll() is None, server.log_text()
    return server.health_status()


def _refused(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except requests.ConnectionError:
        return True
    return False


# --- where the port comes from --------------------------------------------------------------

@pytest.mark.parametrize("sources, expected", [
    (("file", "env", "flag"), "flag"),
    (("file", "env"), "env"),
    (("file",), "file"),
    (("env", "flag"), "flag"),
])
def test_port_precedence(start_server, sources, expected):
    ports = {"file": free_port(), "env": free_port(), "flag": free_port()}
    assert len(set(ports.values())) == 3
    args: list[str] = []
    if "flag" in sources:
        args += ["--port", str(ports["flag"])]
    config = f"[server]\nport = {ports['file']}\n" if "file" in sources else None
    env = {"INFINITY_PORT": str(ports["env"]) if "env" in sources else None}
    server = start_server(*args, config=config, env=env, port=ports[expected], pass_port=False, ready=False)
    _wait_listening(server)
    assert f"listening on 127.0.0.1:{ports[expected]}" in server.log_text()
    for source, port in ports.items():
        if source != expected:
            assert _refused(port), f"something answers on the {source} port {port}"
    assert server.stop(signal.SIGTERM) == 0


def test_env_and_flag_set_other_keys(start_server):
    """INFINITY_API_KEY beats the file's api_key; --max-items-per-request beats the env's."""
    config = '[server]\napi_key = "from-file"\nmax_items_per_request = 10\n'
    server = start_server("--max-items-per-request", "2", config=config, ready=False,
                          env={"INFINITY_API_KEY": "from-env", "INFINITY_MAX_ITEMS_PER_REQUEST": "5"})
    _wait_listening(server)
    models = server.url("/v1/models")
    assert_error(requests.get(models, headers={"Authorization": "Bearer from-file"}, timeout=10), 401)
    assert requests.get(models, headers={"Authorization": "Bearer from-env"}, timeout=10).status_code == 200
    server.wait_ready()
    response = requests.post(server.url("/v1/embeddings"), json={"input": ["a", "b", "c"]},
                             headers={"Authorization": "Bearer from-env"}, timeout=30)
    error = assert_error(response, 422)
    assert "2" in error["message"]
    response = requests.post(server.url("/v1/embeddings"), json={"input": ["a", "b"]},
                             headers={"Authorization": "Bearer from-env"}, timeout=30)
    assert response.status_code == 200, response.text


# --- bad configurations ------------------------------------------------------------------------

@pytest.mark.parametrize("toml, key", [
    ("[server]\nprot = 1\n", "prot"),
    ("[server]\nport = 0\n", "port"),
    ("[server]\nport = \"many\"\n", "port"),
    ("[server]\nmax_queued_items = 0\n", "max_queued_items"),
    ("[server]\nurl_prefix = \"embed/\"\n", "url_prefix"),
    ("[server]\nlog_level = \"loud\"\n", "log_level"),
    ("[[models]]\npooling = \"median\"\n", "pooling"),
    ("[[models]]\ncolour = \"red\"\n", "colour"),
    ("[[models]]\nmax_length = 1\n", "max_length"),
    ("[[models]]\nname = \"a\"\n[[models]]\nname = \"a\"\n", "name"),
    ("[[models]]\nsource = \"/no/such/model/folder\"\n", "/no/such/model/folder"),
    ("server = 3\n", "server"),
    ("[server\nport = 1\n", "toml"),
])
def test_bad_config_exits_at_once_naming_the_key(tmp_path, toml, key):
    path = tmp_path / "models.toml"
    path.write_text(toml)
    start = time.monotonic()
    port_flag = [] if key == "port" else ["--port", str(free_port())]  # the file's port must count
    result = _run_cli("serve", "--config", str(path), *port_flag, timeout=30)
    took = time.monotonic() - start
    assert result.returncode != 0, result
    assert key.lower() in result.stderr.lower(), f"stderr does not name {key!r}: {result.stderr!r}"
    assert "Traceback" not in result.stderr, result.stderr
    assert took < 30, f"took {took:.0f}s to refuse the configuration"


@pytest.mark.parametrize("env, key", [
    ({"INFINITY_PORT": "not-a-number"}, "port"),
    ({"INFINITY_MAX_REQUEST_BYTES": "-5"}, "max_request_bytes"),
])
def test_bad_environment_exits_naming_the_key(env, key):
    result = _run_cli("serve", env=env, timeout=30)
    assert result.returncode != 0
    assert key in result.stderr.lower(), result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope.toml"
    result = _run_cli("serve", "--config", str(missing))
    assert result.returncode != 0
    assert str(missing) in result.stderr


def test_bad_flag_value_exits_non_zero():
    result = _run_cli("serve", "--port", "abc")
    assert result.returncode != 0
    assert "--port" in result.stderr


# --- help -------------------------------------------------------------------------------------

def test_serve_help_documents_every_flag():
    result = _run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--config", "--model", "--served-name", "--host", "--port", "--api-key", "--url-prefix",
                 "--tokenizer-workers", "--max-queued-items", "--max-items-per-request",
                 "--max-request-bytes", "--log-level"):
        assert flag in result.stdout, f"{flag} is not in --help"
    assert "INFINITY_" in result.stdout  # the environment variables are explained


def test_top_level_help():
    result = _run_cli("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout


# --- url_prefix, several models, per-model settings --------------------------------------------

MULTI_CONFIG = """
[server]
url_prefix = "/embed"

[[models]]
name = "my-model"
source = "default"

[[models]]
name = "short-model"
source = "default"
max_length = 128
"""


@pytest.fixture(scope="module")
def multi_server(tmp_path_factory):
    from tests.support.server import ServerProcess

    proc = ServerProcess(config=MULTI_CONFIG, log_dir=tmp_path_factory.mktemp("multi"), shared=True)
    proc.url_prefix = "/embed"
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.cleanup()


def test_url_prefix_serves_routes_below_it(multi_server, sentences, reference_vectors):
    for path in ("/embed/v1/embeddings", "/embed/embeddings"):
        response = requests.post(f"http://127.0.0.1:{multi_server.port}{path}",
                                 json={"model": "my-model", "input": sentences[:3]}, timeout=60)
        assert response.status_code == 200, (path, response.text)
        for i, item in enumerate(response.json()["data"]):
            assert_close(decode_embedding(item["embedding"]), reference_vectors[i])
    for path in ("/embed/health", "/embed/v1/health"):
        assert requests.get(f"http://127.0.0.1:{multi_server.port}{path}", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings", "/embedx/v1/embeddings"])
def test_url_prefix_routes_outside_it_are_404(multi_server, path):
    response = requests.post(f"http://127.0.0.1:{multi_server.port}{path}",
                             json={"model": "my-model", "input": ["x"]}, timeout=30)
    assert_error(response, 404)


def test_models_route_lists_every_model_with_kind(multi_server):
    body = requests.get(multi_server.url("/v1/models"), timeout=10).json()
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {"my-model", "short-model"}
    for model in by_id.values():
        assert model["kind"] == "embed"
        assert model["object"] == "model"
        assert model["dimensions"] == DIM
    assert by_id["my-model"]["max_length"] == MAX_LENGTH
    assert by_id["short-model"]["max_length"] == 128


def test_several_models_need_a_model_name(multi_server):
    response = requests.post(multi_server.url("/v1/embeddings"), json={"input": ["which model?"]}, timeout=30)
    error = assert_error(response, 422)
    assert error["param"] == "model"
    error = assert_error(requests.post(multi_server.url("/v1/embeddings"),
                                       json={"model": MODEL_NAME, "input": ["x"]}, timeout=30), 404)
    assert "my-model" in error["message"] and "short-model" in error["message"]


def test_per_model_max_length(multi_server, reference_tokenizer):
    text = "a long input about the limits of each model " * 60
    long_body = requests.post(multi_server.url("/v1/embeddings"),
                              json={"model": "my-model", "input": [text]}, timeout=60).json()
    short_body = requests.post(multi_server.url("/v1/embeddings"),
                               json={"model": "short-model", "input": [text]}, timeout=60).json()
    assert long_body["usage"]["prompt_tokens"] == MAX_LENGTH
    assert short_body["usage"]["prompt_tokens"] == 128
    # short-model's vector is the vector of the text cut to 128 tokens.
    ids = reference_tokenizer(text, truncation=True, max_length=128)["input_ids"]
    cut_body = requests.post(multi_server.url("/v1/embeddings"),
                             json={"model": "my-model", "input": [ids]}, timeout=60).json()
    short = decode_embedding(short_body["data"][0]["embedding"])
    assert cosine(short, decode_embedding(cut_body["data"][0]["embedding"])) >= 0.99999
    assert cosine(short, decode_embedding(long_body["data"][0]["embedding"])) < 0.99999


def test_models_are_served_concurrently(multi_server, sentences, reference_vectors, reference_tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        model = ("my-model", "short-model")[i % 2]
        return i, requests.post(multi_server.url("/v1/embeddings"),
                                json={"model": model, "input": [sentences[i]]}, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(60)))
    for i, response in results:
        assert response.status_code == 200, response.text
        vector = decode_embedding(response.json()["data"][0]["embedding"])
        if i % 2 == 0 or len(reference_tokenizer(sentences[i])["input_ids"]) <= 128:
            assert_close(vector, reference_vectors[i], f"input {i}")


def test_multi_model_server_stops_cleanly(multi_server):
    children = multi_server.record_children()
    arenas = shm_arenas(multi_server.pid)
    assert len(arenas) == 2, arenas  # one arena per model
    assert multi_server.stop(signal.SIGTERM) == 0
    assert wait_until(lambda: not any(pid_alive(c) for c in children), 3)
    assert shm_segments(multi_server.pid) == []


def test_served_name_flag(start_server, sentences, reference_vectors):
    server = start_server("--model", "default", "--served-name", "renamed")
    ids = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert ids == ["renamed"]
    response = server.post("/v1/embeddings", {"model": "renamed", "input": sentences[:2]})
    assert response.status_code == 200
    assert_close(decode_embedding(response.json()["data"][1]["embedding"]), reference_vectors[1])
    assert_error(server.post("/v1/embeddings", {"model": MODEL_NAME, "input": ["x"]}), 404)
