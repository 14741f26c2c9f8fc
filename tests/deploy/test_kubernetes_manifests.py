"""deploy/kubernetes/: every manifest is valid against the Kubernetes API schema (offline,
with the schemas kubernetes-validate bundles, strict: unknown fields fail), and the
Deployment keeps the server's contract: readiness on /health, liveness on /live, a
termination grace period longer than the preStop pause plus the drain, a memory-backed
/dev/shm large enough for the configured models, a non-root read-only container whose
writable paths are volumes, a Service and autoscalers that find the pods, and a ConfigMap
the server's own loader accepts. No cluster is needed or contacted."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from infinity.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"

# The oldest version the manifests claim (the preStop `sleep` action is on by default from
# 1.30) and the newest whose schemas the pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30", "1.37")

# Output dimension of each model source the ConfigMap may name, for the /dev/shm budget.
# Add a source here when the ConfigMap serves another model.
MODEL_DIMS = {"default": 384}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(ROOT.rglob("*.yaml")) + sorted(ROOT.rglob("*.yml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((str(path.relative_to(ROOT)), doc))
    return docs


DOCUMENTS = _documents()
# Objects of kinds another project defines (custom resources), which the bundled schemas do
# not know; each is checked by a test of its own.
CUSTOM_KINDS = {"ScaledObject"}
OBJECTS = [(name, doc) for name, doc in DOCUMENTS if doc.get("kind") not in {"Kustomization", *CUSTOM_KINDS}]


def _only(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in OBJECTS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec() -> dict[str, Any]:
    return _only("Deployment")["spec"]["template"]["spec"]


def _container() -> dict[str, Any]:
    containers = _pod_spec()["containers"]
    assert len(containers) == 1
    return containers[0]


def _quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("256Mi", "2", "500m", "1G") as a number (bytes, cores)."""
    match = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|m|k|M|G|T)?", str(value))
    assert match, f"cannot read quantity {value!r}"
    factor = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
              "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[match.group(2)]
    return float(match.group(1)) * factor


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(_only("ConfigMap")["data"]["models.toml"])
    return path


def _effective_config(tmp_path: Path) -> Config:
    """What the server in the container runs with: the ConfigMap's file and the literal
    INFINITY_* values of the container's environment (Secrets left out)."""
    env = {item["name"]: item["value"] for item in _container().get("env", []) if "value" in item}
    return load_config(_config_file(tmp_path), env=env)


def _container_port(reference: str | int) -> int:
    """The container port a probe or Service names (by name or by number)."""
    for port in _container()["ports"]:
        if reference in (port.get("name"), port["containerPort"]):
            return port["containerPort"]
    raise AssertionError(f"port {reference!r} is not one of the container's ports")


