"""Benchmark driver: in-process ceiling, then each server under the standard loads.

One run, on this machine:

1. the ceiling (``bench.ceiling``) in a child process, so its model and threads
   are gone before any server starts, and, for each ``--engine-ceiling``, that
   engine's in-process figures (``bench.engines``), likewise in a child;
2. for each target, in turn: start the server on a free loopback port in its own
   process group, wait for ``GET /health`` to answer 200, check one embeddings
   request, run every load shape with ``bench.loadgen``, then stop the whole
   process group (SIGTERM, SIGKILL after a grace period), also on errors,
   Ctrl-C or SIGTERM, so no server outlives the run;
3. print a markdown table (sentences/s, p50, p99, ratio to the ceiling's
   batch-32 sentences/s; with engine ceilings, a second table of each load against
   them, and a lone client's median latency against each engine's time for one
   corpus text at a time) and save it with the raw JSON under ``bench/out/``.

The machine has few cores and may be shared, so before the ceiling and before
each load the driver waits (``--idle-wait``) for other processes to leave the
CPU, redoes a measurement (``--retries``) during which processes outside the
benchmark used more than ``--max-noise`` of the CPU, keeps the least disturbed
one, and reports that share in every row (``bench.cpu``): rows where it is not
near 0% are not trustworthy.

Targets: ``ours`` (``.venv/bin/python -m infinity serve --port P``),
``infinity-torch`` and ``infinity-ct2`` (the peer, from ``bench/.venv-infinity``,
see ``bench/setup_infinity.sh``), or any command given with ``--cmd``
(``{port}`` and ``{model_dir}`` are substituted).

The load generator runs inside this process and shares the machine's cores
with the server, as a real client on the same host would. Each load also prints
the CPU time per request of every server process (by name: the front end is
``python``) and of the load generator, over the measured seconds.

Usage:
    .venv/bin/python -m bench.run --target infinity-torch --target infinity-ct2
    .venv/bin/python -m bench.run --target ours --duration 20
    .venv/bin/python -m bench.run --target ours --target infinity-ct2 --engine-ceiling ctranslate2:float32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TypeVar

from bench import cpu
from bench.loadgen import DEFAULT_MODEL, LoadConfig, LoadResult, check_response, run_load
from infinity.folders.resolve import packaged_model_folder as model_dir

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
INFINITY_EMB = REPO / "bench" / ".venv-infinity" / "bin" / "infinity_emb"
DEFAULT_LOADS = "1x1,1x16,1x64,32x8"
LOAD_GENERATOR = "load generator"  # its CPU, beside the server's processes

# The peer is started the way a user would serve this model on CPU, with the
# routes under /v1 like ours, bound to loopback, and without per-request access
# logging (it costs CPU that the 2-core machine does not have to spare).
_INFINITY_ARGS = [
    str(INFINITY_EMB), "v2",
    "--model-id", "{model_dir}",
    "--served-model-name", DEFAULT_MODEL,
    "--device", "cpu",
    "--batch-size", "32",
    "--host", "127.0.0.1",
    "--port", "{port}",
    "--url-prefix", "/v1",
    "--log-level", "warning",
]  # fmt: skip
# No telemetry and no hub look-ups: the model is a local folder.
_INFINITY_ENV = {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Target:
    """A server to benchmark: argv template (``{port}``, ``{model_dir}``) and extra env."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


TARGETS = {
    "ours": Target("ours", [str(REPO / ".venv" / "bin" / "python"), "-m", "infinity", "serve",
                            "--port", "{port}"]),
    "infinity-torch": Target("infinity-torch", [*_INFINITY_ARGS, "--engine", "torch"],
                             _INFINITY_ENV),
    "infinity-ct2": Target("infinity-ct2", [*_INFINITY_ARGS, "--engine", "ctranslate2"],
                           _INFINITY_ENV),
}  # fmt: skip


@dataclass(frozen=True)
class LoadShape:
    """Texts per request and number of concurrent clients."""

    batch: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"batch {self.batch}, c{self.concurrency}"


@dataclass(frozen=True)
class Measured:
    """One load's result, the share of the machine's CPU that other processes used just
    before it (``others_before``) and while it ran (``others_during``), and the CPU each
    of the server's processes (by name) and the load generator used per request over the
    measured seconds."""

    load: LoadResult
    others_before: float
    others_during: float
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)


@dataclass
class TargetReport:
    """Outcome of one target: its command, its results, or why it failed."""

    name: str
    command: str
    log: str
    results: list[Measured] = field(default_factory=list)
    error: str | None = None


