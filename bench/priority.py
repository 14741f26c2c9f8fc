"""Queries beside ingest: what a single-text client's latency becomes while bulk clients
send batches of 32 to the same server, at the same priority and with the bulk at
priority 1, and what the bulk keeps of its throughput.

One server (started here from `--server-cwd`, by default this checkout), four phases of
`--duration` measured seconds each, nothing else running:

1. the query client alone: one client, one corpus text per request, back to back;
2. the bulk alone: `--bulk-clients` clients (8) sending `--bulk-batch` (32) texts each;
3. both, the bulk at priority 0 (as the query);
4. both, the bulk at priority 1.

The bulk clients run in a process of their own, so decoding their answers never delays
the query client's. The targets (issue 27): beside the bulk, the query's p50 at most 3x
its p50 alone at equal priority and 1.5x with the bulk at priority 1, and the bulk's
sentences/s at least 0.9 of its own alone.

`--server-cwd` runs the server from another checkout with this venv's Python, so the
code before a change can be measured in the same run (`git worktree add /tmp/before <ref>`).

With `--bulk-job`, the bulk is the corpus job sent to the server instead
(`python -m infinity embed ROWS.parquet OUT --url ... --priority P`, its default priority 1
in phase 4): its rows/s is read from the server's metrics (inputs queued at its priority)
over the query's window.

Usage (from the repository root):
    .venv/bin/python -m bench.priority --json bench/out/priority.json
    .venv/bin/python -m bench.priority --bulk-job bench/out/corpus/corpus-100000.parquet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import requests

from bench.cpu import wait_idle
from bench.large_inputs import REPO, print_report, start_server
from bench.loadgen import DEFAULT_MODEL, Corpus, Window, check_response, closed_loop
from workers.inference.corpus import sentences

WARMUP_S = 3.0


def _requests(texts: list[str], batch: int, priority: int | None) -> Callable[[], tuple[dict, Callable]]:
    """Bodies of `batch` consecutive corpus texts, at `priority` (None: no field)."""
    corpus = Corpus(texts)

    def check(payload: object) -> None:
        check_response(payload, batch, "float")

    def next_request() -> tuple[dict, Callable]:
        body: dict[str, object] = {"model": DEFAULT_MODEL, "input": corpus.take(batch)}
        if priority is not None:
            body["priority"] = priority
        return body, check

    return next_request


def _summary(window: Window, batch: int, duration: float) -> dict[str, float]:
    return {"requests": window.good, "errors": window.errors, "sentences/s": round(window.good * batch / duration, 1),
            "p50 ms": round(window.percentile(50), 2), "p99 ms": round(window.percentile(99), 2)}


def _run(url: str, texts: list[str], batch: int, concurrency: int, priority: int | None,
         duration: float, think: float = 0.0) -> Window:
    return asyncio.run(closed_loop(url, "/v1/embeddings", _requests(texts, batch, priority),
                                   concurrency=concurrency, duration=duration, warmup=WARMUP_S, timeout=120,
                                   think=think))


def _bulk_process(url: str, clients: int, batch: int, priority: int | None, duration: float,
                  results: multiprocessing.Queue) -> None:
    window = _run(url, sentences(20_000, 1), batch, clients, priority, duration)
    results.put(_summary(window, batch, duration))


def phase(url: str, duration: float, query: bool, bulk_priority: int | None, clients: int,
          batch: int, think: float = 0.0) -> dict[str, object]:
    """One phase: the query client, the bulk clients (`bulk_priority`, None: none), or both."""
    report: dict[str, object] = {}
    results: multiprocessing.Queue = multiprocessing.Queue()
    bulk = None
    if bulk_priority is not None:
        bulk = multiprocessing.Process(target=_bulk_process, args=(url, clients, batch, bulk_priority, duration,
                                                                   results))
        bulk.start()
    if query:
        # Its window lies inside the bulk's: the bulk's warm-up covers its start.
        report["query"] = _query(url, duration, think)
    if bulk is not None:
        report["bulk"] = results.get(timeout=duration + 300)
        bulk.join(60)
    return report


def _query(url: str, duration: float, think: float) -> dict[str, float]:
    return _summary(_run(url, sentences(20_000, 0), 1, 1, 0, duration, think), 1, duration)


def _inputs_at(url: str, priority: int) -> float:
    """Inputs the server has queued at `priority` so far (its queue-wait histogram's count)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "infinity_queue_duration_seconds_count" and sample.labels["priority"] == str(priority))


def job_phase(url: str, duration: float, query: bool, rows: Path, priority: int | None,
              think: float = 0.0) -> dict[str, object]:
    """One phase of `--bulk-job`: the query client, the corpus job sent to the server at
    `priority` (None: no job), or both; the job's rows/s over the query's window."""
    report: dict[str, object] = {}
    job = None
    with tempfile.TemporaryDirectory() as out:
        if priority is not None:
            command = [sys.executable, "-m", "infinity", "embed", str(rows), f"{out}/vectors", "--url", url,
                       "--priority", str(priority), "--quiet"]
            job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(WARMUP_S + 5)  # its start: reading the first unit, the model's card
        try:
            before, started = (_inputs_at(url, priority), time.monotonic()) if job else (0.0, 0.0)
            if query:
                report["query"] = _query(url, duration, think)
            else:
                time.sleep(duration)
            if job is not None:
                seconds = time.monotonic() - started
                report["bulk"] = {"sentences/s": round((_inputs_at(url, priority) - before) / seconds, 1)}
                if job.poll() is not None:
                    raise RuntimeError(f"the corpus job ended early (exit {job.returncode}): give more rows")
        finally:
            if job is not None:
                job.terminate()
                job.wait(60)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--bulk-clients", type=int, default=8)
    parser.add_argument("--bulk-batch", type=int, default=32)
    parser.add_argument("--query-think", type=float, default=0.0,
                        help="seconds the query client waits after each answer (default 0: back to back)")
    parser.add_argument("--server-cwd", type=Path, default=REPO)
    parser.add_argument("--config", type=Path,
                        help="a models.toml serving all-MiniLM-L6-v2 otherwise (another engine or dtype)")
    parser.add_argument("--port", type=int, default=7322)
    parser.add_argument("--bulk-job", type=Path, help="a Parquet file of texts: the bulk is `embed --url` over it "
                                                      "(enough rows to outlast a phase)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    log = Path(f"/tmp/priority-server-{args.port}.log")
    server = start_server(args.server_cwd, args.port, log, args.config)
    url = f"http://127.0.0.1:{args.port}"
    report: dict[str, object] = {"server": str(args.server_cwd), "config": str(args.config), "duration s": args.duration,
                                 "bulk": f"{args.bulk_clients}x{args.bulk_batch}", "query think s": args.query_think}
    if args.bulk_job is not None:
        report["bulk"] = f"embed {args.bulk_job.name} --url"
    # The bulk alone at the priority it has beside the query in the last phase.
    phases = {"query alone": (True, None), "bulk alone": (False, 1 if args.bulk_job else 0),
              "both, bulk at priority 0": (True, 0), "both, bulk at priority 1": (True, 1)}
    try:
        for name, (query, bulk_priority) in phases.items():
            wait_idle(10.0)
            report[name] = (job_phase(url, args.duration, query, args.bulk_job, bulk_priority, args.query_think)
                            if args.bulk_job else
                            phase(url, args.duration, query, bulk_priority, args.bulk_clients, args.bulk_batch,
                                  args.query_think))
            print(name, json.dumps(report[name]), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    alone_p50 = report["query alone"]["query"]["p50 ms"]  # type: ignore[index]
    bulk_alone = report["bulk alone"]["bulk"]["sentences/s"]  # type: ignore[index]
    report["ratios"] = {name: {"query p50 / alone": round(report[name]["query"]["p50 ms"] / alone_p50, 2),  # type: ignore[index]
                               "bulk sentences/s / alone": round(report[name]["bulk"]["sentences/s"] / bulk_alone, 3),  # type: ignore[index]
                               # The machine's whole output: what the query client's own work takes from the bulk.
                               "(bulk + query) sentences/s / bulk alone": round(
                                   (report[name]["bulk"]["sentences/s"] + report[name]["query"]["sentences/s"])  # type: ignore[index]
                                   / bulk_alone, 3)}
                        for name in ("both, bulk at priority 0", "both, bulk at priority 1")}
    report["finished"] = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    print_report(report, args.json)


if __name__ == "__main__":
    main()
