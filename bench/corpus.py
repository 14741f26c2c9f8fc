"""The corpus job's speed against what else could embed the same file, in one run.

Over one Parquet file of `--rows` corpus texts (`workers.inference.corpus`, with ids),
each in a process of its own, one after the other:

- ceiling: the engine and dtype `embed` serves (read from its manifest), loaded in
  process, over the file's first `--ceiling-rows` texts (a rate of the runtime, which a
  sample of the same texts gives: each of its four ways over a 100k file would take
  longer than the job); batches of 32, tokenizing included, no file I/O; the best of: in file order,
  and sorted by length within each 1,024 texts (as sentence-transformers' `encode` does),
  one batch at a time on all threads, or a batch per lane at once (the engine's lanes);
- embed: `python -m infinity embed FILE OUT --quiet`, from start to summary (its own
  rows/s, which leave out the model's start, the wall time, and the cores each of its
  processes kept busy over it);
- server: `python -m infinity serve` and 8 clients each sending 32 texts of the file per
  request over HTTP (aiohttp) until every row is embedded;
- sentence-transformers: read the file, `encode(texts, batch_size=32)`, write Parquet
  (what a user would otherwise write), float32 as it loads;
- ray (`--ray`): `examples/ray_embed.py` on a local Ray with one actor on every core
  (wall time, Ray's and the model's start included).

Rows/s and tokens/s (the model's tokens, from the job's output), and each against the
ceiling and the server. Nothing else may run meanwhile (bench/results/method.md).

On `--device cuda` every contender runs its model on the GPU (embed, the server and Ray
through one models.toml naming the device).

Usage: .venv/bin/python -m bench.corpus [--rows 100000] [--model FOLDER] [--device cpu] [--embed-batch-size N]
                                        [--ray] [--skip st]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench import cpu
from workers.inference.corpus import sentences

OUT = Path(__file__).parent / "out" / "corpus"
BATCH = 32
CLIENTS = 8


def corpus_file(rows: int) -> Path:
    """The benchmark's Parquet file of `rows` texts (written once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = OUT / f"corpus-{rows}.parquet"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        texts = sentences(rows, 1)
        pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(rows)], "text": texts}), path)
    return path


def texts_of(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def models_toml(model: str | None, device: str) -> Path:
    """A models.toml serving `model` (None: the packaged one) on `device` as `bench`, which
    embed, the server and Ray's actor are each given."""
    path = OUT / f"models-{device.replace(':', '-')}.toml"
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[[models]]\nname = "bench"\nsource = {json.dumps(model or "default")}\n'
                    f'device = {json.dumps(device)}\n')
    return path


def ceiling(path: Path, model: str | None, device: str, engine: str, dtype: str, threads: int, rows: int) -> dict:
    """Rows/s of the engine in process over the file's first `rows` texts, tokenizing included."""
    from bench.engines import load_engine
    from bench.replay import pad_batch

    loaded, tokenizer = load_engine(f"{engine}:{dtype}", threads, model, device)
    texts = texts_of(path)[:rows]
    in_order = [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)]
    by_length = [sorted(texts[i:i + 1024], key=len) for i in range(0, len(texts), 1024)]
    sorted_batches = [chunk[i:i + BATCH] for chunk in by_length for i in range(0, len(chunk), BATCH)]

    def run(batch: list[str], wide: bool = False) -> None:
        ids = [np.array(e.ids) for e in tokenizer.encode_batch_fast(batch)]
        loaded.forward(*pad_batch(ids), wide=wide)

    for batch in in_order[:8]:
        run(batch)
    figures = {}
    for order, batches in (("file_order", in_order), ("sorted", sorted_batches)):
        if loaded.engine.lanes == 1 or loaded.engine.widens:
            start = time.perf_counter()
            for batch in batches:
                run(batch, wide=loaded.engine.widens)
            figures[f"{order}_all_threads"] = len(texts) / (time.perf_counter() - start)
        if loaded.engine.lanes > 1:
            with ThreadPoolExecutor(loaded.engine.lanes) as lanes:
                start = time.perf_counter()
                list(lanes.map(run, batches))
                figures[f"{order}_lanes"] = len(texts) / (time.perf_counter() - start)
    return {"rows_per_s": max(figures.values()), **figures}


def embed(path: Path, model: str | None, device: str, batch_size: int | None = None) -> dict:
    out = OUT / "embed-out"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "infinity", "embed", str(path), str(out), "--quiet",
               "--config", str(models_toml(model, device)), "--model", "bench"]
    if batch_size:
        command += ["--batch-size", str(batch_size)]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)
        used = _cpu_while_running(job)
        wall = time.perf_counter() - start
        log.seek(0)
        lines = log.read().strip().splitlines()
    if job.returncode:
        raise RuntimeError("\n".join(lines[-30:]))
    summary = lines[-1]
    rate = float(summary.split(" rows/s")[0].rsplit(" ", 1)[1])
    manifest = json.loads((out / "manifest.json").read_text())
    import pyarrow.parquet as pq

    tokens = sum(pq.read_table(p, columns=["tokens"]).column("tokens").to_numpy().sum()
                 for p in glob.glob(str(out / "part-*.parquet")))
    rows = manifest["rows"]
    return {"rows_per_s": rate, "wall_s": wall, "rows": rows, "tokens": int(tokens),
            "engine": manifest["job"]["model"]["engine"], "dtype": manifest["job"]["model"]["dtype"],
            "summary": summary, "cores_busy": {name: round(seconds / wall, 2) for name, seconds in used.items()}}


