"""Shared memory of one server: its folder under /dev/shm, the arenas in it that carry
result vectors from an inference process to the front end, and the slot pool the front
end allocates them from.

Each server start owns one folder, `/dev/shm/infinity-emb-<pid>-<token>`, holding its
arenas, its channels' ipc endpoint files (until each child connects), and a `lock` file
the front end holds locked (flock) for as long as it runs. The random token keeps two
servers apart even when their pids are alike (pid 1 in containers that share an IPC
namespace); a folder is stale, and removed at the next start, only when its lock can be
taken, that is when its owner is gone, whatever its pid.

An arena is a file of `slots` rows of `dim` float32 in that folder. The inference process
creates it when its model is loaded and writes row i when told to; the front end maps it,
allocates rows to requests before they are queued (so a full pool is the admission limit)
and reads the vectors in place. The front end alone removes arenas: at a clean stop, when
a child dies, and at start for the folder of a server that no longer runs. Arenas are
plain files opened with `mmap`, not `multiprocessing.shared_memory`, so no resource
tracker in any process unlinks them behind the owner's back.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import shutil
from collections import Counter, deque
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
_PREFIX = "infinity-emb"
_LOCK = "lock"


class ServerFolder:
    """This server start's folder under /dev/shm, locked while the front end runs."""

    def __init__(self) -> None:
        self.name = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = SHM_DIR / self.name
        # Built under a hidden name and renamed once locked, so that no other server's
        # clean-up ever sees this folder unlocked.
        staging = SHM_DIR / f".{self.name}"
        staging.mkdir(mode=0o700)
        self._lock = os.open(staging / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        staging.rename(self.path)

    def arena_prefix(self) -> str:
        """What arena names start with: they live in this folder."""
        return f"{self.name}/"

    def remove(self) -> None:
        """Remove the folder and everything in it, then let go of the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def remove_stale() -> list[str]:
    """Remove the folders of servers that no longer run (their lock is free, or gone
    with a removal cut short); return their names."""
    removed = []
    for path in SHM_DIR.glob(f"{_PREFIX}-*"):
        if path.is_dir() and not _in_use(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _in_use(folder: Path) -> bool:
    try:
        fd = os.open(folder / _LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the lock if it was taken
    return False


class SharedMemoryTooSmall(OSError):
    """/dev/shm cannot hold an arena (a container's is 64 MiB unless it is given more)."""


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
                _reserve(fd, name, size, slots, dim)
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


def _reserve(fd: int, name: str, size: int, slots: int, dim: int) -> None:
    """Take the arena's pages in /dev/shm now: a file larger than the space left maps
    fine, and the process writing past that space dies of SIGBUS at the first such row."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(SHM_DIR).free
        raise SharedMemoryTooSmall(
            f"{SHM_DIR} is too small: the arena {name} needs {size / 2**20:.1f} MiB ({slots} slots x {dim} "
            f"float32) and {free / 2**20:.1f} MiB are free; give the server more shared memory (docker run "
            "--shm-size, a memory-backed emptyDir at /dev/shm) or lower max_queued_items") from None


def arena_name(prefix: str, worker: str, model: str) -> str:
    """The arena the inference process `worker` creates for `model` (under the server's `prefix`)."""
    return prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{worker}-{model}")


def remove(name: str) -> None:
    try:
        (SHM_DIR / name).unlink()
    except FileNotFoundError:
        pass


class SlotPool:
    """Free rows of one arena, allocated by the front end (one thread, no locking), and
    how many rows the requests of each priority hold."""

    def __init__(self, slots: int) -> None:
        self._free: deque[int] = deque(range(slots))
        self._priority_of = [0] * slots  # of the request holding each row
        self.held: Counter[int] = Counter()  # rows taken, by the priority of their requests
        self.capacity = slots

    @property
    def free(self) -> int:
        return len(self._free)

    def held_from(self, priority: int) -> int:
        """Rows held by requests of `priority` or a less urgent one (a higher number)."""
        return sum(count for held_by, count in self.held.items() if held_by >= priority)

    def held_up_to(self, priority: int) -> int:
        """Rows held by requests of `priority` or a more urgent one (a lower number)."""
        return sum(count for held_by, count in self.held.items() if held_by <= priority)

    def take(self, n: int, priority: int = 0) -> list[int] | None:
        """`n` rows for a request of `priority`, or None when fewer are free (the caller
        answers 429)."""
        if n > len(self._free):
            return None
        pop = self._free.popleft
        slots = [pop() for _ in range(n)]
        for slot in slots:
            self._priority_of[slot] = priority
        self.held[priority] += n
        return slots

    def give_back(self, slots: list[int]) -> None:
        held = self.held
        for slot in slots:
            held[self._priority_of[slot]] -= 1
        self._free.extend(slots)
