"""Child processes of the server: how many, on which CPUs, started how, and stopped how.

The supervisor starts each child with `multiprocessing` (spawn) by its entry point, a
"module:function" name the child imports (so the front end never imports worker code
to start one), opens a fresh channel to it at each start (endpoints numbered by start,
so a restarted child never hears what was meant for its predecessor), watches its sentinel
from the event loop so a death is noticed at once, restarts it with a back-off, and at
stop terminates every child, then kills any that linger.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from infinity.shared import protocol
from infinity.shared.channel import ChannelToChild

log = logging.getLogger(__name__)

_spawn = multiprocessing.get_context("spawn")
# A child that keeps dying is restarted after 0.5 s, 1 s, 2 s, ... up to this.
MAX_RESTART_DELAY_S = 30.0


@dataclass(frozen=True)
class CpuPlan:
    tokenizer_cpus: list[list[int] | None]  # one entry per tokenizer process
    inference_cpus: list[int] | None  # every inference core; GPU processes run on these
    inference_threads: int
    # (cores, threads) of each CPU partition's process (devices cpu, cpu:1, ...).
    cpu_partitions: list[tuple[list[int] | None, int]]


def plan_cpus(cpus: list[int], tokenizer_workers: int = 0, cpu_partitions: int = 1,
              quota: float | None = None) -> CpuPlan:
    """Split the usable CPUs between tokenizer processes and inference processes.

    A CPU `quota` (cores' worth of time, a container's CPU limit) below the number of
    `cpus` sizes the plan for that many cores and pins nothing: the quota is time on any
    core, and pinning every container to the same first cores would pile them up.

    With 4 or more CPUs, tokenizers get one pinned core each (one per 8 cores by default,
    at least one) and inference the rest; with fewer, nothing is pinned: one tokenizer
    shares the cores with inference, which runs a thread per core. Several CPU partitions
    split the inference cores (all cores, if none are reserved) into contiguous pinned
    groups of near-equal size, a thread per core; with more partitions than cores, they
    share cores round robin, one thread each.
    """
    if quota is not None and int(quota) < len(cpus):
        plan = plan_cpus(cpus[:max(1, int(quota))], tokenizer_workers, cpu_partitions)
        return CpuPlan([None] * len(plan.tokenizer_cpus), None, plan.inference_threads,
                       [(None, threads) for _, threads in plan.cpu_partitions])
    count = tokenizer_workers or max(1, len(cpus) // 8)
    if len(cpus) < 4 or count >= len(cpus) // 2 + 1:
        tokenizers: list[list[int] | None] = [None] * count
        inference, threads = None, len(cpus)
    else:
        tokenizers = [[cpu] for cpu in cpus[-count:]]
        inference = cpus[:-count]
        threads = len(inference)
    if cpu_partitions == 1:
        partitions: list[tuple[list[int] | None, int]] = [(inference, threads)]
    else:
        partitions = [(group, len(group)) for group in _split(inference or cpus, cpu_partitions)]
    return CpuPlan(tokenizers, inference, threads, partitions)


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    """`cpus` in `parts` contiguous groups whose sizes differ by at most one; with fewer
    cpus than parts, one cpu each, round robin."""
    if parts > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [cpus[start:end] for start, end in zip(starts, starts[1:])]


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU time this process's cgroup may use, in cores (a container's `--cpus` or
    Kubernetes CPU limit), or None when unlimited or unknown. Read from the cgroup root as
    a container sees it: cgroup v2's `cpu.max`, else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct"):
        try:
            quota_us = int((cgroup_root / folder / "cpu.cfs_quota_us").read_text())
            period_us = int((cgroup_root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def _run_entry_point(entry_point: str, args: protocol.WorkerArgs) -> None:
    """In the child: import "module:function" and run it with `args`."""
    module, function = entry_point.split(":")
    getattr(importlib.import_module(module), function)(args)


def spawn_process(entry_point: str, args: protocol.WorkerArgs) -> multiprocessing.process.BaseProcess:
    """A process (not started yet) that runs `entry_point` with `args`: how the server
    launches its children (the fast tests launch threads instead: tests/fast/inprocess.py)."""
    return _spawn.Process(target=_run_entry_point, args=(entry_point, args), name=args.name)


# (entry point, args) -> a process, not started: `spawn_process`, or a stand-in with its
# `start`, `sentinel`, `is_alive`, `join`, `terminate`, `kill`, `close` and `exitcode`.
Launch = Callable[[str, protocol.WorkerArgs], Any]


# What a tokenizer process is started with: numpy's OpenBLAS would start a thread per
# core there, spinning beside the inference threads for no gain on the small products it
# computes (a spectrogram's mel filter bank: twice the CPU time for the same wall time).
SINGLE_THREADED_BLAS = {"OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while a child is spawned (it copies the environment)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Child:
    """One child process and the front end's channel to it."""

    def __init__(self, args: protocol.WorkerArgs, entry_point: str, launch: Launch = spawn_process,
                 environment: dict[str, str] | None = None) -> None:
        self.args = args  # its `channel` is the base of every start's endpoints
        self.environment = environment or {}  # set for the child beside the server's own
        self.name = args.name
        self._entry_point = entry_point
        self._launch = launch
        self.process: multiprocessing.process.BaseProcess | None = None
        self.channel: ChannelToChild | None = None
        self._outbox: list[protocol.Message] = []  # waiting for their send
        # The send scheduled for them (uvloop's handles are not asyncio's classes, but alike),
        # and whether it waits for a hold to pass.
        self._flush_handle: asyncio.Handle | None = None
        self._flush_held = False
        self.ready = False
        self.failures = 0  # in a row, for the back-off: a child that comes up starts again at 0
        self.restarts = 0  # since the server started
        self._starts = 0

    def start(self, on_message: Callable[[protocol.Message], None], on_exit: Callable[[Child], None]) -> None:
        """Open a fresh channel, whose messages go to `on_message`, and spawn the process."""
        self.ready = False
        args = self.open_channel(on_message)
        self.process = self._launch(self._entry_point, args)
        with _environment(self.environment):
            self.process.start()
        asyncio.get_running_loop().add_reader(self.process.sentinel, self._exited, on_exit)

    def open_channel(self, on_message: Callable[[protocol.Message], None]) -> protocol.WorkerArgs:
        """Open a channel at endpoints of this start's own, so nothing queued for a dead
        predecessor reaches the new process; return the args to start the process with."""
        self._starts += 1
        args = msgspec.structs.replace(self.args, channel=f"{self.args.channel}.{self._starts}")
        self.channel = ChannelToChild(args.channel, on_message)
        return args

    def restart_delay(self) -> float:
        """Count a failure; the seconds to wait before starting the child again."""
        self.failures += 1
        self.restarts += 1
        return min(MAX_RESTART_DELAY_S, 0.5 * 2 ** (self.failures - 1))

    def send(self, message: protocol.Message, hold_s: float = 0.0) -> None:
        """Queue `message` for the child. What is queued in one turn of the event loop
        leaves together, as one ZeroMQ message: one wake-up of the child for all of it
        (bench/results/serving-path.md#one-zeromq-send-per-turn). `hold_s`: how long the
        message may wait for others to leave with it, where the child is busy anyway; a
        message sent without it takes every waiting one along at the end of this turn."""
        assert self.channel is not None
        self._outbox.append(message)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop running (a stop): at once
            self._flush()
            return
        if self._flush_handle is not None and (hold_s > 0 or not self._flush_held):
            return  # goes with the send already scheduled
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_held = hold_s > 0
        self._flush_handle = loop.call_later(hold_s, self._flush) if self._flush_held else loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        outbox, self._outbox = self._outbox, []
        if self.channel is not None and outbox:
            self.channel.send(outbox)

    def _exited(self, on_exit: Callable[[Child], None]) -> None:
        assert self.process is not None
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        # The sentinel closes as the process exits, a moment before it can be reaped.
        self.process.join(1.0)
        self.ready = False
        self.close_channel()
        on_exit(self)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM); `reap` waits for it."""
        if self.process is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
        except RuntimeError:
            pass  # no running loop: the server is already past its event loop
        if self.process.is_alive():
            self.process.terminate()

    def reap(self, timeout: float) -> None:
        """Wait for the process to end; kill it if it outlives `timeout`."""
        if self.process is None:
            return
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            self.process.kill()
            self.process.join()
        self.process.close()
        self.process = None

    def close_channel(self) -> None:
        self._outbox.clear()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
