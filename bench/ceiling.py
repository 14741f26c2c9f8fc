"""In-process throughput ceiling: sentence-transformers on CPU, no server in the way.

Two numbers, on the same corpus the load generator sends (``workers.inference.corpus``):

* batch path: ``SentenceTransformer.encode(chunk, batch_size=32,
  normalize_embeddings=True)`` over consecutive corpus chunks of ``--chunk``
  texts, repeated for ``--duration`` seconds; reported as sentences/s. encode()
  sorts each chunk by length before batching, so a larger chunk pads less.
* single path: ``encode([text])`` one text at a time for ``--single-duration``
  seconds; reported as p50/p99 latency in milliseconds.

torch's intra-op thread count is set explicitly (``--threads``, default: all
cores) before the model loads.

Usage:
    python -m bench.ceiling --duration 20 --json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from workers.inference.corpus import sentences
from infinity.folders.resolve import packaged_model_folder as model_dir

BATCH_SIZE = 32


@dataclass(frozen=True)
class CeilingResult:
    """Ceiling measurements (latencies in milliseconds)."""

    threads: int
    batch_size: int
    chunk: int
    batch_sentences: int
    batch_seconds: float
    batch_sentences_per_s: float
    single_count: int
    single_p50_ms: float
    single_p99_ms: float
    torch_version: str
    sentence_transformers_version: str


def measure(
    model_path: Path,
    threads: int,
    duration: float,
    single_duration: float,
    chunk: int,
    corpus_size: int,
    seed: int,
    device: str = "cpu",
) -> CeilingResult:
    """Load the model on ``device`` (on the CPU with ``threads`` torch threads) and measure
    both paths."""
    # Imported here so that ``--help`` stays fast and threads are set before any work.
    import sentence_transformers
    import torch

    torch.set_num_threads(threads)
    model = sentence_transformers.SentenceTransformer(str(model_path), device=device)
    texts = sentences(corpus_size, seed)

    def encode(batch: list[str]) -> None:
        model.encode(
            batch, batch_size=BATCH_SIZE, normalize_embeddings=True, show_progress_bar=False
        )

    encode(texts[:BATCH_SIZE])  # warm-up: allocator, kernels, tokenizer

    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        offset = done % len(texts)
        encode(texts[offset : offset + chunk])
        done += min(chunk, len(texts) - offset)
    batch_seconds = time.perf_counter() - start

    latencies: list[float] = []
    stop = time.perf_counter() + single_duration
    while time.perf_counter() < stop:
        text = texts[len(latencies) % len(texts)]
        t0 = time.perf_counter()
        encode([text])
        latencies.append((time.perf_counter() - t0) * 1000.0)

    return CeilingResult(
        threads=threads,
        batch_size=BATCH_SIZE,
        chunk=chunk,
        batch_sentences=done,
        batch_seconds=batch_seconds,
        batch_sentences_per_s=done / batch_seconds,
        single_count=len(latencies),
        single_p50_ms=float(np.percentile(latencies, 50)),
        single_p99_ms=float(np.percentile(latencies, 99)),
        torch_version=torch.__version__,
        sentence_transformers_version=sentence_transformers.__version__,
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the bundled one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--device", default="cpu", help="torch device of the reference model (cpu, cuda)")
    parser.add_argument("--duration", type=float, default=20.0, help="batch-path seconds")
    parser.add_argument("--single-duration", type=float, default=5.0, help="single-path seconds")
    parser.add_argument("--chunk", type=int, default=1024, help="texts per encode() call")
    parser.add_argument("--corpus-size", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.threads < 1 or args.chunk < 1 or args.duration <= 0 or args.single_duration <= 0:
        parser.error("--threads and --chunk must be >= 1, durations > 0")
    return args


def main() -> None:
    """Command-line entry point."""
    args = _parse_args()
    result = measure(
        model_path=args.model or model_dir(),
        threads=args.threads,
        device=args.device,
        duration=args.duration,
        single_duration=args.single_duration,
        chunk=args.chunk,
        corpus_size=args.corpus_size,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(asdict(result)))
        return
    print(
        f"threads={result.threads} batch_size={result.batch_size} chunk={result.chunk}\n"
        f"  batch path:  {result.batch_sentences_per_s:8.1f} sentences/s "
        f"({result.batch_sentences} in {result.batch_seconds:.1f} s)\n"
        f"  single text: p50 {result.single_p50_ms:.1f} ms, p99 {result.single_p99_ms:.1f} ms "
        f"({result.single_count} encodes)"
    )


if __name__ == "__main__":
    main()
