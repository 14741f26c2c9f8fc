"""In-process ceiling of each of our engines on the default model: what the engine alone
does, without the server, for the same corpus the load generator sends.

Per engine and dtype, over the corpus cut into batches of 32 after sorting by length (the
engines issue's "batch 32 sorted by length"): sentences/s with a whole batch per lane at
once, and with each batch shared by the lanes (rows interleaved, as the server shares a
batch with idle lanes); then the median time of one short sentence on one lane and, for
engines that widen, on all threads. The server's figures are read against the better of
the two throughputs (bench/RESULTS.md).

Usage: .venv/bin/python -m bench.engines [--engine onnx:float32 ...] [--texts 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from bench.corpus import sentences
from bench.replay import pad_batch
from infinity.config import ModelConfig
from workers.engines import load_engine, set_torch_threads
from workers.models import resolve_model

DEFAULT_ENGINES = ("torch:float32", "onnx:float32", "ctranslate2:float32", "onnx:int8", "ctranslate2:int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], help="ENGINE:DTYPE; repeat (default: all)")
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    print("| engine | dtype | batch 32 per lane, sentences/s | batch 32 shared, sentences/s "
          "| one sentence p50 ms | wide, p50 ms |\n|---|---|---:|---:|---:|---:|")
    for choice in args.engine or DEFAULT_ENGINES:
        # Each engine in a fresh process: one engine's thread pools must not slow the next.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            print(child.submit(_row, choice, args.texts, args.threads).result(), flush=True)


def _row(choice: str, texts: int, threads: int) -> str:
    """The table row of ENGINE:DTYPE `choice`."""
    name, dtype = choice.split(":")
    spec = resolve_model(ModelConfig(name="default", engine=name, dtype=dtype))
    engine = load_engine(spec, threads)
    set_torch_threads([engine], threads)
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    corpus = sorted((np.array(e.ids) for e in tokenizer.encode_batch(sentences(texts, 0))), key=len)
    groups = [corpus[i:i + 32] for i in range(0, len(corpus), 32)]
    with ThreadPoolExecutor(engine.lanes) as lanes:
        per_lane = [pad_batch(group) for group in groups]
        shared = [pad_batch(group[i::engine.lanes]) for group in groups for i in range(engine.lanes)]
        for batch in per_lane[::8]:  # warm-up over the range of lengths
            engine.forward(*batch)
        rates = []
        for batches in (per_lane, shared):
            start = time.perf_counter()
            list(lanes.map(lambda batch: engine.forward(*batch), batches))
            rates.append(len(corpus) / (time.perf_counter() - start))
    one = pad_batch([corpus[len(corpus) // 4]])
    medians = [_median_seconds(lambda: engine.forward(*one, wide=wide)) * 1e3 if wide <= engine.widens else None
               for wide in (False, True)]
    cells = [f"{rates[0]:.1f}", f"{rates[1]:.1f}", *("-" if m is None else f"{m:.2f}" for m in medians)]
    return f"| {name} | {dtype} | {' | '.join(cells)} |"


def _median_seconds(call: Callable[[], object], repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
