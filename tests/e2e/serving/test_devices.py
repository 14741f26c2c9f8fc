"""Devices and replicas: device strings and what each engine is given, the clear start-up
error for a device this machine lacks (GPU availability mocked), CPU partitions, and, end
to end, a model with two CPU replicas that spreads requests and survives one replica's
death. GPU tests carry the `gpu` marker and are skipped without CUDA."""

from __future__ import annotations

import json
import os
import signal
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from infinity.config import ConfigError, ModelConfig, load_config
from infinity.client.topology import Replica, ServedModel
from infinity.client.supervisor import plan_cpus
from tests.support.answers import assert_error, decode_embedding
from tests.support.processes import pid_alive, wait_until
from tests.support.reference import MODEL_NAME, assert_close
from tests.support.shm import shm_arenas, shm_segments
from infinity.shared import devices
from infinity.folders.resolve import resolve_replicas

pytestmark = pytest.mark.timeout(400)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


# --- device strings -----------------------------------------------------------------------------

@pytest.mark.parametrize("given, normal, for_torch, for_ctranslate2", [
    ("cpu", "cpu", "cpu", ("cpu", 0)),
    ("cpu:0", "cpu", "cpu", ("cpu", 0)),
    ("cpu:2", "cpu:2", "cpu", ("cpu", 0)),
    ("cuda", "cuda:0", "cuda:0", ("cuda", 0)),
    ("cuda:3", "cuda:3", "cuda:3", ("cuda", 3)),
    ("rocm", "rocm:0", "cuda:0", ("cuda", 0)),
    ("rocm:1", "rocm:1", "cuda:1", ("cuda", 1)),
])
def test_device_forms(given, normal, for_torch, for_ctranslate2):
    assert devices.normalise(given) == normal
    assert devices.torch_device(given) == for_torch
    assert devices.ctranslate2_device(given) == for_ctranslate2
    assert devices.is_cpu(given) == normal.startswith("cpu")


def test_mps_is_torch_only():
    assert devices.normalise("mps") == devices.torch_device("mps") == "mps"
    with pytest.raises(ValueError, match="mps"):
        devices.ctranslate2_device("mps")


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:-1", "mps:0", " cpu", ""])
def test_bad_device_strings(bad):
    with pytest.raises(ValueError, match="is not a device"):
        devices.normalise(bad)


@pytest.fixture
def fake_torch(monkeypatch):
    """Set what torch reports about the machine: `fake_torch(cuda=..., hip=..., gpus=..., mps=...)`."""
    def fake(cuda: str | None = None, hip: str | None = None, gpus: int = 0, mps: bool = False) -> None:
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch, "__version__", "2.13.0+test")

    return fake


@pytest.mark.parametrize("machine, device, message", [
    ({}, "cuda", "model 'm' asks for device cuda:0, but this torch build (2.13.0+test) has no CUDA support"),
    ({"cuda": "12.8"}, "cuda:0", "model 'm' asks for device cuda:0, but this machine has no CUDA device visible "
                                 "(check the driver and CUDA_VISIBLE_DEVICES)"),
    ({"cuda": "12.8", "gpus": 1}, "cuda:1",
     "model 'm' asks for device cuda:1, but this machine has 1 CUDA device (cuda:0)"),
    ({"cuda": "12.8", "gpus": 2}, "cuda:2",
     "model 'm' asks for device cuda:2, but this machine has 2 CUDA devices (cuda:0, cuda:1)"),
    ({"cuda": "12.8", "gpus": 2}, "rocm", "model 'm' asks for device rocm:0, but this torch build "
                                         "(2.13.0+test) has no ROCm support"),
    ({"hip": "6.4", "gpus": 2}, "rocm:2",
     "model 'm' asks for device rocm:2, but this machine has 2 ROCm devices (rocm:0, rocm:1)"),
    ({"hip": "6.4"}, "rocm", "model 'm' asks for device rocm:0, but this machine has no ROCm device visible "
                             "(check the driver and HIP_VISIBLE_DEVICES)"),
    ({}, "mps", "model 'm' asks for device mps, but mps is not available"),
])
def test_missing_device_is_named(fake_torch, machine, device, message):
    fake_torch(**machine)
    with pytest.raises(devices.DeviceUnavailable) as error:
        devices.require(device, ["m"])
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("machine, device", [
    ({}, "cpu"),
    ({}, "cpu:7"),
    ({"cuda": "12.8", "gpus": 2}, "cuda:1"),
    ({"hip": "6.4", "gpus": 1}, "rocm"),
    ({"hip": "6.4", "gpus": 1}, "cuda"),  # a ROCm build of torch calls its GPUs cuda too
    ({"mps": True}, "mps"),
])
def test_present_device_passes(fake_torch, machine, device):
    fake_torch(**machine)
    devices.require(device, ["m"])