def parse_pairs(spec: str) -> list[tuple[int, int]]:
    """Parse ``"1x1,1x16,32x8"`` into (count, concurrency) pairs, both positive."""
    pairs = []
    for item in spec.split(","):
        count, _, concurrency = item.strip().partition("x")
        pairs.append((int(count), int(concurrency)))
    if any(count < 1 or concurrency < 1 for count, concurrency in pairs):
        raise ValueError(f"bad load spec {spec!r}")
    return pairs


def parse_loads(spec: str) -> list[LoadShape]:
    """``"1x1,1x16,32x8"``: BATCHxCONCURRENCY, comma separated."""
    return [LoadShape(batch, concurrency) for batch, concurrency in parse_pairs(spec)]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_run() -> str:
    """Set up a benchmark's run: SIGTERM ends it through its cleanups (servers stopped),
    bench/out exists; return the run's UTC stamp, which names what it writes there."""
    signal.signal(signal.SIGTERM, _raise_exit)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def add_measurement_args(parser: argparse.ArgumentParser, duration: float = 20.0, warmup: float = 3.0,
                         ceiling_duration: float = 20.0, health_timeout: float = 300.0) -> None:
    """The options every benchmark of a server against an in-process ceiling takes: how
    long each load and the ceiling are measured, the ceiling's threads, and the quiet-CPU
    options (`add_quiet_cpu_args`)."""
    parser.add_argument("--duration", type=float, default=duration, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=warmup, help="discarded seconds per load")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="ceiling threads")
    parser.add_argument("--ceiling-duration", type=float, default=ceiling_duration)
    add_quiet_cpu_args(parser, health_timeout)


def add_quiet_cpu_args(parser: argparse.ArgumentParser, health_timeout: float = 300.0) -> None:
    """The options every benchmark takes for measuring on a quiet machine (`wait_quiet`,
    `least_disturbed`) and for a server's start."""
    parser.add_argument("--health-timeout", type=float, default=health_timeout, help="seconds")
    parser.add_argument("--idle-wait", type=float, default=120.0,
                        help="before the ceiling and each load, wait up to this many seconds for a quiet CPU")
    parser.add_argument("--max-noise", type=float, default=0.05,
                        help="share of the CPU other processes may use during a measurement before it is redone")
    parser.add_argument("--retries", type=int, default=2, help="redo a disturbed measurement")


def wait_quiet(args: argparse.Namespace, pgid: int | None = None) -> float:
    """Wait (up to ``--idle-wait`` s) for other processes to leave the CPU; warn if they don't.

    ``pgid`` is the process group of the server under test, which is not "other".
    """
    share = cpu.wait_idle(args.idle_wait, pgid, threshold=args.max_noise)
    if share > args.max_noise:
        print(f"  WARNING: other processes use {share:.0%} of the CPU; numbers will be low",
              flush=True)  # fmt: skip
    return share


def least_disturbed(
    args: argparse.Namespace, measure: Callable[[], T], noise: Callable[[T], float]
) -> T:
    """Repeat ``measure`` (at most ``--retries`` more times) while other processes used
    more than ``--max-noise`` of the CPU during it; return the least disturbed run."""
    best = measure()
    for _ in range(args.retries):
        if noise(best) <= args.max_noise:
            break
        print(f"  others used {noise(best):.0%} of the CPU meanwhile; measuring again", flush=True)
        result = measure()
        if noise(result) < noise(best):
            best = result
    return best


def run_ceiling(args: argparse.Namespace) -> dict[str, float]:
    """Run ``bench.ceiling`` in a child process and return its JSON result.

    The result gains ``others_before`` and ``others_during``: the share of the CPU that
    other processes used before and during the measurement.
    """
    command = [
        sys.executable, "-m", "bench.ceiling", "--json",
        "--threads", str(args.threads),
        "--device", args.device,
        "--duration", str(args.ceiling_duration),
        "--chunk", str(args.ceiling_chunk),
        "--model", args.model_dir,
    ]  # fmt: skip
    return measure_child(args, command)


def run_engine_ceiling(args: argparse.Namespace, choice: str) -> dict[str, float]:
    """Run ``bench.engines`` for ENGINE:DTYPE ``choice`` in a child process and return its
    figures (``bench.engines.COLUMNS``), with the CPU shares of ``measure_child``."""
    command = [sys.executable, "-m", "bench.engines", "--json", "--engine", choice, "--threads", str(args.threads),
               "--model", args.model_dir]
    return measure_child(args, command)


