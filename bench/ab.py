"""Paired comparison of servers on this noisy machine: every server runs at once (each
idle while another is measured), and short loads are taken from each in turn, round
after round, in a rotating order. The figures that count are each round's ratio to the
first server: a drift of the machine's speed (which moves one server's requests/s by
a quarter between minutes here) hits both sides of a ratio alike, where measuring one
server after the other would read it as a difference between them.

Halfway through the rounds every server is stopped and started again in the reverse
order: a control of three identical servers read the first one started about 6% low
(bench/results/serving-path.md), and starting each side first for half the rounds
cancels that whatever its cause.

Reports per load: each server's median requests/s and p50, the median (and range) of its
per-round ratio to the first, and the median CPU per request of each of its processes.

Usage:
    .venv/bin/python -m bench.ab --model-dir bench/out/models/null --loads 1x16,1x64 --rounds 8 \\
        --cmd "sh -c 'cd /tmp/base && exec /work/main/.venv/bin/python -m infinity serve --port {port} \\
        --model {model_dir} --served-name all-MiniLM-L6-v2'" --name base \\
        --cmd ".venv/bin/python -m infinity serve --port {port} --model {model_dir} \\
        --served-name all-MiniLM-L6-v2" --name head
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
from collections.abc import Iterator

from bench.loadgen import DEFAULT_MODEL, LoadConfig
from bench.run import (OUT_DIR, REPO, free_port, load_with_cpu, parse_loads, smoke_test, start_run, stop_server,
                       wait_healthy)


@contextlib.contextmanager
def _servers(commands: list[tuple[str, str]], model_dir: str, stamp: str,
             health_timeout: float) -> Iterator[list[tuple[str, str, int]]]:
    """Start every (name, command) in its own process group, one after the other (so the
    start-up measurements of one do not run beside another's); yield (name, url, pgid)
    of each once all are healthy; stop them all on leaving."""
    started: list[subprocess.Popen[bytes]] = []
    running = []
    try:
        for name, command in commands:
            port = free_port()
            argv = [part.format(port=port, model_dir=model_dir) for part in shlex.split(command)]
            log = OUT_DIR / f"{stamp}-ab-{name}.log"
            print(f"== {name}\n$ {shlex.join(argv)}\n  log: {log}", flush=True)
            with log.open("wb") as output:
                server = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=output,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            started.append(server)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, server, health_timeout)
            smoke_test(url, DEFAULT_MODEL)
            running.append((name, url, server.pid))
        yield running
    finally:
        for server in started:
            stop_server(server)


def halves(commands: list[tuple[str, str]], rounds: int) -> list[tuple[list[tuple[str, str]], range]]:
    """The first half of the rounds with the servers started in the listed order, the rest
    with them started in the reverse order."""
    first = (rounds + 1) // 2
    plan = [(commands, range(first))]
    if rounds > first:
        plan.append((commands[::-1], range(first, rounds)))
    return plan


def _measure(config: LoadConfig, pgid: int) -> dict:
    """One load against one server: its requests/s, p50 and CPU per request by process."""
    result, per_request = load_with_cpu(config, pgid)
    if result.errors:
        raise RuntimeError(f"{result.errors} errors, first: {result.first_error}")
    return {"requests_per_s": result.requests_per_s, "p50_ms": result.p50_ms, "cpu_us": per_request}


def summarize(rounds: list[dict[str, dict]], names: list[str]) -> list[dict]:
    """Per server over the rounds of one load: median requests/s and p50, the median, lowest
    and highest of its per-round ratio to the first server, median CPU per request by process."""
    rows = []
    for name in names:
        ratios = [one[name]["requests_per_s"] / one[names[0]]["requests_per_s"] for one in rounds]
        processes = sorted({process for one in rounds for process in one[name]["cpu_us"]})
        rows.append({
            "name": name,
            "requests_per_s": statistics.median(one[name]["requests_per_s"] for one in rounds),
            "p50_ms": statistics.median(one[name]["p50_ms"] for one in rounds),
            "ratio": statistics.median(ratios), "ratio_low": min(ratios), "ratio_high": max(ratios),
            "cpu_us": {process: statistics.median(one[name]["cpu_us"].get(process, 0) for one in rounds)
                       for process in processes},
        })
    return rows


def markdown(load: str, rows: list[dict], rounds: int) -> str:
    lines = [f"### {load}, {rounds} rounds", "",
             "| server | requests/s | p50 ms | ratio to the first (range) | CPU us per request |",
             "| --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        processes = ", ".join(f"{process} {us:.0f}" for process, us in row["cpu_us"].items())
        lines.append(f"| {row['name']} | {row['requests_per_s']:.1f} | {row['p50_ms']:.1f} | {row['ratio']:.3f} "
                     f"({row['ratio_low']:.3f}-{row['ratio_high']:.3f}) | {processes} |")
    return "\n".join(lines)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cmd", action="append", required=True, help="server command ({port}, {model_dir})")
    parser.add_argument("--name", action="append", default=[])
    parser.add_argument("--model-dir", default="", help="substituted for {model_dir}")
    parser.add_argument("--loads", default="1x16,1x64", help="BATCHxCONCURRENCY list")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=1.0, help="discarded seconds per load")
    parser.add_argument("--health-timeout", type=float, default=120.0)
    args = parser.parse_args()
    if len(args.cmd) < 2:
        parser.error("give at least two --cmd")
    args.name += [f"server-{index + 1}" for index in range(len(args.name), len(args.cmd))]
    return args


def main() -> None:
    args = _parse_args()
    stamp = start_run()
    names = args.name[:len(args.cmd)]
    results: dict[str, list[dict[str, dict]]] = {}
    commands = list(zip(names, args.cmd))
    for start_order, round_indices in halves(commands, args.rounds):
        with _servers(start_order, args.model_dir, stamp, args.health_timeout) as servers:
            for round_index in round_indices:
                order = servers[round_index % len(servers):] + servers[:round_index % len(servers)]
                for shape in parse_loads(args.loads):
                    one_round = {}
                    for name, url, pgid in order:
                        config = LoadConfig(url=url, concurrency=shape.concurrency, batch=shape.batch,
                                            duration=args.duration, warmup=args.warmup)
                        one_round[name] = _measure(config, pgid)
                    results.setdefault(shape.label, []).append(one_round)
                    print(f"  round {round_index + 1}, {shape.label}: " + ", ".join(
                        f"{name} {one_round[name]['requests_per_s']:.0f}" for name in names), flush=True)
    report = "\n\n".join(markdown(load, summarize(rounds, names), len(rounds)) for load, rounds in results.items())
    print(f"\n{report}")
    (OUT_DIR / f"{stamp}-ab.md").write_text(report + "\n")
    (OUT_DIR / f"{stamp}-ab.json").write_text(json.dumps({"args": vars(args), "rounds": results}, indent=2) + "\n")
    print(f"\nsaved bench/out/{stamp}-ab.md and .json")


if __name__ == "__main__":
    main()
