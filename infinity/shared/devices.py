"""Device strings: what `device` in models.toml may say, whether this machine has it, and
what each engine is given for it.

A device is `cpu`, `cpu:N`, `cuda`, `cuda:N`, `rocm`, `rocm:N` or `mps`. Normalised,
`cuda` is `cuda:0`, `rocm` is `rocm:0` and `cpu:0` is `cpu`; the server runs one
inference process per normalised device. `cpu:N` is CPU partition N: a process of its own
on its share of the inference cores (`infinity.client.supervisor.plan_cpus`), which is how a model
gets several CPU replicas. `rocm:N` is GPU N of a ROCm build of torch, which calls it
`cuda:N`.

Parsing needs no torch, so configurations are validated in the front end; `require`
(run in the inference process) imports it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_DEVICE = re.compile(r"(cpu|cuda|rocm)(?::(\d+))?|mps")
_FORMS = "cpu, cpu:N, cuda, cuda:N, rocm, rocm:N or mps"


class DeviceUnavailable(RuntimeError):
    """A configured device that this machine or its torch build does not have."""


def normalise(device: str) -> str:
    """The canonical form of `device`; `ValueError` if it is not a device string."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise ValueError(f"{device!r} is not a device (use {_FORMS})")
    kind, index = match.group(1), int(match.group(2) or 0)
    if kind is None:
        return "mps"
    if kind == "cpu" and index == 0:
        return "cpu"
    return f"{kind}:{index}"


def split(device: str) -> tuple[str, int]:
    """(kind, index) of a device string, normalising it first."""
    kind, _, index = normalise(device).partition(":")
    return kind, int(index or 0)


def is_cpu(device: str) -> bool:
    return split(device)[0] == "cpu"


def torch_device(device: str) -> str:
    """What `torch.device` takes: `cpu` for every CPU partition, `cuda:N` for a ROCm GPU."""
    kind, index = split(device)
    return kind if kind in ("cpu", "mps") else f"cuda:{index}"


def ctranslate2_device(device: str) -> tuple[str, int]:
    """CTranslate2's (device, device_index); its ROCm builds also call a GPU `cuda`."""
    kind, index = split(device)
    if kind == "cpu":
        return "cpu", 0
    if kind == "mps":
        raise ValueError("CTranslate2 does not run on mps; use engine = \"torch\"")
    return "cuda", index


def require(device: str, models: Sequence[str]) -> None:
    """Raise `DeviceUnavailable`, naming `models` and the device, if this machine cannot
    run `device`."""
    problem = _missing(device)
    if problem is not None:
        names = ", ".join(f"'{name}'" for name in models)
        subject = f"model {names} asks" if len(models) == 1 else f"models {names} ask"
        raise DeviceUnavailable(f"{subject} for device {normalise(device)}, but {problem}")


def _missing(device: str) -> str | None:
    """Why this machine cannot run `device`, or None if it can."""
    kind, index = split(device)
    if kind == "cpu":
        return None
    import torch

    if kind == "mps":
        if torch.backends.mps.is_available():
            return None
        return "mps is not available (it needs Apple silicon and a torch build with MPS support)"
    if kind == "rocm" and torch.version.hip is None:
        return f"this torch build ({torch.__version__}) has no ROCm support"
    if kind == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    platform, visible = ("ROCm", "HIP_VISIBLE_DEVICES") if kind == "rocm" else ("CUDA", "CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return None
    if count == 0:
        return f"this machine has no {platform} device visible (check the driver and {visible})"
    present = ", ".join(f"{kind}:{i}" for i in range(count))
    return f"this machine has {count} {platform} device{'s' if count > 1 else ''} ({present})"


# CPU flags of instructions that compute bfloat16 dot products (Intel since Cooper Lake,
# AMD since Zen 4); without them torch emulates bfloat16, slower than float32.
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_computes_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has bfloat16 dot-product instructions (Linux's flags;
    False where they cannot be read)."""
    return not NATIVE_BFLOAT16_FLAGS.isdisjoint(_first_cpu(cpuinfo).get("flags", "").split())


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and flags as Linux reports them ("" where they cannot be read):
    what a measurement made on this machine holds for."""
    cpu = _first_cpu(cpuinfo)
    return f"{cpu.get('model name', '')} | {cpu.get('flags', '')}".strip(" |")


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The first processor's fields in `cpuinfo` (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields
