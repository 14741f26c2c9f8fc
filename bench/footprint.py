"""What a deployment pays, ours against the peer in one run: seconds from start to
`/health` 200 with an empty cache (a new pod) and with the cache the first start left,
and the memory of the whole process group (PSS: shared pages split between the processes
that map them, so a group's sum counts each page once), idle and after load, by process.

For each target the server is started twice on one fresh cache directory (ours reads
`INFINITY_CACHE_DIR`; the peer keeps nothing between starts). Ours serves at once where
its models are not prepared and hands over in the background (`[server] prepare`): the
first start is also timed to its handover, and its memory measured after it. Memory is
read idle (after `--settle` seconds), then after `--load` seconds of single texts from 16
clients and as long of batches of 32 from 8 clients.

Usage:
    .venv/bin/python -m bench.footprint --targets ours,infinity-ct2,infinity-torch
    .venv/bin/python -m bench.footprint --targets ours --model-dir bench/out/models/bert-base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.loadgen import DEFAULT_MODEL, LoadConfig, run_load
from bench.run import OUT_DIR, REPO, TARGETS, free_port, model_dir, start_run, stop_server, wait_healthy

_PROC = Path("/proc")
HANDOVER_TIMEOUT_S = 600.0


def pss_by_name(pgid: int) -> dict[str, int]:
    """PSS in KiB of each process of group `pgid`, summed by command name."""
    found: dict[str, int] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            name = (entry / "comm").read_text().strip()
            rollup = (entry / "smaps_rollup").read_text()
        except (OSError, ProcessLookupError):
            continue
        pss = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
        found[name] = found.get(name, 0) + pss
    return found


def _handed_over(url: str) -> bool:
    """Whether every model of our server at `url` is served prepared."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
        return all(card.get("prepared", True) for card in json.loads(answer.read())["data"])


def _load(url: str, seconds: float) -> dict[str, float]:
    """Single texts from 16 clients, then batches of 32 from 8: requests/s of each."""
    rates = {}
    for concurrency, batch in ((16, 1), (8, 32)):
        result = asyncio.run(run_load(LoadConfig(url=url, model=DEFAULT_MODEL, concurrency=concurrency, batch=batch,
                                                 duration=seconds, warmup=1.0)))
        rates[f"{batch}x{concurrency}"] = result.requests / seconds
    return rates


def measure(target: str, folder: Path, cache: Path, args: argparse.Namespace, stamp: str) -> dict:
    """Both starts of `target` on `cache`, and the memory of the first (after any handover)."""
    spec = TARGETS[target]
    report: dict = {"target": target}
    for start in ("empty cache", "cache kept"):
        port = free_port()
        argv = [part.format(port=port, model_dir=folder) for part in spec.argv]
        if target == "ours":
            argv += ["--model", str(folder), "--served-name", DEFAULT_MODEL, "--host", "127.0.0.1"]
        env = {**os.environ, **spec.env, "INFINITY_CACHE_DIR": str(cache)}
        log = OUT_DIR / f"{stamp}-footprint-{target}-{start.replace(' ', '-')}.log"
        print(f"== {target}, {start}\n$ {shlex.join(argv)}\n  log: {log}", flush=True)
        url = f"http://127.0.0.1:{port}"
        with log.open("wb") as output:
            server = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            try:
                began = time.monotonic()
                wait_healthy(url, server, args.health_timeout)
                report[f"healthy s ({start})"] = round(time.monotonic() - began, 1)
                if target == "ours":
                    while not _handed_over(url):
                        if time.monotonic() - began > HANDOVER_TIMEOUT_S:
                            raise RuntimeError("not handed over")
                        time.sleep(0.5)
                    report[f"prepared s ({start})"] = round(time.monotonic() - began, 1)
                if start == "empty cache":
                    time.sleep(args.settle)
                    report["PSS idle KiB"] = pss_by_name(server.pid)
                    report["requests/s"] = _load(url, args.load)
                    report["PSS loaded KiB"] = pss_by_name(server.pid)
            finally:
                stop_server(server)
    return report


TIME_ROWS = ("healthy s (empty cache)", "prepared s (empty cache)", "healthy s (cache kept)")


def _table(reports: list[dict]) -> str:
    """The reports side by side: start times, then PSS idle and loaded (the group's, and
    each process's by name), then the loads' requests/s."""
    rows = ["| | " + " | ".join(r["target"] for r in reports) + " |", "| --- |" + " ---: |" * len(reports)]
    rows += [f"| {key} | " + " | ".join(str(r.get(key, "—")) for r in reports) + " |" for key in TIME_ROWS]
    for key in ("PSS idle KiB", "PSS loaded KiB"):
        rows.append(f"| {key[:-4]} MB, group | " + " | ".join(f"{sum(r[key].values()) / 1024:,.0f}" for r in reports)
                    + " |")
        for name in sorted({n for r in reports for n in r[key]}):
            rows.append(f"| &nbsp; {name} | " + " | ".join(
                f"{r[key][name] / 1024:,.0f}" if name in r[key] else "—" for r in reports) + " |")
    rows.append("| requests/s (1x16, 32x8) | " + " | ".join(
        " / ".join(f"{rate:,.0f}" for rate in r["requests/s"].values()) for r in reports) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="ours,infinity-ct2,infinity-torch")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before the idle reading")
    parser.add_argument("--load", type=float, default=15.0, help="seconds of each of the two loads")
    parser.add_argument("--health-timeout", type=float, default=600.0)
    args = parser.parse_args()
    folder = (args.model_dir or model_dir()).resolve()
    stamp = start_run()
    reports = []
    for target in args.targets.split(","):
        with tempfile.TemporaryDirectory(prefix="footprint-cache-") as cache:
            reports.append(measure(target, folder, Path(cache), args, stamp))
    table = _table(reports)
    print(f"\n{table}")
    (OUT_DIR / f"{stamp}-footprint.json").write_text(json.dumps(reports, indent=1))
    (OUT_DIR / f"{stamp}-footprint.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