def child_answer(command: list[str]) -> dict:
    """Run a benchmark child that prints one JSON object as its last line; return it."""
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_child(args: argparse.Namespace, command: list[str]) -> dict[str, float]:
    """Run ``command`` (a measurement that prints one JSON object as its last line) in a
    child process on a quiet machine, redone while others disturbed it (``--idle-wait``,
    ``--max-noise``, ``--retries``); return its JSON with ``others_before`` and
    ``others_during`` added."""
    print(f"$ {shlex.join(command)}", flush=True)
    return least_disturbed(args, partial(_ceiling_once, args, command), _ceiling_noise)


def _ceiling_noise(result: dict[str, float]) -> float:
    return result["others_during"]


def _ceiling_once(args: argparse.Namespace, command: list[str]) -> dict[str, float]:
    others_before = wait_quiet(args)
    with subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        before = cpu.sample(child.pid)
        try:
            stdout, _ = child.communicate(timeout=900)
        finally:
            if child.poll() is None:
                child.kill()
        after = cpu.sample(child.pid)
    if child.returncode != 0:
        raise RuntimeError(f"ceiling failed with exit code {child.returncode}")
    result: dict[str, float] = json.loads(stdout.strip().splitlines()[-1])
    result["others_before"] = others_before
    result["others_during"] = cpu.other_share(before, after)
    return result


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll ``GET url/health`` until it answers 200; raise if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with code {server.returncode} before /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {timeout:g} s")


