"""In-process ceiling of each of our engines on the default model: what the engine alone
does, without the server, for the same corpus the load generator sends.

Two numbers per engine and dtype: sentences/s over the corpus cut into batches of 32 after
sorting by length (the engines issue's "batch 32 sorted by length"), run a batch per lane
at once as the server runs them, and the median time of one short sentence. The server's
figures are read against these (bench/RESULTS.md).

Usage: .venv/bin/python -m bench.engines [--engine onnx:float32 ...] [--texts 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

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

    print("| engine | dtype | batch 32 sorted, sentences/s | one sentence, p50 ms |\n|---|---|---:|---:|")
    for choice in args.engine or DEFAULT_ENGINES:
        name, dtype = choice.split(":")
        spec = resolve_model(ModelConfig(name="default", engine=name, dtype=dtype))
        engine = load_engine(spec, args.threads)
        set_torch_threads([engine], args.threads)
        tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
        tokenizer.no_padding()
        tokenizer.enable_truncation(spec.max_length)
        corpus = sorted((np.array(e.ids) for e in tokenizer.encode_batch(sentences(args.texts, 0))), key=len)
        batches = [pad_batch(corpus[i:i + 32]) for i in range(0, len(corpus), 32)]
        for batch in batches[::8]:  # warm-up over the range of lengths
            engine.forward(*batch)
        start = time.perf_counter()
        with ThreadPoolExecutor(engine.lanes) as lanes:  # as the server runs it: a batch per free lane
            list(lanes.map(lambda batch: engine.forward(*batch), batches))
        throughput = len(corpus) / (time.perf_counter() - start)
        one = pad_batch([corpus[len(corpus) // 4]])
        times = []
        for _ in range(50):
            start = time.perf_counter()
            engine.forward(*one)
            times.append(time.perf_counter() - start)
        print(f"| {name} | {dtype} | {throughput:.1f} | {statistics.median(times) * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
