"""Processes seen through /proc (a server's children, whether a pid is still the process
it was), and waiting for a condition to hold."""

from __future__ import annotations

import time
from pathlib import Path


def child_pids(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children (none once it has exited:
    a process may end between being listed and being read)."""
    children: set[int] = set()
    try:
        paths = list(Path(f"/proc/{pid}/task").glob("*/children"))
    except (FileNotFoundError, ProcessLookupError):
        return children
    for path in paths:
        try:
            children.update(int(p) for p in path.read_text().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    return children


def descendant_pids(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), to tell a recycled pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
