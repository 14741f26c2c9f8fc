"""`python -m infinity embed` as a subprocess, for the corpus job's end-to-end tests: its
command, starting it, and running it to its end while noting its children."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.support.processes import descendant_pids
from tests.support.server import REPO, stop_with_parent

# As the test servers run: float32 on every CPU, so the job's vectors match theirs.
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1", "INFINITY_AUTO_BFLOAT16": "false"}


@dataclass
class EmbedRun:
    """One finished `embed` subprocess: its exit code, what it printed, its pid, and the
    children it was seen with while it ran."""

    code: int
    err: str
    pid: int
    children: set[int]


def embed_command(*args: str) -> list[str]:
    """The job's command; one tokenizer process where it loads the model itself (not with --url)."""
    local = [] if "--url" in args else ["--tokenizer-workers", "1"]
    return [sys.executable, "-m", "infinity", "embed", *args, "--quiet", *local]


def start_embed(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(embed_command(*args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            preexec_fn=stop_with_parent)


def run_embed(*args: str, timeout: float = 240) -> EmbedRun:
    """Run the job to its end (or fail the test after `timeout` seconds)."""
    proc = start_embed(*args)
    children: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        children |= descendant_pids(proc.pid)
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"embed {args} did not finish within {timeout:.0f} s: {proc.communicate()[0]}")
        time.sleep(0.1)
    return EmbedRun(proc.returncode, proc.stdout.read(), proc.pid, children)