def _prestop_seconds() -> int:
    pre_stop = _container()["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = " ".join(pre_stop["exec"]["command"])
    match = re.search(r"\bsleep\s+(\d+)", command)
    assert match, f"preStop is neither a sleep action nor an exec of sleep: {pre_stop}"
    return int(match.group(1))


def test_the_expected_objects_are_there() -> None:
    kinds = sorted(doc["kind"] for _, doc in OBJECTS)
    for kind in ("ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"):
        assert kind in kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name,doc", OBJECTS, ids=[f"{n}:{d['kind']}" for n, d in OBJECTS])
def test_manifest_is_valid_for_kubernetes(name: str, doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} ({doc['kind']}) is invalid for Kubernetes {version} at {path}: {exc.message}")


def test_kustomization_lists_every_top_level_manifest() -> None:
    (kustomization,) = [doc for _, doc in DOCUMENTS if doc.get("kind") == "Kustomization"]
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    top_level = {p.name for p in ROOT.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(listed) == top_level
    # One autoscaler per Deployment: the optional queue autoscaler replaces hpa.yaml.
    hpas = [name for name, doc in OBJECTS if doc["kind"] == "HorizontalPodAutoscaler" and name in listed]
    assert hpas == ["hpa.yaml"]


def test_probes_readiness_on_health_liveness_on_live(tmp_path: Path) -> None:
    container = _container()
    port = _effective_config(tmp_path).server.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    # A startupProbe on /health would restart a pod whose models load slowly.
    assert container["startupProbe"]["httpGet"]["path"] == "/live"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert _container_port(container[probe]["httpGet"]["port"]) == port, probe


def test_termination_grace_covers_prestop_and_drain(tmp_path: Path) -> None:
    drain = _effective_config(tmp_path).server.shutdown_timeout
    env = {item["name"]: item.get("value") for item in _container()["env"]}
    assert float(env["INFINITY_SHUTDOWN_TIMEOUT"]) == drain  # set in the manifest, and in force
    pause = _prestop_seconds()
    assert pause > 0
    assert _pod_spec()["terminationGracePeriodSeconds"] > pause + drain


def test_dev_shm_is_memory_backed_and_large_enough(tmp_path: Path) -> None:
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod_spec()["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    size = _quantity(shm["sizeLimit"])
    config = _effective_config(tmp_path)
    needed = 0
    for model in config.models:
        assert model.source in MODEL_DIMS, f"add {model.source!r}'s dimension to MODEL_DIMS"
        needed += config.server.max_queued_items * MODEL_DIMS[model.source] * 4 * len(model.devices)
    assert needed > 0
    assert size >= needed
    # The memory-backed volume counts against the container's memory limit.
    assert _quantity(_container()["resources"]["limits"]["memory"]) > size


def test_resources_requested_and_limited() -> None:
    resources = _container()["resources"]
    for key in ("cpu", "memory"):
        assert _quantity(resources["requests"][key]) > 0
        assert _quantity(resources["limits"][key]) >= _quantity(resources["requests"][key])


def test_runs_as_non_root_with_a_read_only_root() -> None:
    pod = _pod_spec()["securityContext"]
    container = _container()["securityContext"]
    # A container's own setting overrides the pod's.
    assert {**pod, **container}.get("runAsNonRoot") is True
    assert {**pod, **container}.get("runAsUser") not in (None, 0)
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"]["drop"] == ["ALL"]
    assert "add" not in container["capabilities"]
    assert container["readOnlyRootFilesystem"] is True
    assert {**pod, **container}["seccompProfile"]["type"] == "RuntimeDefault"


def test_writable_paths_are_volumes() -> None:
    """With a read-only root, the cache, /tmp, $HOME and /dev/shm must be writable mounts."""
    env = {item["name"]: item.get("value") for item in _container()["env"]}
    writable = {m["mountPath"] for m in _container()["volumeMounts"] if not m.get("readOnly")}

    def on_volume(path: str) -> bool:
        return any(path == mount or path.startswith(mount.rstrip("/") + "/") for mount in writable)

    for path in (env["INFINITY_CACHE_DIR"], env["HOME"], env.get("HF_HOME") or env["HOME"], "/tmp", "/dev/shm"):
        assert on_volume(path), f"{path} is not on a writable volume"


def test_config_map_loads_and_the_args_point_at_its_mount(tmp_path: Path) -> None:
    configmap = _only("ConfigMap")
    config = load_config(_config_file(tmp_path), env={})
    assert [m.source for m in config.models] == ["default"]
    args = _container()["args"]
    path = args[args.index("--config") + 1]
    mount = next(m for m in _container()["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in _pod_spec()["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
    items = {item["path"]: item["key"] for item in volume["configMap"].get("items", [])}
    key = items.get(relative, relative) if items else relative
    assert key in configmap["data"]
    assert key == "models.toml"


def test_service_links_are_off() -> None:
    """A Service named `infinity` would give the pods INFINITY_PORT=tcp://<ip>:7997, which
    the server cannot start with; the Deployment turns service links off."""
    with pytest.raises(ConfigError):
        load_config(None, env={"INFINITY_PORT": "tcp://10.0.0.1:7997"})
    assert _pod_spec()["enableServiceLinks"] is False


def test_service_selects_the_pods_and_targets_the_server_port(tmp_path: Path) -> None:
    service = _only("Service")
    deployment = _only("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http"
    assert port["port"] == 7997
    assert _container_port(port["targetPort"]) == _effective_config(tmp_path).server.port == 7997
    assert any(p["name"] == "http" and p["containerPort"] == 7997 for p in _container()["ports"])


def test_autoscalers_target_the_deployment() -> None:
    deployment = _only("Deployment")
    hpas = [doc for _, doc in OBJECTS if doc["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    metrics_source = (ROOT.parents[1] / "infinity" / "api" / "metrics.py").read_text()
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == \
            ("apps/v1", "Deployment", deployment["metadata"]["name"])
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource" and metric["resource"]["target"]["type"] == "Utilization":
                # Utilisation is relative to the request: without one the HPA cannot compute it.
                assert metric["resource"]["name"] in _container()["resources"]["requests"]
            if metric["type"] == "Pods":
                name = metric["pods"]["metric"]["name"]
                assert f'"{name}"' in metrics_source, f"the server exports no metric {name}"
    queue = [m for hpa in hpas for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert [m["pods"]["metric"]["name"] for m in queue] == ["infinity_queue_slots_in_use"]


def test_the_keda_scaler_targets_the_deployment_on_a_metric_the_server_exports() -> None:
    """optional/keda-backlog.yaml: KEDA's ScaledObject (keda.sh/v1alpha1, no schema here:
    the fields KEDA reads are checked one by one), scaling the Deployment on the backlog."""
    (scaler,) = [doc for _, doc in DOCUMENTS if doc.get("kind") == "ScaledObject"]
    assert scaler["apiVersion"] == "keda.sh/v1alpha1"
    assert set(scaler["spec"]) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                                   "cooldownPeriod", "triggers"}
    target = scaler["spec"]["scaleTargetRef"]
    deployment = _only("Deployment")
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        ("apps/v1", "Deployment", deployment["metadata"]["name"])
    assert 1 <= scaler["spec"]["minReplicaCount"] <= scaler["spec"]["maxReplicaCount"]
    (trigger,) = scaler["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert trigger["metadata"]["serverAddress"].startswith("http")
    assert float(trigger["metadata"]["threshold"]) > 0 and isinstance(trigger["metadata"]["threshold"], str)
    metrics_source = (ROOT.parents[1] / "infinity" / "api" / "metrics.py").read_text()
    (metric,) = re.findall(r"\b(infinity_\w+)\{", trigger["metadata"]["query"])
    assert f'"{metric}"' in metrics_source, f"the server exports no metric {metric}"
    assert metric == "infinity_backlog_seconds"


def test_disruption_budget_selects_the_pods_and_lets_one_go() -> None:
    pdb = _only("PodDisruptionBudget")
    labels = _only("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    min_replicas = min(doc["spec"]["minReplicas"] for _, doc in OBJECTS if doc["kind"] == "HorizontalPodAutoscaler")
    if "maxUnavailable" in pdb["spec"]:
        assert 1 <= pdb["spec"]["maxUnavailable"] < min_replicas
    else:
        assert pdb["spec"]["minAvailable"] < min_replicas  # else a drain can never evict a pod


def test_prometheus_scrapes_each_pod(tmp_path: Path) -> None:
    annotations = _only("Deployment")["spec"]["template"]["metadata"]["annotations"]
    server = _effective_config(tmp_path).server
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == server.port
    assert annotations["prometheus.io/path"] == f"{server.url_prefix}/metrics"


def test_image_is_pinned() -> None:
    image = _container()["image"]
    if "@sha256:" in image:
        return  # a digest pins it exactly
    name = image.rsplit("/", 1)[-1]
    assert ":" in name, f"{image!r} has no tag (that is :latest)"
    assert name.rsplit(":", 1)[1] not in ("", "latest")


def test_the_embed_job_runs_one_shard_per_index_on_the_server_image() -> None:
    """optional/embed-indexed-job.yaml: an Indexed Job whose pod k runs `embed --shard k/N`
    with N its completions and parallelism, input and output on one shared claim."""
    (job,) = [doc for name, doc in OBJECTS if doc["kind"] == "Job"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "infinity", "embed"]
    args = container["args"]
    assert args[:2] == ["/data/input", "/data/output"] and "--quiet" in args
    index, count = args[args.index("--shard") + 1].split("/")
    assert index == "$(JOB_COMPLETION_INDEX)"  # expanded by Kubernetes from the Indexed Job's env
    assert int(count) == spec["completions"] == spec["parallelism"]
    assert container["image"] == _container()["image"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert not mount.get("readOnly")
    volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    claim = next(doc for _, doc in OBJECTS if doc["kind"] == "PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every pod writes the one OUTPUT
