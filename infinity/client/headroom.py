"""How much room the server's cores have beside what its own processes use.

Where the tokenizer processes share the cores with the front end and the inference
process (fewer than four cores, or a CPU quota: `supervisor.plan_cpus`), handing a
query's longer text to a tokenizer process only moves its tokenizing onto a core that is
already busy, and costs two more messages, each waking a thread on both sides: about a
quarter of a millisecond of CPU per request on two cores
(bench/results/serving-path.md#a-querys-text-tokenized-where-the-cores-are). The engine
client asks `CoreHeadroom.crowded` and tokenizes such a text itself while the server's
processes leave less than a core idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, float]:
    """CPU seconds (user and system) each process of `pids` has used so far, from
    /proc/<pid>/stat; a process that is gone, or a system without /proc, gives none."""
    used = {}
    for pid in pids:
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            continue
        # The command name, in parentheses, may hold spaces: fields count after it.
        fields = stat[stat.rindex(")") + 2:].split()
        used[pid] = (int(fields[11]) + int(fields[12])) * _TICK_S
    return used


class CoreHeadroom:
    """The idle cores of `cores` over the last `interval` seconds, counting the CPU time
    of the processes `pids()` names (the front end and its children); sampled when asked,
    at most once per interval, so a request pays a dictionary look-up, not a read of /proc."""

    def __init__(self, cores: float, pids: Callable[[], Iterable[int]], interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 used: Callable[[Iterable[int]], dict[int, float]] = cpu_seconds) -> None:
        self._cores = cores
        self._pids = pids
        self._interval = interval
        self._clock = clock
        self._used = used
        self._sampled_at = clock()
        self._sample = used(set(pids()))
        self._idle = cores  # until a first interval has passed: all of them

    def idle(self) -> float:
        """Idle cores over the last whole interval (a process started within it counts from
        its first sample; where /proc cannot be read, every core is idle)."""
        now = self._clock()
        if now - self._sampled_at >= self._interval:
            sample = self._used(set(self._pids()))
            busy = sum(seconds - self._sample[pid] for pid, seconds in sample.items() if pid in self._sample)
            self._idle = max(0.0, self._cores - busy / (now - self._sampled_at))
            self._sampled_at, self._sample = now, sample
        return self._idle

    def crowded(self) -> bool:
        """Whether less than one core is left idle."""
        return self.idle() < 1.0
