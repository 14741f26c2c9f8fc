"""Where the server's work runs: the tokenizer processes, one inference process per
device, and each model's replicas on them (a replica: a model in one inference process,
with the arena that process writes), placed on the CPUs by `infinity.client.supervisor.plan_cpus`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from infinity.config import ServerConfig
from infinity.shared import devices, protocol, shm
from infinity.shared.kinds import KINDS, KindSpec
from infinity.shared.protocol import ModelSpec
from infinity.client.supervisor import (SINGLE_THREADED_BLAS, Child, Launch, cpu_quota, plan_cpus, spawn_process,
                                 usable_cpus)

log = logging.getLogger(__name__)

TOKENIZER_ENTRY_POINT = "workers.preprocess.worker:main"
INFERENCE_ENTRY_POINT = "workers.inference.worker:main"

# (name, specs, cpus, threads) -> what the child of that name is started with
ArgsOf = Callable[[str, list[ModelSpec], list[int] | None, int], protocol.WorkerArgs]


class Replica:
    """A model in one inference process (one device), with the arena that process writes."""

    def __init__(self, device: str, child: Child) -> None:
        self.device = device
        self.child = child
        self.info: protocol.ModelInfo | None = None
        self.arena: shm.Arena | None = None
        self.outstanding = 0  # inputs sent to it and not yet done
        self.served = 0  # inputs it has computed

    @property
    def ready(self) -> bool:
        return self.child.ready and self.arena is not None

    def attach(self, info: protocol.ModelInfo) -> None:
        """Map the arena a (re)started inference child created for this model."""
        self.info = info
        self.arena = shm.Arena(info.arena, info.slots, 0 if info.ragged else info.dim, create=False)


# The measured rate of a model forgets its past by half in this many seconds: recent enough to
# follow a change of load, long enough that one odd request does not move it much.
RATE_HALF_LIFE_S = 60.0


class TokenRate:
    """Tokens a model completes per second while it has work: the tokens of the requests
    answered over the time they kept it busy (each request from when it was sent, or from
    the answer before it if later, to its answer), both decaying with `RATE_HALF_LIFE_S`."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._seconds = 0.0
        self._last: float | None = None  # the last answer's time

    def completed(self, tokens: int, sent: float, now: float) -> None:
        """A request of `tokens` sent at `sent` (monotonic seconds) was answered at `now`."""
        busy_from = sent
        if self._last is not None:
            decay = 0.5 ** (max(now - self._last, 0.0) / RATE_HALF_LIFE_S)
            self._tokens *= decay
            self._seconds *= decay
            busy_from = max(sent, self._last)
        self._tokens += tokens
        self._seconds += max(now - busy_from, 0.0)
        self._last = now

    @property
    def per_second(self) -> float | None:
        """The rate, or None before a request has kept the model busy."""
        return self._tokens / self._seconds if self._seconds > 0 else None


@dataclass
class Served:
    """What a model has computed since the server started, and what it holds (read by
    the metrics)."""

    inputs: int = 0
    prompt_tokens: int = 0
    truncated: int = 0
    queued_tokens: int = 0  # of the requests sent to an inference process and not yet answered
    rate: TokenRate = field(default_factory=TokenRate)

    @property
    def backlog_seconds(self) -> float:
        """How long the model would take to compute what it holds, at its measured rate (0
        before it has one): what an autoscaler scales on."""
        rate = self.rate.per_second
        return self.queued_tokens / rate if rate and self.queued_tokens else 0.0


class ServedModel:
    """A model as the front end sees it: its spec (the first replica's; replicas differ
    only in device), its replicas, and the slot pool they share.

    Every replica's arena has as many rows as the pool has slots, so slots taken at
    admission are valid in whichever replica runs the request; its result is read from
    that replica's arena.
    """

    def __init__(self, spec: ModelSpec, slots: int) -> None:
        self.spec = spec
        self.pool = shm.SlotPool(slots)
        self.replicas: list[Replica] = []
        self.served = Served()

    @property
    def kind(self) -> KindSpec:
        """What its kind serves and how (`infinity.shared.kinds`)."""
        return KINDS[self.spec.kind]

    @property
    def ready(self) -> bool:
        """At least one replica can take requests."""
        return any(replica.ready for replica in self.replicas)

    @property
    def info(self) -> protocol.ModelInfo | None:
        """What the loaded model reports (the same in every replica but for its arena)."""
        return next((replica.info for replica in self.replicas if replica.info is not None), None)

    def pick(self) -> Replica | None:
        """The ready replica with the fewest inputs outstanding, or None."""
        return min((r for r in self.replicas if r.ready), key=lambda r: r.outstanding, default=None)

    def replica_in(self, child: Child) -> Replica:
        return next(replica for replica in self.replicas if replica.child is child)


@dataclass
class Topology:
    models: dict[str, ServedModel]  # by name
    tokenizers: list[Child]
    inference: list[Child]  # one per device
    # The cores every process shares, where no tokenizer process has cores of its own
    # (`supervisor.plan_cpus`); None where they have.
    shared_cores: float | None = None

    @property
    def children(self) -> list[Child]:
        return [*self.tokenizers, *self.inference]


def place(server: ServerConfig, specs: list[ModelSpec], args_of: ArgsOf, launch: Launch = spawn_process) -> Topology:
    """The children and replicas for `specs` (one spec per replica: a model on several
    devices appears once for each), launched by `launch`; every tokenizer process serves
    every model."""
    models: dict[str, ServedModel] = {}
    for spec in specs:
        models.setdefault(spec.name, ServedModel(spec, server.max_queued_items))
    all_devices = list(dict.fromkeys(spec.device for spec in specs))
    cpu_devices = [device for device in all_devices if devices.is_cpu(device)]
    usable, quota = usable_cpus(), cpu_quota()
    if quota is not None and int(quota) < len(usable):
        log.info("CPU quota of %.2f cores on %d usable cores: processes sized for %d cores, not pinned",
                 quota, len(usable), max(1, int(quota)))
    plan = plan_cpus(usable, server.tokenizer_workers, max(1, len(cpu_devices)), quota)
    placement = dict(zip(cpu_devices, plan.cpu_partitions))
    first_specs = [model.spec for model in models.values()]
    tokenizers = [Child(args_of(f"tokenizer-{i}", first_specs, cpus, 1), TOKENIZER_ENTRY_POINT, launch,
                        SINGLE_THREADED_BLAS)
                  for i, cpus in enumerate(plan.tokenizer_cpus)]
    inference = []
    for device in all_devices:
        on_device = [spec for spec in specs if spec.device == device]
        cpus, threads = placement.get(device, (plan.inference_cpus, plan.inference_threads))
        child = Child(args_of(f"inference-{device}", on_device, cpus, threads), INFERENCE_ENTRY_POINT, launch)
        inference.append(child)
        for spec in on_device:
            models[spec.name].replicas.append(Replica(device, child))
    shared = all(cores is None for cores in plan.tokenizer_cpus)
    return Topology(models, tokenizers, inference, min(len(usable), quota or len(usable)) if shared else None)
