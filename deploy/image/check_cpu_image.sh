#!/usr/bin/env bash
# Build Dockerfile.cpu for real and smoke-test the image, with no Docker daemon and no
# registry: buildah builds, podman runs (Debian's packages, rootful).
#
#   1. install buildah, podman, runc, mmdebstrap with apt-get (if missing);
#   2. bootstrap a Debian bookworm base with mmdebstrap (minbase + ca-certificates) and
#      import it: it stands in for the real default base (python:3.11.14-slim-bookworm),
#      which no registry here serves; the Dockerfile puts Debian's CPython 3.11 on it;
#   3. buildah bud Dockerfile.cpu with --pull=never and that base; pip gets the host's CA
#      bundle, the local CPU torch wheel (/opt/wheels: download.pytorch.org is out of reach
#      here, and PyPI's torch is the CUDA build) and the local index /opt/pypi, read-only;
#   4. podman run it (the image's own entrypoint and default config; host network on a
#      free port set by INFINITY_PORT; --shm-size as documented; HF_HUB_OFFLINE=1) and
#      check: /live 200, /health 200 within the deadline, POST /v1/embeddings answers a
#      384-float unit vector, /metrics has infinity_requests_total, the HEALTHCHECK passes,
#      the server (pid 1) runs as uid 1000; then SIGTERM (podman stop): it must drain and
#      exit 0;
#   5. print the build time, the first start's time to ready and the image size.
#
# Everything it makes (storage, images, containers, temp files) lives in one temporary
# folder, removed on exit whatever happened. Exit status 0 only if every check passed.
# Run as root: bash deploy/image/check_cpu_image.sh    (about 5 min on 2 cores)
# Options (environment): KEEP_WORKDIR=1 keeps the folder and its logs (build.log,
# server.log; the images and containers are still removed);
# CHECK_GPU_DOCKERFILES=1 also builds Dockerfile.cuda and Dockerfile.rocm up to their
# builder stage on the same base (Debian's CPython instead of the deadsnakes one), with the
# CPU torch wheel in place of the GPU builds and their default EXTRAS (the CUDA image's
# onnxruntime-gpu and cuBLAS 12 wheels install without a GPU): their own bases and GPU
# torch wheels are out of reach here. About 5 more minutes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STARTED=$SECONDS
log() { printf '[check_cpu_image %s] %s\n' "$(date +%T)" "$*"; }
fail() { log "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "run as root (apt-get, mmdebstrap, rootful buildah and podman)"
command -v python3 >/dev/null || fail "python3 is needed for the HTTP checks"

# --- 1. tools --------------------------------------------------------------------------
PACKAGES=(buildah podman runc mmdebstrap containernetworking-plugins ca-certificates)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
log "$(buildah --version), $(podman --version), $(runc --version | head -n1)"

HOST_CA=/etc/ssl/certs/ca-certificates.crt
WHEELS=${WHEELS:-/opt/wheels}
[ -f "$HOST_CA" ] || fail "no host CA bundle at $HOST_CA (pip needs it to reach PyPI here)"
TORCH_WHEEL=$(ls "$WHEELS"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
[ -n "$TORCH_WHEEL" ] || fail "no torch-2.13.0+cpu cp311 wheel in $WHEELS"

# --- the temporary folder and its cleanup ----------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/infinity-image-check.XXXXXX")
mkdir -p "$WORK/tmp" "$WORK/libpod-tmp"
export TMPDIR="$WORK/tmp"
STORE=(--root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs)
BUILDAH=(buildah "${STORE[@]}")
PODMAN=(podman "${STORE[@]}" --tmpdir "$WORK/libpod-tmp" --cgroup-manager cgroupfs
        --events-backend file --runtime runc)
BASE_REF=localhost/infinity-check/debian:bookworm-minbase
IMAGE_REF=localhost/infinity-serve:check-cpu
CTR=infinity-check-$$

cleanup() {
    local rc=$?
    set +e
    if [ "$rc" != 0 ] && "${PODMAN[@]}" container exists "$CTR" 2>/dev/null; then
        log "server log (last 60 lines):"
        "${PODMAN[@]}" logs --tail 60 "$CTR" 2>&1 | sed 's/^/    /'
    fi
    "${PODMAN[@]}" rm -f -v "$CTR" >/dev/null 2>&1
    "${BUILDAH[@]}" rm --all >/dev/null 2>&1
    "${PODMAN[@]}" rmi -a -f >/dev/null 2>&1
    # Anything still mounted below the folder (a container's /dev/shm, say) goes first.
    findmnt -rn -o TARGET | grep -F "$WORK" | sort -r | xargs -r -n1 umount -l 2>/dev/null
    if [ "${KEEP_WORKDIR:-0}" = 1 ]; then
        log "kept $WORK"
    else
        rm -rf "$WORK"
    fi
    if [ "$rc" = 0 ]; then
        log "PASS ($((SECONDS - STARTED)) s in all)"
    else
        log "FAILED (exit $rc) after $((SECONDS - STARTED)) s"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 2. base image ---------------------------------------------------------------------
log "bootstrapping Debian bookworm (mmdebstrap, minbase) in $WORK"
t0=$SECONDS
mmdebstrap --quiet --variant=minbase --include=ca-certificates \
    bookworm "$WORK/base.tar" http://deb.debian.org/debian \
    || fail "mmdebstrap could not bootstrap bookworm"
"${PODMAN[@]}" import --quiet "$WORK/base.tar" "$BASE_REF" >/dev/null \
    || fail "podman import of the base failed"
rm -f "$WORK/base.tar"
log "base image ready in $((SECONDS - t0)) s"

# Build arguments and read-only mounts that point pip at this machine's sources.
LOCAL_BUILD=(
    --build-arg "BASE_IMAGE=$BASE_REF"
    --build-arg "TORCH_VERSION=2.13.0+cpu"
    --build-arg "TORCH_INDEX_URL=https://pypi.org/simple"
    --build-arg "PIP_FIND_LINKS=/wheels"
    --build-arg "PIP_CERT=$HOST_CA"
    --volume "$HOST_CA:$HOST_CA:ro"
    --volume "$WHEELS:/wheels:ro"
)
if [ -d /opt/pypi/simple ]; then
    LOCAL_BUILD+=(--build-arg "PIP_EXTRA_INDEX_URL=file:///pypi/simple" --volume "/opt/pypi:/pypi:ro")
fi
BUD=("${BUILDAH[@]}" bud --isolation chroot --format docker --pull=never --layers=false)

# --- 3. build --------------------------------------------------------------------------
log "building Dockerfile.cpu"
t0=$SECONDS
"${BUD[@]}" "${LOCAL_BUILD[@]}" -f "$ROOT/Dockerfile.cpu" -t "$IMAGE_REF" "$ROOT" >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" | sed 's/^/    /'; fail "buildah bud Dockerfile.cpu failed"; }
BUILD_S=$((SECONDS - t0))
grep -E '^torch ' "$WORK/build.log" | sed 's/^/    /' || true
log "built in ${BUILD_S} s"

# The image's configuration, as the Dockerfile declares it (docker format keeps HEALTHCHECK).
"${PODMAN[@]}" image inspect "$IMAGE_REF" >"$WORK/inspect.json"
python3 - "$WORK/inspect.json" <<'PY' || fail "the image's configuration is not as declared"
import json, sys
image = json.load(open(sys.argv[1]))[0]
config = image.get("Config") or {}
health = image.get("Healthcheck") or image.get("HealthCheck") or config.get("Healthcheck") or {}
problems = []
if config.get("User") != "1000:1000":
    problems.append(f"User is {config.get('User')!r}, not 1000:1000")
if config.get("Entrypoint") != ["python", "-m", "infinity", "serve"]:
    problems.append(f"Entrypoint is {config.get('Entrypoint')!r}")
if "7997/tcp" not in (config.get("ExposedPorts") or {}):
    problems.append("7997/tcp is not exposed")
if "/var/cache/infinity" not in (config.get("Volumes") or {}):
    problems.append("/var/cache/infinity is not a volume")
if "healthcheck.py" not in " ".join(health.get("Test") or []):
    problems.append(f"no HEALTHCHECK kept: {health!r}")
for problem in problems:
    print("    " + problem)
sys.exit(1 if problems else 0)
PY
SIZE_BYTES=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["Size"])' "$WORK/inspect.json")

# --- 4. run ----------------------------------------------------------------------------
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log "starting the container on port $PORT"
# --no-healthcheck: podman times a HEALTHCHECK with systemd timers, and there is no systemd
# here (it logs errors); the image's declared check command is run by hand below instead.
"${PODMAN[@]}" run -d --name "$CTR" --network host --shm-size=256m --no-healthcheck \
    --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
    -e INFINITY_PORT="$PORT" -e HF_HUB_OFFLINE=1 \
    "$IMAGE_REF" >/dev/null || fail "podman run failed"
t0=$SECONDS

python3 - "$PORT" "${PODMAN[@]}" inspect --format '{{.State.Running}}' "$CTR" <<'PY' \
    || fail "the server did not get ready or answered wrongly"
import json, math, subprocess, sys, time, urllib.error, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
is_running = sys.argv[2:]  # the podman command that prints whether the container runs
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

def get(path, body=None, timeout=10):
    request = urllib.request.Request(base + path, data=body, method="POST" if body else "GET",
                                     headers={"Content-Type": "application/json"} if body else {})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None, b""

deadline = time.monotonic() + 300
live_seen = False
while True:
    status, _ = get("/live", timeout=3)
    live_seen = live_seen or status == 200
    status, _ = get("/health", timeout=3)
    if status == 200:
        break
    if time.monotonic() > deadline:
        sys.exit(f"    /health is still {status} after 300 s")
    if status is None and subprocess.run(is_running, capture_output=True, text=True).stdout.strip() != "true":
        sys.exit("    the container stopped before it got ready")
    time.sleep(1)
print("    /health 200" + (" (/live answered 200 before)" if live_seen else ""))

status, _ = get("/live")
assert status == 200, f"/live answered {status}"
print("    /live 200")

status, body = get("/v1/embeddings", json.dumps({"input": ["hello"]}).encode())
assert status == 200, f"POST /v1/embeddings answered {status}: {body[:300]!r}"
answer = json.loads(body)
vector = answer["data"][0]["embedding"]
assert len(answer["data"]) == 1 and len(vector) == 384, f"expected one 384-d vector, got {len(vector)}"
assert all(isinstance(x, float) for x in vector), "the vector holds non-floats"
norm = math.sqrt(sum(x * x for x in vector))
assert abs(norm - 1) < 1e-3, f"the vector's norm is {norm}"
print(f"    POST /v1/embeddings: model {answer.get('model')!r}, 384 floats, norm {norm:.4f}")

status, body = get("/metrics")
assert status == 200, f"/metrics answered {status}"
assert b"infinity_requests_total" in body, "/metrics lacks infinity_requests_total"
print("    /metrics 200 with infinity_requests_total")
PY
READY_S=$((SECONDS - t0))
log "server ready and answering (${READY_S} s from start, the conversion for CTranslate2 included)"

# The HEALTHCHECK exactly as the image declares it (["CMD", ...] form), as the user it runs as.
mapfile -t HEALTH_CMD < <(python3 -c '
import json, sys
image = json.load(open(sys.argv[1]))[0]
test = (image.get("Healthcheck") or image.get("HealthCheck") or image["Config"]["Healthcheck"])["Test"]
assert test[0] == "CMD", test
print("\n".join(test[1:]))' "$WORK/inspect.json")
if "${PODMAN[@]}" exec "$CTR" "${HEALTH_CMD[@]}" >"$WORK/health.out" 2>&1; then
    log "HEALTHCHECK passed (${HEALTH_CMD[*]})"
else
    cat "$WORK/health.out" | sed 's/^/    /'
    fail "the image's HEALTHCHECK failed against a ready server"
fi

uids=$("${PODMAN[@]}" exec "$CTR" python -c \
    "import os; print(os.getuid(), os.stat('/proc/1').st_uid, open('/proc/1/cmdline').read().replace(chr(0), ' ').strip())")
log "in the container: exec uid, pid 1's uid and command: $uids"
read -r exec_uid pid1_uid _ <<<"$uids"
[ "$exec_uid" = 1000 ] && [ "$pid1_uid" = 1000 ] || fail "the server does not run as uid 1000"
case "$uids" in *"-m infinity serve"*) ;; *) fail "pid 1 is not python -m infinity serve" ;; esac

log "stopping (SIGTERM, 60 s grace)"
t0=$SECONDS
"${PODMAN[@]}" stop -t 60 "$CTR" >/dev/null || fail "podman stop failed"
STOP_S=$((SECONDS - t0))
exit_code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$CTR")
[ "$exit_code" = 0 ] || fail "the server exited $exit_code after SIGTERM (0 expected)"
"${PODMAN[@]}" logs "$CTR" >"$WORK/server.log" 2>&1 || true
log "stopped in ${STOP_S} s, exit code 0"

# --- optional: the GPU Dockerfiles' builder stages on the same base --------------------
if [ "${CHECK_GPU_DOCKERFILES:-0}" = 1 ]; then
    for flavour in cuda rocm; do
        log "building Dockerfile.$flavour --target builder (the CPU torch in place of the GPU one)"
        t0=$SECONDS
        "${BUD[@]}" "${LOCAL_BUILD[@]}" --target builder \
            -f "$ROOT/Dockerfile.$flavour" -t "localhost/infinity-serve:check-$flavour-builder" "$ROOT" \
            >"$WORK/build-$flavour.log" 2>&1 \
            || { tail -n 40 "$WORK/build-$flavour.log" | sed 's/^/    /'; fail "Dockerfile.$flavour's builder stage failed"; }
        grep -E '^torch ' "$WORK/build-$flavour.log" | sed 's/^/    /' || true
        log "Dockerfile.$flavour builder stage built in $((SECONDS - t0)) s"
        "${PODMAN[@]}" rmi -f "localhost/infinity-serve:check-$flavour-builder" >/dev/null 2>&1 || true
    done
fi

# --- 5. report -------------------------------------------------------------------------
SIZE_H=$(python3 -c 'import sys; print(f"{int(sys.argv[1]) / 1e9:.2f} GB ({int(sys.argv[1]) / 2**30:.2f} GiB)")' "$SIZE_BYTES")
log "Dockerfile.cpu: build ${BUILD_S} s, image size ${SIZE_H}, ready ${READY_S} s after start, stop ${STOP_S} s"
