"""The scheduler's own cost: milliseconds per batch cut with N inputs waiting (requests of 32
inputs of 5-250 tokens, a pass overhead of 19 tokens, lanes enough that nothing finishes),
in process, no model. A checkout's scheduler is measured with `--checkout DIR` (a worktree
of another commit), so a change to it can be compared in one run.

Usage: .venv/bin/python -m bench.scheduler_cut [--checkout /tmp/base] [--waiting 256 1024 4096]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np

CUTS = 50


def ms_per_cut(scheduler_module: object, waiting: int) -> float:
    rng = np.random.default_rng(0)
    scheduler = scheduler_module.Scheduler()  # type: ignore[attr-defined]
    scheduler.add_queue("m", scheduler_module.QueuePolicy(16384, 64, 19, lanes=1000))  # type: ignore[attr-defined]
    for request in range(waiting // 32):
        lengths = [int(length) for length in rng.integers(5, 250, 32)]
        scheduler.submit(request, "m", list(range(request * 32, request * 32 + 32)), lengths, [None] * 32)
    start = time.perf_counter()
    for _ in range(CUTS):
        scheduler.next_batch()
    return (time.perf_counter() - start) / CUTS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", help="measure the scheduler of this checkout instead")
    parser.add_argument("--waiting", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()
    if args.checkout:
        sys.path.insert(0, args.checkout)
        for name in [name for name in sys.modules if name == "workers" or name.startswith("workers.")]:
            del sys.modules[name]
    module = importlib.import_module("workers.inference.scheduler")
    print(f"scheduler: {module.__file__}")
    for waiting in args.waiting:
        print(f"{waiting:6d} waiting: {ms_per_cut(module, waiting):.3f} ms per cut")


if __name__ == "__main__":
    main()
