"""What every child process does first: die with its parent, leave Ctrl-C to the
supervisor, take its CPUs, set up logging, and open its two sockets."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

import zmq
from tqdm import tqdm

from infinity.shared import protocol

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# How long a child that ends of itself (it could not start) waits for its last message,
# `StartupFailed`, to reach the front end: with no linger ZeroMQ drops what is unsent, and
# the front end would see only an exit without its reason.
LAST_MESSAGE_LINGER_MS = 2000


def start_child(args: protocol.WorkerArgs) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """Prepare this process; return its sockets (`open_sockets`)."""
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
    return open_sockets(args)


def open_sockets(args: protocol.WorkerArgs) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """(context, inbox PULL bound at the child's endpoint, PUSH to the front end)."""
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.bind(args.endpoint)
    to_front = context.socket(zmq.PUSH)
    to_front.setsockopt(zmq.LINGER, 0)
    to_front.setsockopt(zmq.SNDHWM, 0)
    to_front.connect(args.front_endpoint)
    return context, inbox, to_front


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Leave at once: the front end owns every shared resource (arenas, socket files) and
    the drain happened before it sent SIGTERM; tearing down ZeroMQ under a thread that is
    still reading from it would only risk a crash or a hang."""
    os._exit(0)