def test_missing_device_names_every_model_on_it(fake_torch):
    fake_torch()
    with pytest.raises(devices.DeviceUnavailable, match=r"^models 'a', 'b' ask for device cuda:1, but"):
        devices.require("cuda:1", ["a", "b"])


# --- configuration ------------------------------------------------------------------------------

def _load(tmp_path, device_toml: str):
    path = tmp_path / "models.toml"
    path.write_text(f"[[models]]\ndevice = {device_toml}\n")
    return load_config(path, env={})


def test_device_may_be_one_or_several(tmp_path):
    assert _load(tmp_path, '"cuda"').models[0].devices == ["cuda:0"]
    assert _load(tmp_path, '["cpu:0", "cpu:1", "rocm:1", "mps"]').models[0].devices == ["cpu", "cpu:1", "rocm:1",
                                                                                          "mps"]
    assert ModelConfig().devices == ["cpu"]


@pytest.mark.parametrize("device_toml, named", [
    ('"gpu"', "'gpu'"),
    ('["cpu", "cuda:one"]', "'cuda:one'"),
    ('["cuda", "cuda:0"]', "cuda:0"),
    ('["cpu", "cpu:0"]', "cpu"),
    ("[]", "at least one"),
    ("3", "device"),
])
def test_bad_device_config_names_the_key_and_value(tmp_path, device_toml, named):
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, device_toml)
    assert "models.device" in str(error.value) or "`$.models[0].device`" in str(error.value)
    assert named in str(error.value)


# --- CPU partitions -----------------------------------------------------------------------------

@pytest.mark.parametrize("cpus, partitions, expected", [
    ([0, 1], 2, [([0], 1), ([1], 1)]),  # nothing reserved for the tokenizer below 4 cores
    ([0, 1], 3, [([0], 1), ([1], 1), ([0], 1)]),  # more partitions than cores: shared, one thread each
    ([0, 1, 2, 3], 2, [([0, 1], 2), ([2], 1)]),  # core 3 is the tokenizer's
    (list(range(16)), 3, [([0, 1, 2, 3, 4], 5), ([5, 6, 7, 8, 9], 5), ([10, 11, 12, 13], 4)]),
    (list(range(16)), 1, [(list(range(14)), 14)]),
    ([0, 1], 1, [(None, 2)]),  # one partition: as without partitions
])
def test_cpu_partitions_split_the_inference_cores(cpus, partitions, expected):
    plan = plan_cpus(cpus, 0, partitions)
    assert plan.cpu_partitions == expected
    assert plan.tokenizer_cpus == plan_cpus(cpus, 0).tokenizer_cpus


# --- replicas -----------------------------------------------------------------------------------

def test_one_spec_per_device_and_the_auto_engine_sees_every_device():
    import importlib.util

    cpu_engine = "ctranslate2" if importlib.util.find_spec("ctranslate2") else \
        "onnx" if importlib.util.find_spec("onnxscript") else "torch"
    replicas = resolve_replicas(ModelConfig(name="d", device=["cpu:0", "cpu:1"]))
    assert [spec.device for spec in replicas] == ["cpu", "cpu:1"]
    assert {spec.engine for spec in replicas} == {cpu_engine}
    mixed = resolve_replicas(ModelConfig(name="d", device=["cpu", "cuda"]))
    assert [(spec.device, spec.engine) for spec in mixed] == [("cpu", "torch"), ("cuda:0", "torch")]


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), (["cuda:0", "cuda:1"], "float16"), ("rocm", "float16"),
                                           ("mps", "float32"), (["cpu", "cuda"], "float32")])
def test_auto_dtype_is_half_precision_on_gpus_only(device, dtype):
    assert {spec.dtype for spec in resolve_replicas(ModelConfig(name="d", device=device))} == {dtype}
    assert resolve_replicas(ModelConfig(name="d", device=device, dtype="bfloat16"))[0].dtype == "bfloat16"


