"""The scheduler's own cost: milliseconds per batch cut with N inputs waiting (requests of 32
inputs of 5-250 tokens, a pass overhead of 19 tokens, lanes enough that nothing finishes),
in process, no model; all at one priority, and mixed: the same at priority 1 with a query
(one input, priority 0) arriving before each cut, so every cut is a query's among the
bulk. A checkout's scheduler is measured with `--checkout DIR` (a worktree of another
commit), so a change to it can be compared in one run.

Usage: .venv/bin/python -m bench.scheduler_cut [--checkout /tmp/base] [--waiting 256 1024 4096]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np

CUTS = 50


def ms_per_cut(scheduler_module: object, waiting: int, mixed: bool) -> float:
    rng = np.random.default_rng(0)
    scheduler = scheduler_module.Scheduler()  # type: ignore[attr-defined]
    scheduler.add_queue("m", scheduler_module.QueuePolicy(16384, 64, 19, lanes=1000))  # type: ignore[attr-defined]
    requests = waiting // 32
    for request in range(requests):
        lengths = [int(length) for length in rng.integers(5, 250, 32)]
        scheduler.submit(request, "m", list(range(request * 32, request * 32 + 32)), lengths, [None] * 32,
                         int(mixed))
    start = time.perf_counter()
    for cut in range(CUTS):
        if mixed:
            query = requests + cut
            scheduler.submit(query, "m", [query * 32], [int(rng.integers(5, 40))], [None], 0)
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
        print(f"{waiting:6d} waiting: {ms_per_cut(module, waiting, False):.3f} ms per cut, "
              f"mixed {ms_per_cut(module, waiting, True):.3f} ms")


if __name__ == "__main__":
    main()
