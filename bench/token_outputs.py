"""Benchmark of models whose outputs vary in size: documents/s served by our
``/v1/embeddings`` against the in-process sentence-transformers encode loop on the same
folder, in the same run, at saturation.

No such weights are available offline, so each model is built once into
``~/.cache/infinity-bench/<kind>`` from the packaged all-MiniLM-L6-v2 encoder (6 layers,
hidden 384: the size of small ColBERT and SPLADE models) with random heads:

- ``multivector``: sentence-transformers' MultiVectorEncoder over it (a Dense projection
  384 -> 128 without bias, a punctuation skiplist, normalised), with ColBERT's settings:
  [Q] / [D] prompts, queries expanded to 32 tokens, documents cut at 180 tokens.

Workload: consecutive passages of ``workers.inference.corpus`` (3 to 200 words), encoded as
documents. The ceiling child runs ``encode_document(passages, batch_size=32)`` over
``--ceiling-chunk`` passages per call for ``--ceiling-duration`` s (2 torch threads);
the server (``python -m infinity serve`` with the model, auto engine) gets closed-loop
loads of DOCSxCONCURRENCY (base64), after a check that its rows match the reference.
As in ``bench.run``, measurements wait for a quiet CPU and are redone when disturbed.

Usage:
    .venv/bin/python -m bench.token_outputs --kind multivector
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import cpu
from workers.inference.corpus import sentences
from bench.loadgen import closed_loop
from bench.run import (ConfiguredServer, OUT_DIR, add_measurement_args, least_disturbed, measure_child, parse_pairs,
                       start_run, wait_quiet)

CACHE = Path.home() / ".cache" / "infinity-bench"
MODEL_NAME = "bench-model"
BATCH_SIZE = 32
_BUILT_MARKER = ".bench-built"  # written last: a folder without it is incomplete


@dataclass(frozen=True)
class Kind:
    """How one kind of model is built, encoded in process, asked for and checked."""

    build: Callable[[Path], None]
    encoder: Callable[[Path], Callable[[list[str]], list[np.ndarray]]]
    request: dict[str, object]  # what a request adds to the model and input
    decode: Callable[[dict[str, object]], np.ndarray]  # one response item -> its output


def _build_multivector(folder: Path) -> None:
    import string

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    from infinity.folders.resolve import packaged_model_folder

    torch.manual_seed(0)
    encoder = MultiVectorEncoder(str(packaged_model_folder()), prompts={"query": "[Q] ", "document": "[D] "})
    encoder[0].document_length = 180
    encoder[0].query_expansion = {"strategy": "fixed", "attend": False, "length": 32}
    next(m for m in encoder if isinstance(m, MultiVectorMask)).skiplist_words = list(string.punctuation)
    encoder.save(str(folder))


def _multivector_encoder(folder: Path) -> Callable[[list[str]], list[np.ndarray]]:
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(str(folder), device="cpu")
    return lambda texts: [rows.float().numpy() for rows in model.encode_document(texts, batch_size=BATCH_SIZE)]


def _matrix(item: dict[str, object]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(str(item["embedding"])), "<f4").reshape(item["shape"])  # type: ignore[arg-type]


KINDS = {
    "multivector": Kind(_build_multivector, _multivector_encoder,
                        {"input_type": "document", "encoding_format": "base64"}, _matrix),
}


def model_folder(kind: str) -> Path:
    """The kind's model, built unless already complete."""
    folder = CACHE / kind
    if (folder / _BUILT_MARKER).is_file():
        return folder
    staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    KINDS[kind].build(staging)
    (staging / _BUILT_MARKER).write_text("random heads over all-MiniLM-L6-v2, seed 0\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)
    return folder


def passages(count: int = 20_000) -> list[str]:
    return sentences(count, 0)


# --- the ceiling child ----------------------------------------------------------------


def ceiling(kind: str, threads: int, duration: float, chunk: int) -> dict[str, object]:
    """Documents/s of the in-process encode loop, and the check documents' outputs."""
    import torch

    torch.set_num_threads(threads)
    encode = KINDS[kind].encoder(model_folder(kind))
    corpus = passages()
    check = [output.tolist() for output in encode(corpus[:64])]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        encode([corpus[(done + i) % len(corpus)] for i in range(chunk)])
        done += chunk
    seconds = time.perf_counter() - start
    return {"threads": threads, "chunk": chunk, "docs": done, "seconds": seconds, "docs_per_s": done / seconds,
            "check": check}


# --- the server -----------------------------------------------------------------------


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def agreement(url: str, kind: str, reference: list[list]) -> float:
    """The largest difference between the server's outputs of the check documents and
    the in-process encode loop's."""
    body = {"model": MODEL_NAME, "input": passages()[:64], **KINDS[kind].request}
    items = _post(f"{url}/v1/embeddings", body)["data"]
    worst = 0.0
    for item, expected in zip(items, reference, strict=True):
        served, expected = KINDS[kind].decode(item), np.array(expected, dtype=np.float32)  # type: ignore[arg-type]
        if served.shape != expected.shape:
            raise ValueError(f"served shape {served.shape}, reference {expected.shape}")
        worst = max(worst, float(np.abs(served - expected).max(initial=0.0)))
    return worst


def load(args: argparse.Namespace, url: str, kind: str, docs: int, concurrency: int, pgid: int) -> dict[str, float]:
    others_before = wait_quiet(args, pgid)
    corpus, position = passages(), [0]

    def check(payload: object) -> None:
        if not isinstance(payload, dict) or len(payload.get("data", [])) != docs:
            raise ValueError(f"expected {docs} items")

    def next_request() -> tuple[dict[str, object], object]:
        start = position[0]
        position[0] = (start + docs) % len(corpus)
        body = {"model": MODEL_NAME, "input": [corpus[(start + i) % len(corpus)] for i in range(docs)],
                **KINDS[kind].request}
        return body, check

    before = cpu.sample(pgid)
    window = asyncio.run(closed_loop(url, "/v1/embeddings", next_request, concurrency=concurrency,
                                     duration=args.duration, warmup=args.warmup, timeout=300.0))
    return {"docs": docs, "concurrency": concurrency, "docs_per_s": window.good * docs / args.duration,
            "p50_ms": window.percentile(50), "p99_ms": window.percentile(99), "errors": window.errors,
            "first_error": window.first_error, "others_before": others_before,
            "others_during": cpu.other_share(before, cpu.sample(pgid))}


def bench_server(args: argparse.Namespace, ceil: dict[str, object], stamp: str) -> list[dict[str, float]]:
    ours = ConfiguredServer.prepare(f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{model_folder(args.kind)}"\n',
                                    args.kind, stamp)
    rows = []
    with ours.running(args.health_timeout) as server:
        print(f"  largest difference to the in-process outputs: "
              f"{agreement(ours.url, args.kind, ceil['check']):.2e}", flush=True)  # type: ignore[arg-type]
        for docs, concurrency in parse_pairs(args.loads):
            row = least_disturbed(args, lambda: load(args, ours.url, args.kind, docs, concurrency, server.pid),
                                  lambda r: r["others_during"])
            rows.append(row)
            print(f"  {docs} docs x c{concurrency}: {row['docs_per_s']:.1f} docs/s "
                  f"({row['docs_per_s'] / ceil['docs_per_s']:.2f} of the ceiling), p50 {row['p50_ms']:.0f} ms, "
                  f"errors {row['errors']}, others' CPU {row['others_during']:.0%}", flush=True)
    return rows


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(KINDS), required=True)
    parser.add_argument("--loads", default="32x4,32x8", help="DOCSxCONCURRENCY list")
    add_measurement_args(parser, warmup=5.0, health_timeout=600.0)
    parser.add_argument("--ceiling-chunk", type=int, default=256, help="documents per encode call")
    parser.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    if args.ceiling:
        print(json.dumps(ceiling(args.kind, args.threads, args.ceiling_duration, args.ceiling_chunk)))
        return 0
    stamp = start_run()
    print(f"model: {model_folder(args.kind)}", flush=True)
    command = [sys.executable, "-m", "bench.token_outputs", "--ceiling", "--kind", args.kind, "--threads",
               str(args.threads), "--ceiling-duration", str(args.ceiling_duration), "--ceiling-chunk",
               str(args.ceiling_chunk)]
    ceil = measure_child(args, command)
    print(f"  ceiling: {ceil['docs_per_s']:.1f} docs/s, others' CPU {ceil['others_during']:.0%}", flush=True)
    rows = bench_server(args, ceil, stamp)
    summary = {"date": stamp, "kind": args.kind, "args": vars(args),
               "ceiling": {k: v for k, v in ceil.items() if k != "check"}, "loads": rows}
    (OUT_DIR / f"{stamp}-{args.kind}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-{args.kind}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