def test_requests_go_to_the_ready_replica_with_fewest_inputs():
    def replica(device: str, ready: bool, outstanding: int) -> Replica:
        made = Replica(device, types.SimpleNamespace(ready=ready))  # type: ignore[arg-type]
        made.arena = object()  # type: ignore[assignment]
        made.outstanding = outstanding
        return made

    model = ServedModel(resolve_replicas(ModelConfig(name="d"))[0], 8)
    model.replicas = [replica("cpu", True, 5), replica("cpu:1", True, 2), replica("cpu:2", False, 0)]
    assert model.pick() is model.replicas[1]
    assert model.ready
    for each in model.replicas:
        each.child.ready = False
    assert model.pick() is None and not model.ready


# --- end to end ---------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_missing_gpu_stops_the_start_with_a_clear_message(start_server):
    server = start_server(config='[[models]]\ndevice = "cuda"\n', ready=False)
    code = server.proc.wait(120)
    log = server.log_text()
    assert code == 1, log
    assert f"model '{MODEL_NAME}' asks for device cuda:0, but this torch build" in log, log
    assert "has no CUDA support" in log
    assert "Traceback" not in log
    assert shm_segments(server.pid) == []


def _replicas(server) -> dict[str, dict]:
    (model,) = server.get("/v1/models").json()["data"]
    return {replica["device"]: replica for replica in model["replicas"]}


def test_two_cpu_replicas_share_the_load_and_cover_for_each_other(start_server, sentences, reference_vectors):
    server = start_server(config='[[models]]\ndevice = ["cpu:0", "cpu:1"]\n')
    pids = server.worker_pids()
    assert {"inference-cpu", "inference-cpu:1"} <= set(pids), pids
    assert len(shm_arenas(server.pid)) == 2  # an arena per replica
    assert server.get("/v1/models").json()["data"][0]["devices"] == ["cpu", "cpu:1"]

    # Concurrent requests: each goes to the replica with fewer inputs in flight.
    count = 8
    barrier = threading.Barrier(count)

    def one(i: int) -> requests.Response:
        barrier.wait()
        return server.embed(sentences[i * 24:(i + 1) * 24])

    with ThreadPoolExecutor(count) as pool:
        responses = list(pool.map(one, range(count)))
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        for j, item in enumerate(response.json()["data"]):
            assert_close(decode_embedding(item["embedding"]), reference_vectors[i * 24 + j], f"input {i * 24 + j}")
    served = _replicas(server)
    assert served["cpu"]["inputs"] > 0 and served["cpu:1"]["inputs"] > 0, served
    assert served["cpu"]["inputs"] + served["cpu:1"]["inputs"] == count * 24

    # One replica dies: the model keeps being served by the other while it restarts.
    mark = len(server.log_text())
    victim = pids["inference-cpu:1"][-1]
    served_before = served["cpu"]["inputs"]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: not _replicas(server)["cpu:1"]["ready"], 10)
    assert_error(requests.get(server.url("/health"), timeout=10), 503)  # a replica short
    for _ in range(3):
        response = server.embed(sentences[:16])
        assert response.status_code == 200, response.text
        for j, item in enumerate(response.json()["data"]):
            assert_close(decode_embedding(item["embedding"]), reference_vectors[j], f"input {j}, one replica down")
    assert _replicas(server)["cpu"]["inputs"] == served_before + 3 * 16

    assert server.wait_for_log(rf"inference-cpu:1 ready \(pid (?!{victim}\b)\d+\)", 120, mark), server.log_text()
    server.wait_ready(120)
    assert all(replica["ready"] for replica in _replicas(server).values())
    assert not pid_alive(victim)
    assert len(shm_arenas(server.pid)) == 2


@pytest.mark.gpu
@needs_cuda
def test_gpu_replicas_match_the_reference(start_server, sentences, reference_vectors):
    """float32 torch engine on every visible GPU (up to two), one replica each."""
    gpus = [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    server = start_server(config=f'[[models]]\ndevice = {json.dumps(gpus)}\nengine = "torch"\ndtype = "float32"\n')
    assert {f"inference-{gpu}" for gpu in gpus} <= set(server.worker_pids())
    response = server.embed(sentences)
    assert response.status_code == 200, response.text
    for i, item in enumerate(response.json()["data"]):
        assert_close(decode_embedding(item["embedding"]), reference_vectors[i], f"input {i}")
