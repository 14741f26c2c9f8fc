"""Large inputs: what a maximal body costs the tokenizer, and whether clients sending them
stall everyone else.

1. In process: one 16 MiB text of each shape (words, spaces only, one endless word, CJK)
   tokenized by the default model's `ModelTokenizer` (best of three), which reads a long
   input only up to what the model can use.
2. Served: the default server (started here from `--server-cwd`, by default this
   checkout), a small client alone sending requests of two short sentences one after
   another for `--duration` s, then the same while `--big-clients` clients send maximal
   bodies (one text of `--big-mib` MiB each) back to back. The small client's p50/p99
   and the big requests' statuses and latencies are reported.

`--server-cwd` runs the server from another checkout with this venv's Python, so the
code before a change can be measured in the same run (`git worktree add /tmp/before <ref>`).

Usage (from the repository root, nothing else running):
    .venv/bin/python -m bench.large_inputs --json bench/out/large_inputs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
SHORT = {"input": ["the quick brown fox jumps over the lazy dog", "a second short sentence"]}
SHAPES = {"words": "all work and no play makes jack a dull boy ", "spaces": " ", "one endless word": "x",
          "cjk": "東京北京数据模型"}


def tokenizer_costs(mib: int) -> dict[str, float]:
    """Seconds one `mib` MiB text of each shape costs the default model's tokenizer."""
    sys.path.insert(0, str(REPO))
    from infinity.config import ModelConfig
    from infinity.folders.resolve import resolve_model
    from infinity.shared import protocol
    from workers.preprocess.text import ModelTokenizer

    tokenizer = ModelTokenizer(resolve_model(ModelConfig(name="m")))
    costs = {}
    for shape, unit in SHAPES.items():
        text = (unit * (mib * 2 ** 20 // len(unit) + 1))[:mib * 2 ** 20]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            tokenizer.tokenize(protocol.Tokenize(1, "m", texts=[text]))
            times.append(time.perf_counter() - start)
        costs[shape] = min(times)
    return costs


def print_report(report: dict[str, object], path: Path | None) -> None:
    """Print `report` as JSON, and write it to `path` if one is given."""
    print(json.dumps(report, indent=1))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def start_server(cwd: Path, port: int, log: Path, config: Path | None = None) -> subprocess.Popen:
    """`infinity serve` from `cwd` on `port` (with `config`, a models.toml, when given), once healthy."""
    options = ["--config", str(config.resolve())] if config is not None else []
    process = subprocess.Popen([sys.executable, "-m", "infinity", "serve", "--host", "127.0.0.1",
                                "--port", str(port), *options], cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(cwd)})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("server not ready in 180 s")


async def small_client(session: aiohttp.ClientSession, url: str, until: float) -> list[float]:
    latencies = []
    while time.monotonic() < until:
        start = time.monotonic()
        async with session.post(url, json=SHORT) as response:
            await response.read()
            assert response.status == 200, response.status
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.02)
    return latencies


async def big_client(session: aiohttp.ClientSession, url: str, body: bytes, until: float) -> list[tuple[int, float]]:
    answers = []
    while time.monotonic() < until:
        start = time.monotonic()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            answers.append((response.status, time.monotonic() - start))
    return answers


def _big_clients(url: str, clients: int, mib: int, until: float, results: "multiprocessing.Queue") -> None:
    """In a process of its own, so that writing big bodies never delays the small client."""
    text = SHAPES["words"] * (int(mib * 2 ** 20) // len(SHAPES["words"]) + 1)
    body = json.dumps({"input": text[:int(mib * 2 ** 20) - 64]}).encode()

    async def run() -> list[tuple[int, float]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            answers = await asyncio.gather(*(big_client(session, url, body, until) for _ in range(clients)))
        return [a for client in answers for a in client]

    results.put((len(body), asyncio.run(run())))


async def small_alone(url: str, until: float) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await small_client(session, url, until)


def load(url: str, duration: float, big_clients: int, big_mib: int) -> dict[str, object]:
    alone = asyncio.run(small_alone(url, time.monotonic() + duration))
    results: multiprocessing.Queue = multiprocessing.Queue()
    start = time.monotonic() + 2  # the big clients' process has started by then
    until = start + duration
    big = multiprocessing.Process(target=_big_clients, args=(url, big_clients, big_mib, until, results))
    big.start()
    time.sleep(max(0.0, start - time.monotonic()))
    loaded = asyncio.run(small_alone(url, until))
    body_bytes, big_answers = results.get(timeout=300)
    big.join(60)
    ms = lambda values, q: round(float(np.percentile(values, q)) * 1000, 1)  # noqa: E731
    return {
        "small alone": {"requests": len(alone), "p50 ms": ms(alone, 50), "p99 ms": ms(alone, 99)},
        "small beside big": {"requests": len(loaded), "p50 ms": ms(loaded, 50), "p99 ms": ms(loaded, 99),
                             "max ms": round(max(loaded) * 1000, 1)},
        "big": {"requests": len(big_answers), "statuses": sorted({s for s, _ in big_answers}),
                "p50 ms": ms([t for _, t in big_answers], 50), "body bytes": body_bytes},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--big-clients", type=int, default=4)
    parser.add_argument("--big-mib", type=float, default=16)
    parser.add_argument("--server-cwd", type=Path, default=REPO)
    parser.add_argument("--port", type=int, default=7321)
    parser.add_argument("--skip-tokenizer", action="store_true", help="only the served part")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, object] = {"server": str(args.server_cwd)}
    if not args.skip_tokenizer:
        report["tokenizer seconds per 16 MiB input"] = {k: round(v, 4) for k, v in tokenizer_costs(16).items()}
        print(json.dumps(report, indent=1), flush=True)
    log = Path(f"/tmp/large-inputs-server-{args.port}.log")
    server = start_server(args.server_cwd, args.port, log)
    try:
        report["served"] = load(f"http://127.0.0.1:{args.port}/v1/embeddings", args.duration, args.big_clients,
                                args.big_mib)
    finally:
        server.terminate()
        server.wait(60)
    print_report(report, args.json)


if __name__ == "__main__":
    main()
