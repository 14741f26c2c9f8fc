"""The cores' headroom beside the server's own processes, and where a query's text is
tokenized by it (`infinity.client.headroom`, `engine_client._tokenized_here`)."""

from __future__ import annotations

import os

import pytest

from infinity.client import topology
from infinity.client.engine_client import INLINE_IDLE_MAX_CHARS, INLINE_MAX_CHARS, ModelInputs, _tokenized_here
from infinity.client.headroom import CoreHeadroom, cpu_seconds
from infinity.config import ModelConfig, ServerConfig
from infinity.folders.resolve import resolve_model
from infinity.shared import protocol

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def test_cpu_seconds_reads_user_and_system_time_of_each_process(tmp_path):
    # A command name may hold spaces and parentheses: fields count from the last ")".
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "stat").write_text("41 (odd) name) S 1 41 41 0 -1 4194560 10 0 0 0 300 200 0 0 20 0 3 0\n")
    used = cpu_seconds([41, 42], proc=tmp_path)  # 42 is gone: left out
    assert used == {41: pytest.approx(500 * TICK_S)}
    assert cpu_seconds([os.getpid()])[os.getpid()] > 0


class FakeProcesses:
    """CPU seconds by pid, moved by hand, and a clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.seconds: dict[int, float] = {1: 0.0, 2: 0.0}
        self.reads = 0

    def used(self, pids):
        self.reads += 1
        return {pid: self.seconds[pid] for pid in pids if pid in self.seconds}


def test_idle_cores_are_the_cores_less_what_the_processes_used_over_the_last_interval():
    processes = FakeProcesses()
    headroom = CoreHeadroom(2.0, lambda: list(processes.seconds), interval=0.25, clock=lambda: processes.now,
                            used=processes.used)
    assert headroom.idle() == 2.0 and not headroom.crowded()  # no interval measured yet: all idle
    processes.now, processes.seconds = 0.5, {1: 0.4, 2: 0.35}  # 0.75 s of CPU in 0.5 s: 1.5 cores
    assert headroom.idle() == pytest.approx(0.5) and headroom.crowded()
    reads = processes.reads
    processes.now = 0.6  # within the interval: the last figure, no read
    assert headroom.idle() == pytest.approx(0.5) and processes.reads == reads
    # A restarted child (new pid 3) counts from its first sample; the one gone (2) is dropped.
    processes.now, processes.seconds = 1.0, {1: 0.5, 3: 5.0}
    assert headroom.idle() == pytest.approx(2.0 - 0.1 / 0.5)
    processes.now, processes.seconds = 1.5, {1: 0.5, 3: 5.5}
    assert headroom.idle() == pytest.approx(1.0) and not headroom.crowded()
    processes.now, processes.seconds = 2.0, {1: 2.0, 3: 6.0}  # more than every core: none idle
    assert headroom.idle() == 0.0


def test_where_proc_cannot_be_read_every_core_is_idle():
    headroom = CoreHeadroom(2.0, lambda: [os.getpid()], interval=0.0, used=lambda pids: {})
    assert headroom.idle() == 2.0 and not headroom.crowded()


@pytest.mark.parametrize("chars, crowded, idle, here", [
    (INLINE_MAX_CHARS, False, False, True),
    (INLINE_MAX_CHARS + 1, False, False, False),  # to a tokenizer process: a core is idle for it
    (INLINE_MAX_CHARS + 1, True, False, True),  # the cores are busy: tokenized here
    (INLINE_IDLE_MAX_CHARS, True, False, True),
    (INLINE_IDLE_MAX_CHARS + 1, True, False, False),  # too long to hold the event loop for
    (INLINE_IDLE_MAX_CHARS, False, True, True),
])
def test_one_text_is_tokenized_here_up_to_a_longer_limit_where_the_cores_are_crowded(chars, crowded, idle, here):
    assert _tokenized_here(ModelInputs(texts=["x" * chars]), idle=idle, crowded=crowded) is here


def test_several_texts_go_to_a_tokenizer_process_however_crowded():
    texts = ["x" * (INLINE_MAX_CHARS // 2 + 1)] * 2
    assert not _tokenized_here(ModelInputs(texts=texts), idle=False, crowded=True)
    assert _tokenized_here(ModelInputs(texts=texts), idle=True, crowded=False)


@pytest.mark.parametrize("cpus, quota, shared", [
    (2, None, 2.0),  # one tokenizer process shares both cores
    (8, None, None),  # a tokenizer process on a core of its own
    (8, 1.5, 1.5),  # a quota: nothing pinned, every process shares 1.5 cores' time
])
def test_the_topology_names_the_shared_cores_where_no_tokenizer_has_its_own(monkeypatch, cpus, quota, shared):
    monkeypatch.setattr(topology, "usable_cpus", lambda: list(range(cpus)))
    monkeypatch.setattr(topology, "cpu_quota", lambda: quota)
    spec = resolve_model(ModelConfig(name="m"))
    placed = topology.place(ServerConfig(), [spec], lambda name, specs, cores, threads: protocol.WorkerArgs(
        name, "", specs, cores, threads, "", 1, "info"), launch=lambda entry_point, args: None)
    assert placed.shared_cores == shared
