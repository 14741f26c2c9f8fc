"""How many of the CPUs this process may run on were idle lately, from /proc/stat: whether
a batch split across idle lanes would find cores of its own, or only share busy ones with
the front end, the tokenizers and whatever else runs (workers/inference/scheduler.py).

Counted over the process's CPU affinity, so a cpuset (a container's, or `taskset`) is
respected; a CPU quota without a cpuset is not seen, and the host's other load on those
CPUs counts as busy, which it is. Where /proc/stat cannot be read, every CPU counts as
idle, which leaves the scheduler's sharing as it is without this measure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal (then guest
# times, already counted in user and nice).
_IDLE_FIELDS = (3, 4)
_COUNTED_FIELDS = 8


def cpu_times(cpus: Iterable[int], stat: Path = Path("/proc/stat")) -> dict[int, tuple[int, int]]:
    """(idle, total) clock ticks each CPU of `cpus` has counted since boot; none where
    /proc/stat cannot be read."""
    wanted = {f"cpu{cpu}": cpu for cpu in cpus}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = [int(value) for value in rest.split()[:_COUNTED_FIELDS]]
            times[wanted[name]] = (sum(fields[i] for i in _IDLE_FIELDS), sum(fields))
    return times


class IdleCores:
    """Idle CPUs of `cpus` (this process's affinity by default) over the last `interval`
    seconds, sampled when asked and at most once per interval: a call costs a look-up,
    not a read of /proc."""

    def __init__(self, cpus: Iterable[int] | None = None, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 read: Callable[[Iterable[int]], dict[int, tuple[int, int]]] = cpu_times) -> None:
        self._cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self._interval = interval
        self._clock = clock
        self._read = read
        self._sampled_at = clock()
        self._sample = read(self._cpus)
        self._idle = float(len(self._cpus))  # until a first interval has passed: all of them

    def __call__(self) -> float:
        now = self._clock()
        if now - self._sampled_at >= self._interval:
            sample = self._read(self._cpus)
            idle = total = 0
            for cpu, (cpu_idle, cpu_total) in sample.items():
                if cpu in self._sample:
                    idle += cpu_idle - self._sample[cpu][0]
                    total += cpu_total - self._sample[cpu][1]
            # Ticks are coarse (10 ms): over a short interval none may have passed.
            if total > 0:
                self._idle = len(self._cpus) * idle / total
            elif not sample:
                self._idle = float(len(self._cpus))
            self._sampled_at, self._sample = now, sample
        return self._idle
