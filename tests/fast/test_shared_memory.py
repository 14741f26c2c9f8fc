"""Arenas in /dev/shm: their pages are taken when they are made, and a /dev/shm too small
for them (a container's default 64 MiB) stops the start with what to do, not a SIGBUS
later."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from infinity.config import ModelConfig, ServerConfig
from infinity.folders.resolve import resolve_replicas
from infinity.client.engine_client import EngineClient, StartupError
from infinity.shared import shm
from tests.fast.inprocess import ThreadLauncher


def _full(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_arena_takes_its_pages_when_it_is_made():
    folder = shm.ServerFolder()
    try:
        arena = shm.Arena(folder.arena_prefix() + "m", slots=64, dim=384, create=True)
        assert os.stat(shm.SHM_DIR / arena.name).st_blocks * 512 >= 64 * 384 * 4
        arena.close()
    finally:
        folder.remove()


def test_an_arena_that_does_not_fit_says_what_to_do(monkeypatch):
    folder = shm.ServerFolder()
    monkeypatch.setattr(shm.os, "posix_fallocate", _full)
    try:
        with pytest.raises(shm.SharedMemoryTooSmall, match=r"needs 1\.5 MiB \(1024 slots x 384 float32\)") as error:
            shm.Arena(folder.arena_prefix() + "m", slots=1024, dim=384, create=True)
        assert "--shm-size" in str(error.value) and "max_queued_items" in str(error.value)
    finally:
        folder.remove()


def test_the_start_fails_with_the_reason_when_dev_shm_is_too_small(monkeypatch):
    monkeypatch.setattr(shm.os, "posix_fallocate", _full)

    async def start() -> None:
        specs = resolve_replicas(ModelConfig(name="m", engine="torch"))
        client = EngineClient(ServerConfig(), specs, ThreadLauncher())
        try:
            with pytest.raises(StartupError, match="inference-cpu: /dev/shm is too small"):
                await asyncio.wait_for(client.start(), 30)
        finally:
            await client.stop()

    asyncio.run(start())