@dataclass(frozen=True)
class ConfiguredServer:
    """Our server serving a models.toml written to bench/out/<stamp>-<label>-models.toml,
    on a free port, its output in bench/out/<stamp>-<label>-ours.log."""

    url: str
    argv: list[str]
    config: str
    log: Path

    @classmethod
    def prepare(cls, config: str, label: str, stamp: str) -> ConfiguredServer:
        """Write the configuration and print how the server will be started."""
        port = free_port()
        config_path = OUT_DIR / f"{stamp}-{label}-models.toml"
        config_path.write_text(config)
        argv = [str(REPO / ".venv" / "bin" / "python"), "-m", "infinity", "serve", "--config", str(config_path),
                "--port", str(port), "--host", "127.0.0.1"]
        server = cls(f"http://127.0.0.1:{port}", argv, config, OUT_DIR / f"{stamp}-{label}-ours.log")
        print(f"\n== ours\n$ {server.command}\n  config: {config_path}\n  log: {server.log}", flush=True)
        return server

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @contextlib.contextmanager
    def running(self, health_timeout: float) -> Iterator[subprocess.Popen[bytes]]:
        """Start it in its own process group, wait until healthy, stop it (and its
        children) on leaving, errors and Ctrl-C included."""
        with self.log.open("wb") as log:
            server = subprocess.Popen(self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            try:
                started = time.monotonic()
                wait_healthy(self.url, server, health_timeout)
                print(f"  healthy after {time.monotonic() - started:.1f} s", flush=True)
                yield server
            finally:
                stop_server(server)


def smoke_test(url: str, model: str) -> None:
    """Send one small embeddings request and check the answer's shape."""
    body = json.dumps({"model": model, "input": ["hello world", "a second text"]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/embeddings", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        check_response(json.loads(response.read()), 2, "float")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(server: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """Stop the server's whole process group (its workers too): SIGTERM, then SIGKILL
    to whatever is left of the group after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    while _group_alive(server.pid) and time.monotonic() < deadline:
        server.poll()  # reap the leader, or its zombie keeps the group alive
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _load_noise(measured: Measured) -> float:
    return measured.others_during


def _load_once(args: argparse.Namespace, config: LoadConfig, pgid: int) -> Measured:
    others_before = wait_quiet(args, pgid)
    before = cpu.sample(pgid)
    result, per_request = load_with_cpu(config, pgid)
    return Measured(result, others_before, cpu.other_share(before, cpu.sample(pgid)), per_request)


def load_with_cpu(config: LoadConfig, pgid: int) -> tuple[LoadResult, dict[str, float]]:
    """Run one load against the server of process group `pgid`; return its result and the
    CPU microseconds per request of each server process (by name) and of the load
    generator over the measured seconds."""
    window: list[dict[str, int]] = []  # CPU ticks by process at the measured seconds' start and end

    def sample_ticks() -> None:
        window.append({**cpu.ticks_by_name(pgid), LOAD_GENERATOR: cpu.own_ticks()})

    timers = [threading.Timer(at, sample_ticks) for at in (config.warmup, config.warmup + config.duration)]
    for timer in timers:
        timer.start()
    try:
        result = asyncio.run(run_load(config))
    finally:
        for timer in timers:
            timer.cancel()  # a load cut short samples no more
            timer.join()
    return result, cpu.microseconds_per_request(*window, result.requests) if len(window) == 2 else {}


def bench_target(
    target: Target, shapes: list[LoadShape], args: argparse.Namespace, stamp: str
) -> TargetReport:
    """Start ``target``, run every load shape against it, stop it."""
    port = free_port()
    argv = [a.format(port=port, model_dir=args.model_dir) for a in target.argv]
    log_path = OUT_DIR / f"{stamp}-{target.name}.log"
    print(f"\n== {target.name}\n$ {shlex.join(argv)}\n  log: {log_path}", flush=True)
    report = TargetReport(target.name, shlex.join(argv), str(log_path.relative_to(REPO)))
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        try:
            server = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, **target.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            report.error = f"cannot start: {exc}"
            print(f"  FAILED: {report.error}", flush=True)
            return report
        try:
            started = time.monotonic()
            wait_healthy(url, server, args.health_timeout)
            smoke_test(url, args.model)
            print(f"  healthy after {time.monotonic() - started:.1f} s", flush=True)
            for shape in shapes:
                config = LoadConfig(
                    url=url,
                    model=args.model,
                    concurrency=shape.concurrency,
                    batch=shape.batch,
                    duration=args.duration,
                    warmup=args.warmup,
                    encoding_format=args.encoding_format,
                    timeout=args.request_timeout,
                )
                measure = partial(_load_once, args, config, server.pid)
                measured = least_disturbed(args, measure, _load_noise)
                report.results.append(measured)
                result = measured.load
                print(
                    f"  {shape.label:>16}: {result.sentences_per_s:8.1f} sentences/s  "
                    f"p50 {result.p50_ms:8.1f} ms  p99 {result.p99_ms:8.1f} ms  "
                    f"errors {result.errors}  others' CPU {measured.others_during:.0%}",
                    flush=True,
                )
                if measured.cpu_us_per_request:
                    print("    CPU per request: " + ", ".join(
                        f"{name} {us:.0f} us" for name, us in measured.cpu_us_per_request.items()), flush=True)
                if result.first_error:
                    print(f"    first error: {result.first_error}", flush=True)
        except (RuntimeError, OSError, ValueError) as exc:
            report.error = f"{type(exc).__name__}: {exc}"
            print(f"  FAILED: {report.error} (see {report.log})", flush=True)
        finally:
            stop_server(server)
    return report


def fmt_number(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(ceiling: dict[str, float], reports: list[TargetReport],
                   engines: list[dict[str, float]] | None = None) -> str:
    """Render the ceiling and every target's loads as one markdown table, then, with
    engine ceilings, every load against each engine's one pass on all threads and its
    better lane arrangement."""
    peak = ceiling["batch_sentences_per_s"]
    others = f"{ceiling['others_during']:.0%}"
    lines = [
        "| target | load | sentences/s | requests/s | p50 ms | p99 ms | errors | vs ceiling "
        "| others' CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| ceiling (in-process) | encode batch 32, chunk {int(ceiling['chunk'])} | "
        f"{peak:.1f} | - | - | - | 0 | 1.00 | {others} |",
        f"| ceiling (in-process) | encode 1 text | - | - | "
        f"{ceiling['single_p50_ms']:.1f} | {ceiling['single_p99_ms']:.1f} | 0 | - | {others} |",
    ]
    for report in reports:
        if report.error and not report.results:
            lines.append(f"| {report.name} | FAILED: {report.error} | | | | | | | |")
        for m in report.results:
            r = m.load
            lines.append(
                f"| {report.name} | {LoadShape(r.batch, r.concurrency).label} | "
                f"{r.sentences_per_s:.1f} | {r.requests_per_s:.1f} | {fmt_number(r.p50_ms)} | "
                f"{fmt_number(r.p99_ms)} | {r.errors} | {r.sentences_per_s / peak:.2f} | "
                f"{m.others_during:.0%} |"
            )
    if not engines:
        return "\n".join(lines)
    engine_rows = []
    for e in engines:
        name, others = f"engine {e['engine']} {e['dtype']} (in-process)", f"{e['others_during']:.0%}"
        for what, rate in (("batch 32, one pass on all threads", e["all_threads_per_s"]),
                           ("batch 32, best of lanes", _best_of_lanes(e))):
            ratio = "n/a" if rate is None else f"{rate / peak:.2f}"
            engine_rows.append(f"| {name} | {what} | {fmt_number(rate or math.nan)} | - | - | - | 0 | {ratio} | {others} |")
    lines[4:4] = engine_rows
    lines += ["", "| target | load | sentences/s | "
              + " | ".join(f"vs {e['engine']} {e['dtype']}, {what}" for e in engines
                           for what in ("all threads", "best of lanes")) + " |",
              "|---|---|---:|" + "---:|" * 2 * len(engines)]
    for report in reports:
        for m in report.results:
            r = m.load
            ratios = [fmt_number(r.sentences_per_s / rate if rate else math.nan, 2)
                      for e in engines for rate in (e["all_threads_per_s"], _best_of_lanes(e))]
            lines.append(f"| {report.name} | {LoadShape(r.batch, r.concurrency).label} | "
                         f"{r.sentences_per_s:.1f} | {' | '.join(ratios)} |")
    lone = [(report.name, m.load.p50_ms) for report in reports for m in report.results
            if m.load.concurrency == 1 and m.load.batch == 1]
    if lone:
        lines += ["", "| target | c1 p50 ms | " + " | ".join(
                      f"vs {e['engine']} {e['dtype']}, one corpus text ({e['lone_corpus_p50_ms']:.1f} ms)"
                      for e in engines) + " |",
                  "|---|---:|" + "---:|" * len(engines)]
        lines += [f"| {name} | {fmt_number(p50)} | "
                  + " | ".join(f"{p50 / e['lone_corpus_p50_ms']:.2f}" for e in engines) + " |" for name, p50 in lone]
    return "\n".join(lines)


def _best_of_lanes(engine: dict[str, float]) -> float:
    return max(engine["per_lane_per_s"], engine["shared_per_s"])


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", action="append", choices=sorted(TARGETS), default=[],
        help="server to benchmark; repeat for several (default: infinity-torch)",
    )  # fmt: skip
    parser.add_argument("--cmd", action="append", default=[],
                        help="custom server command; {port} and {model_dir} substituted; repeat for several")
    parser.add_argument("--name", action="append", default=[],
                        help="label of the --cmd at the same position in the table (default custom-N)")
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="BATCHxCONCURRENCY list")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=3.0, help="discarded seconds per load")
    parser.add_argument("--encoding-format", choices=("float", "base64", "bytes"), default="float")
    parser.add_argument("--request-timeout", type=float, default=LoadConfig.timeout,
                        help="per-request limit, seconds (a large model's requests queue for longer)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name sent in requests")
    parser.add_argument("--model-dir", help="model folder for {model_dir} and the ceiling (default: the packaged "
                        "model); e.g. one of bench.base_models")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="ceiling threads")
    parser.add_argument("--device", default="cpu", help="device of the in-process ceiling (cpu, cuda)")
    parser.add_argument("--ceiling-duration", type=float, default=20.0)
    parser.add_argument("--ceiling-chunk", type=int, default=1024, help="texts per encode() call")
    parser.add_argument("--engine-ceiling", action="append", default=[], metavar="ENGINE:DTYPE",
                        help="also measure this engine in process (bench.engines); repeat for several")
    add_quiet_cpu_args(parser)
    args = parser.parse_args()
    if not args.target and not args.cmd:
        args.target = ["infinity-torch"]
    return args


