"""Detect CPU noise from other processes while a benchmark runs (Linux ``/proc``).

On a small shared machine, anything else running (a test suite, another server)
silently skews throughput. ``sample`` reads the machine-wide busy time and the
CPU time of the processes we are measuring (this process plus one process group),
so ``other_share`` can tell how much of the machine was used by anyone else in
between. ``wait_idle`` waits, within a limit, until the machine is quiet.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSample:
    """Clock ticks: machine total, machine idle, and used by the measured processes."""

    total: int
    idle: int
    ours: int


def _machine_ticks() -> tuple[int, int]:
    fields = [int(v) for v in (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    # guest time is already included in user/nice.
    return sum(fields[:8]), idle


def _stat_fields(stat_path: Path) -> list[str] | None:
    """The fields of a process's stat after its command name (state first), or None if it is gone."""
    try:
        # The command name may hold spaces or parentheses: split after the last ')'.
        return stat_path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_ticks(stat_path: Path, pgid: int | None) -> int:
    """utime+stime+cutime+cstime of one process, or 0 if it is gone or not in ``pgid``."""
    rest = _stat_fields(stat_path)
    if rest is None or (pgid is not None and int(rest[2]) != pgid):
        return 0
    return sum(int(v) for v in rest[11:15])


def sample(pgid: int | None = None) -> CpuSample:
    """Sample machine ticks and the ticks of this process plus process group ``pgid``."""
    total, idle = _machine_ticks()
    ours = _process_ticks(_PROC / "self" / "stat", None)
    if pgid is not None:
        for entry in _PROC.iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                ours += _process_ticks(entry / "stat", pgid)
    return CpuSample(total, idle, ours)


def own_ticks() -> int:
    """Ticks this process has used (every thread)."""
    return _process_ticks(_PROC / "self" / "stat", None)


def ticks_by_name(pgid: int) -> dict[str, int]:
    """Ticks of each process of group ``pgid``, summed by command name (our children name
    themselves: ``tokenizer-0``, ``inference-cpu``)."""
    ticks: dict[str, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            used = _process_ticks(entry / "stat", pgid)
            if used:
                ticks[name] = ticks.get(name, 0) + used
    return ticks


def own_ticks_by_pid(pgid: int) -> dict[int, tuple[str, int]]:
    """pid -> (command name, utime+stime) of each process of group ``pgid``: its own ticks
    only, so that a parent that has waited for its children does not count theirs again."""
    ticks = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            rest = _stat_fields(entry / "stat")
            if rest is not None and int(rest[2]) == pgid:
                ticks[int(entry.name)] = (name, int(rest[11]) + int(rest[12]))
    return ticks


def microseconds_per_request(before: dict[str, int], after: dict[str, int], requests: int) -> dict[str, float]:
    """CPU microseconds each name used per request between two `ticks_by_name`."""
    if requests <= 0:
        return {}
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    return {name: round((after[name] - before.get(name, 0)) * tick_us / requests)
            for name in sorted(after)}


def shares_by_name(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Each name's share (0..1) of the ticks the group used between two `ticks_by_name`."""
    used = {name: after[name] - before.get(name, 0) for name in after}
    total = sum(used.values())
    return {name: round(ticks / total, 3) for name, ticks in sorted(used.items())} if total > 0 else {}


def other_share(before: CpuSample, after: CpuSample) -> float:
    """Fraction of the machine's CPU time (0..1) used by processes we did not measure."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return 0.0
    busy = elapsed - (after.idle - before.idle)
    return max(0.0, busy - (after.ours - before.ours)) / elapsed


def wait_idle(
    max_wait: float, pgid: int | None = None, threshold: float = 0.1, interval: float = 2.0
) -> float:
    """Wait up to ``max_wait`` s for an ``interval``-s window in which others use < ``threshold``.

    Processes in group ``pgid`` (e.g. an idle server under test) do not count as
    others. Returns the last measured share of the machine used by other processes.
    """
    deadline = time.monotonic() + max_wait
    while True:
        before = sample(pgid)
        time.sleep(interval)
        share = other_share(before, sample(pgid))
        if share < threshold or time.monotonic() >= deadline:
            return share
