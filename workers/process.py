"""The common life of every child process: die with its parent, leave Ctrl-C to the
supervisor, take its CPUs, set up logging, connect its channel to the front end, serve,
and close the channel."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from tqdm import tqdm

from infinity.shared import protocol, tracing
from infinity.shared.channel import ChannelToFront

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
TRACES_FLUSH_S = 1.0  # the longest a child stopping waits to export its last spans


def run_child(args: protocol.WorkerArgs, serve: Callable[[protocol.WorkerArgs, ChannelToFront], None]) -> None:
    """A child's main: prepare the process, then `serve` on its channel until it returns."""
    channel = start_child(args)
    try:
        serve(args, channel)
    finally:
        channel.close()  # waits until the front end has read what was sent, `StartupFailed` say


def start_child(args: protocol.WorkerArgs) -> ChannelToFront:
    """Prepare this process; return its channel to the front end."""
    parent = os.getppid()
    try:  # Linux: SIGKILL us when the supervisor dies, even by kill -9
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # Named as in the log, so `ps`, `top` and the benchmarks tell the children apart
        # (the kernel keeps 15 bytes).
        libc.prctl(_PR_SET_NAME, args.name.encode()[:15])
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(1)
    # No progress bars in a server's log: transformers and huggingface_hub draw them with
    # tqdm, whose first bar creates a named multiprocessing semaphore that a killed child
    # would leave in /dev/shm.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{args.name}] %(message)s",
    )
    if args.traced:
        tracing.configure(args.name)
    return ChannelToFront(args.channel)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Leave at once: the front end owns every shared resource (arenas, endpoint files) and
    the drain happened before it sent SIGTERM; tearing down ZeroMQ under a thread that is
    still using it would only risk a crash or a hang. Spans not yet exported go first,
    where tracing is on."""
    tracing.flush(TRACES_FLUSH_S)
    os._exit(0)
