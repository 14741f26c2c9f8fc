"""What a server keeps under /dev/shm (its folder of arenas, lock and socket files), listed
and removed by the pid of its front end."""

from __future__ import annotations

import shutil
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_segments(pid: int) -> list[str]:
    """Everything under /dev/shm of the server whose front end is `pid`: its folders and
    what is in them (arenas, the lock, socket files), as paths relative to /dev/shm."""
    found = []
    for folder in SHM_DIR.glob(f"infinity-emb-{pid}-*"):
        found.append(folder.name)
        if folder.is_dir():
            found.extend(str(p.relative_to(SHM_DIR)) for p in folder.iterdir())
    return sorted(found)


def shm_arenas(pid: int) -> list[str]:
    """The result arenas of the server whose front end is `pid`."""
    return sorted(str(p.relative_to(SHM_DIR)) for p in SHM_DIR.glob(f"infinity-emb-{pid}-*/*")
                  if p.is_file() and p.name != "lock")


def remove_shm(pid: int) -> None:
    """Remove what the server whose front end is `pid` left under /dev/shm."""
    for folder in SHM_DIR.glob(f"infinity-emb-{pid}-*"):
        shutil.rmtree(folder, ignore_errors=True)
