"""The inference process's measure of the CPUs other processes leave it: /proc/stat's idle
share of the CPUs asked for, plus its own CPU time, over an interval, sampled at most once
per interval."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from workers.inference.cores_left import CoresLeft, cpu_times

STAT = """cpu  300 0 100 1000 0 0 0 0 0 0
cpu0 100 0 50 500 10 0 0 5 7 0
cpu1 200 0 50 500 0 0 0 0 0 0
cpu2 1 1 1 1 1 1 1 1 0 0
intr 12345
"""


def test_cpu_times_reads_idle_and_total_ticks_of_the_cpus_asked_for(tmp_path: Path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    # idle and iowait are idle; guest time (already in user) is not counted again.
    assert cpu_times([0, 1], stat) == {0: (510, 665), 1: (500, 750)}
    assert cpu_times([3], stat) == {}
    assert cpu_times([0], tmp_path / "missing") == {}


class _Ticks:
    """A /proc/stat of two CPUs whose counts the test moves."""

    def __init__(self) -> None:
        self.times = {0: (0, 0), 1: (0, 0)}
        self.reads = 0

    def __call__(self, cpus: Iterable[int]) -> dict[int, tuple[int, int]]:
        self.reads += 1
        return {cpu: self.times[cpu] for cpu in cpus if cpu in self.times}

    def advance(self, idle: tuple[int, int], total: int) -> None:
        self.times = {cpu: (self.times[cpu][0] + idle[cpu], self.times[cpu][1] + total) for cpu in self.times}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.own = 0.0  # this process's CPU seconds

    def __call__(self) -> float:
        return self.now


def _cores_left(ticks: _Ticks, clock: _Clock) -> CoresLeft:
    return CoresLeft([0, 1], interval=0.25, clock=clock, read=ticks, own_seconds=lambda: clock.own)


def test_every_cpu_is_left_until_an_interval_has_passed_then_the_idle_ones_and_those_used_here():
    ticks, clock = _Ticks(), _Clock()
    left = _cores_left(ticks, clock)
    assert left() == 2.0
    ticks.advance((5, 20), total=25)  # CPU 0 a fifth idle, CPU 1 four fifths: one CPU idle
    clock.now, clock.own = 0.1, 0.05
    assert left() == 2.0 and ticks.reads == 1  # within the interval: no read
    clock.now, clock.own = 0.5, 0.25  # this process used half a CPU
    assert left() == 1.0 + 0.5
    ticks.advance((25, 25), total=25)
    assert left() == 1.5  # sampled once per interval
    clock.now = 1.0  # all idle, this process among the idle
    assert left() == 2.0


def test_the_cpus_this_process_keeps_busy_are_left_to_it():
    ticks, clock = _Ticks(), _Clock()
    left = _cores_left(ticks, clock)
    ticks.advance((0, 0), total=25)
    clock.now, clock.own = 0.25, 0.5  # both CPUs busy, all of it this process's
    assert left() == 2.0
    ticks.advance((0, 0), total=25)
    clock.now, clock.own = 0.5, 0.625  # both busy, a CPU and a half of it others'
    assert left() == 0.5


def test_an_interval_without_a_tick_keeps_the_last_figure_and_an_unreadable_stat_leaves_every_cpu():
    ticks, clock = _Ticks(), _Clock()
    left = _cores_left(ticks, clock)
    ticks.advance((0, 0), total=10)
    clock.now = 0.3
    assert left() == 0.0
    clock.now = 0.6
    assert left() == 0.0  # no tick counted in between
    unreadable = CoresLeft([0, 1], interval=0.25, clock=clock, read=lambda cpus: {})
    clock.now = 1.0
    assert unreadable() == 2.0


def test_by_default_the_cpus_are_this_processs_own():
    assert 0.0 <= CoresLeft()() <= len(os.sched_getaffinity(0))