def main() -> int:
    """Command-line entry point; returns the exit status (1 if any target failed)."""
    args = _parse_args()
    signal.signal(signal.SIGTERM, _raise_exit)
    shapes = parse_loads(args.loads)
    targets = [TARGETS[name] for name in args.target]
    for index, command in enumerate(args.cmd):
        name = args.name[index] if index < len(args.name) else f"custom-{index + 1}"
        targets.append(Target(name, shlex.split(command)))
    args.model_dir = args.model_dir or str(model_dir())
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")

    ceiling = run_ceiling(args)
    print(
        f"  ceiling: {ceiling['batch_sentences_per_s']:.1f} sentences/s (batch 32), "
        f"single-text p50 {ceiling['single_p50_ms']:.1f} ms, "
        f"others' CPU {ceiling['others_during']:.0%}",
        flush=True,
    )
    engines = [run_engine_ceiling(args, choice) for choice in args.engine_ceiling]
    reports = [bench_target(target, shapes, args, stamp) for target in targets]

    table = markdown_table(ceiling, reports, engines)
    print(f"\n{table}")
    (OUT_DIR / f"{stamp}.md").write_text(table + "\n")
    raw = {
        "date": stamp,
        "args": vars(args),
        "ceiling": ceiling,
        "engine_ceilings": engines,
        "targets": [asdict(report) for report in reports],
    }
    (OUT_DIR / f"{stamp}.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"\nsaved bench/out/{stamp}.md and .json")
    return 1 if any(report.error for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