def _cpu_while_running(job: subprocess.Popen) -> dict[str, float]:
    """CPU seconds of each process of `job`'s group, by command name (the job's children
    name themselves: `tokenizer-0`, `inference-cpu`), sampled once a second until it ends
    (a process's last second before it exits is not seen; a sample costs a few ms)."""
    last: dict[int, tuple[str, int]] = {}
    while job.poll() is None:
        last.update(cpu.own_ticks_by_pid(job.pid))
        time.sleep(1.0)
    used: dict[str, float] = {}
    for name, ticks in last.values():
        used[name] = used.get(name, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
    return dict(sorted(used.items()))


def server(path: Path, model: str | None, device: str) -> dict:
    """Rows/s of our server fed the file by 8 clients of 32 texts per request."""
    import aiohttp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "infinity", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--config", str(models_toml(model, device))]
    process = subprocess.Popen(command, start_new_session=True)
    texts = texts_of(path)
    batches = [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)]

    async def feed() -> float:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{url}/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            async with session.get(f"{url}/v1/models") as response:
                name = (await response.json())["data"][0]["id"]
            queue = iter(batches)
            start = time.perf_counter()

            async def client() -> None:
                for batch in queue:
                    async with session.post(f"{url}/v1/embeddings", json={"model": name, "input": batch}) as answer:
                        assert answer.status == 200, await answer.text()
                        await answer.read()

            await asyncio.gather(*(client() for _ in range(CLIENTS)))
            return time.perf_counter() - start

    try:
        seconds = asyncio.run(feed())
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    return {"rows_per_s": len(texts) / seconds}


def sentence_transformers(path: Path, model: str | None, device: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    from infinity.folders.resolve import packaged_model_folder

    loaded = SentenceTransformer(model or str(packaged_model_folder()), device=device)
    start = time.perf_counter()
    table = pq.read_table(path)
    vectors = loaded.encode(table.column("text").to_pylist(), batch_size=BATCH, normalize_embeddings=True)
    out = pa.table({"id": table.column("id"),
                    "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])})
    pq.write_table(out, OUT / "st-out.parquet")
    return {"rows_per_s": table.num_rows / (time.perf_counter() - start)}


def ray(path: Path, model: str | None, device: str) -> dict:
    out = OUT / "ray-out"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "examples/ray_embed.py", str(path), str(out), "--concurrency", "1",
               "--num-cpus", str(os.cpu_count()), "--num-gpus", "0" if device == "cpu" else "1",
               "--config", str(models_toml(model, device)), "--model", "bench"]
    # The actor takes every core; Ray's read and write tasks need a CPU of its books too, so
    # it is told of one more than there are (its CPUs are logical), or the job never starts.
    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": (os.cpu_count() or 1) + 1})}
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True, env=env, timeout=3600)
    return {"rows_per_s": len(texts_of(path)) / (time.perf_counter() - start), "note": "wall time, Ray's start included"}


def _child(name: str, *args: object) -> dict:
    """Run contender `name` in a process of its own; its figures."""
    done = subprocess.run([sys.executable, "-m", "bench.corpus", "--child", json.dumps([name, *args])],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


CONTENDERS = {"ceiling": ceiling, "embed": embed, "server": server, "st": sentence_transformers, "ray": ray}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--model", help="a model folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--device", default="cpu", help="where every contender runs the model (cpu, cuda)")
    parser.add_argument("--embed-batch-size", type=int, help="embed's --batch-size (default: embed's own)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the ceiling's threads")
    parser.add_argument("--ceiling-rows", type=int, default=8192, help="the texts the ceiling runs, from the file's start")
    parser.add_argument("--ray", action="store_true", help="also Ray Data with one actor")
    parser.add_argument("--skip", action="append", default=[], choices=sorted(CONTENDERS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = json.loads(args.child)
        rest[0] = Path(rest[0])
        print(json.dumps(CONTENDERS[name](*rest)))
        return
    path = corpus_file(args.rows)
    figures = {"embed": _child("embed", str(path), args.model, args.device, args.embed_batch_size)}
    engine, dtype = figures["embed"]["engine"], figures["embed"]["dtype"]
    print(f"embed: {figures['embed']['summary']}; cores busy: {figures['embed']['cores_busy']}", flush=True)
    wanted = [n for n in ("ceiling", "server", "st") if n not in args.skip] + (["ray"] if args.ray else [])
    for name in wanted:
        extra = (engine, dtype, args.threads, args.ceiling_rows) if name == "ceiling" else ()
        figures[name] = _child(name, str(path), args.model, args.device, *extra)
        print(f"{name}: {figures[name]}", flush=True)
    tokens = figures["embed"]["tokens"] / figures["embed"]["rows"]
    print(f"\n{args.rows} rows, {tokens:.1f} tokens per row, embed on {engine} {dtype} on {args.device}\n")
    print("| contender | rows/s | tokens/s | embed against it |\n| --- | ---: | ---: | ---: |")
    for name, figure in figures.items():
        rate = figure["rows_per_s"]
        print(f"| {name} | {rate:.1f} | {rate * tokens:.0f} | {figures['embed']['rows_per_s'] / rate:.2f} |")
    (OUT / f"results-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
