"""How many of the CPUs this process may run on other processes left it of late: the idle
ones, and those it used itself (/proc/stat over its CPUs, and its own CPU time). Whether a
batch split across idle lanes would find cores for its parts, or only share cores that the
front end, the tokenizers and whatever else runs keep busy (workers/inference/scheduler.py).

Counted over the process's CPU affinity, so a cpuset (a container's, or `taskset`) is
respected; a CPU quota without a cpuset is not seen, and the host's other load on those
CPUs counts as taken, which it is. Where /proc/stat cannot be read, every CPU counts as
left, which shares batches as if this measure were not there.
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


class CoresLeft:
    """The CPUs of `cpus` (this process's affinity by default) that other processes left
    this one over the last `interval` seconds, sampled when asked and at most once per
    interval: a call costs a look-up, not a read of /proc."""

    def __init__(self, cpus: Iterable[int] | None = None, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 read: Callable[[Iterable[int]], dict[int, tuple[int, int]]] = cpu_times,
                 own_seconds: Callable[[], float] = time.process_time) -> None:
        self._cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self._interval = interval
        self._clock = clock
        self._read = read
        self._own_seconds = own_seconds
        self._sampled_at = clock()
        self._sample = read(self._cpus)
        self._own = own_seconds()
        self._left = float(len(self._cpus))  # until a first interval has passed: all of them

    def __call__(self) -> float:
        now = self._clock()
        elapsed = now - self._sampled_at
        if elapsed >= self._interval:
            sample, own = self._read(self._cpus), self._own_seconds()
            idle = total = 0
            for cpu, (cpu_idle, cpu_total) in sample.items():
                if cpu in self._sample:
                    idle += cpu_idle - self._sample[cpu][0]
                    total += cpu_total - self._sample[cpu][1]
            cpus = len(self._cpus)
            # Ticks are coarse (10 ms): over a short interval none may have passed.
            if total > 0:
                self._left = min(float(cpus), cpus * idle / total + (own - self._own) / elapsed)
            elif not sample:
                self._left = float(cpus)
            self._sampled_at, self._sample, self._own = now, sample, own
        return self._left
