"""Shared-memory arenas that carry result vectors from an inference process to the
front end, and the slot pool the front end allocates them from.

An arena is a POSIX shared-memory file of `slots` rows of `dim` float32. The inference
process creates it when its model is loaded and writes row i when told to; the front end
maps it, allocates rows to requests before they are queued (so a full pool is the
admission limit) and reads the vectors in place. The front end alone removes arenas:
at a clean stop, when a child dies, and at start for any arena of a server that no
longer runs. Arenas are plain files under /dev/shm opened with `mmap`, not
`multiprocessing.shared_memory`, so no resource tracker in any process unlinks them
behind the owner's back.
"""

from __future__ import annotations

import mmap
import os
import re
from collections import deque
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
_PREFIX = "infinity-emb"
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-")


def server_prefix(pid: int | None = None) -> str:
    """The name prefix of every arena of the server whose front end has `pid`."""
    return f"{_PREFIX}-{os.getpid() if pid is None else pid}-"


class Arena:
    """A mapped arena: `rows` is a (slots, dim) float32 view of the shared file."""

    def __init__(self, name: str, slots: int, dim: int, create: bool) -> None:
        self.name = name
        path = SHM_DIR / name
        size = max(1, slots * dim * 4)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, dtype=np.float32, count=slots * dim).reshape(slots, dim)

    def close(self) -> None:
        self.rows = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process


def remove(name: str) -> None:
    try:
        (SHM_DIR / name).unlink()
    except FileNotFoundError:
        pass


def remove_with_prefix(prefix: str) -> None:
    for path in SHM_DIR.glob(f"{prefix}*"):
        remove(path.name)


def remove_stale() -> list[str]:
    """Remove arenas left by servers whose front-end process is gone; return their names."""
    removed = []
    for path in SHM_DIR.glob(f"{_PREFIX}-*"):
        match = _NAME.match(path.name)
        if match and not pid_alive(int(match.group(1))):
            remove(path.name)
            removed.append(path.name)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotPool:
    """Free rows of one arena, allocated by the front end (one thread, no locking)."""

    def __init__(self, slots: int) -> None:
        self._free: deque[int] = deque(range(slots))
        self.capacity = slots

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` rows, or None when fewer are free (the caller answers 429)."""
        if n > len(self._free):
            return None
        pop = self._free.popleft
        return [pop() for _ in range(n)]

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
