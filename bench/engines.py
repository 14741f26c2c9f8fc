"""In-process ceiling of each of our engines on the default model: what the engine alone
does, without the server, for the same corpus the load generator sends.

Per engine and dtype, over the corpus cut into batches of 32 after sorting by length (the
engines issue's "batch 32 sorted by length"): sentences/s of one batch at a time on all
threads (the issue's "2 threads" figure: the wide copy for engines that run lanes, "-"
where they keep none), with a whole batch per lane at once, and with each batch shared by
the lanes (rows interleaved, as the server shares a batch with idle lanes); then the
median time of one short sentence on one lane and, for engines that widen, on all threads.
By default every engine and dtype the server could run here (bfloat16 only on CPUs that
compute it natively).
The server's figures are read against the issue's figure and against the better of the
lane throughputs (bench/results/engines.md#the-engine-ceiling-as-the-engines-issue-measures-it).

Usage: .venv/bin/python -m bench.engines [--engine onnx:float32 ...] [--texts 2048] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from workers.inference.corpus import sentences
from bench.replay import pad_batch
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16
from workers.engines import set_torch_threads
from workers.heads import LoadedModel, load_model

DEFAULT_ENGINES = ("torch:float32", "onnx:float32", "ctranslate2:float32", "onnx:int8", "ctranslate2:int8",
                   "openvino:float32", "openvino:bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], help="ENGINE:DTYPE; repeat (default: all)")
    parser.add_argument("--model", help="model folder (default: the packaged model), e.g. one of bench.base_models")
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print each engine's figures as one JSON line")
    args = parser.parse_args()

    if not args.json:
        print("| engine | dtype | " + " | ".join(COLUMNS.values()) + " |\n|---|---|" + "---:|" * len(COLUMNS))
    for choice in args.engine or default_engines():
        # Each engine in a fresh process: one engine's thread pools must not slow the next.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            figures = child.submit(measure, choice, args.texts, args.threads, args.model).result()
        if args.json:
            print(json.dumps(figures), flush=True)
        else:
            cells = ("-" if figures[key] is None else f"{figures[key]:.{2 if key.endswith('ms') else 1}f}"
                     for key in COLUMNS)
            print(f"| {figures['engine']} | {figures['dtype']} | {' | '.join(cells)} |", flush=True)


def default_engines() -> list[str]:
    """Of `DEFAULT_ENGINES`, those this machine runs: bfloat16 only where the CPU computes it."""
    return [choice for choice in DEFAULT_ENGINES if not choice.endswith(":bfloat16") or cpu_computes_bfloat16()]


COLUMNS = {
    "all_threads_per_s": "batch 32 on all threads, sentences/s",
    "per_lane_per_s": "batch 32 per lane, sentences/s",
    "shared_per_s": "batch 32 shared, sentences/s",
    "one_p50_ms": "one sentence p50 ms",
    "wide_p50_ms": "wide, p50 ms",
    "lone_corpus_p50_ms": "one corpus text at a time, p50 ms",
}

LONE_TEXTS = 300  # the load generator's first texts, one at a time


def measure(choice: str, texts: int, threads: int, folder: str | None = None) -> dict[str, str | float | None]:
    """The figures of ENGINE:DTYPE `choice` on the model in `folder` (None: the packaged
    one): keys of `COLUMNS`, None where the engine has no such pass."""
    name, dtype = choice.split(":")
    model, tokenizer = load_engine(choice, threads, folder)
    engine = model.engine
    corpus = sorted((np.array(e.ids) for e in tokenizer.encode_batch(sentences(texts, 0))), key=len)
    groups = [corpus[i:i + 32] for i in range(0, len(corpus), 32)]
    figures: dict[str, str | float | None] = {"engine": name, "dtype": dtype, "all_threads_per_s": None}
    with ThreadPoolExecutor(engine.lanes) as lanes:
        per_lane = [pad_batch(group) for group in groups]
        shared = [pad_batch(group[i::engine.lanes]) for group in groups for i in range(engine.lanes)]
        for batch in per_lane[::8]:  # warm-up over the range of lengths
            model.forward(*batch)
        if engine.lanes == 1 or engine.widens:
            start = time.perf_counter()
            for batch in per_lane:
                model.forward(*batch, wide=engine.widens)
            figures["all_threads_per_s"] = len(corpus) / (time.perf_counter() - start)
        for key, batches in (("per_lane_per_s", per_lane), ("shared_per_s", shared)):
            start = time.perf_counter()
            list(lanes.map(lambda batch: model.forward(*batch), batches))
            figures[key] = len(corpus) / (time.perf_counter() - start)
    one = pad_batch([corpus[len(corpus) // 4]])
    for key, wide in (("one_p50_ms", False), ("wide_p50_ms", True)):
        figures[key] = _median_seconds(lambda: model.forward(*one, wide=wide)) * 1e3 if wide <= engine.widens else None
    figures["lone_corpus_p50_ms"] = _lone_corpus_seconds(model, tokenizer) * 1e3
    return figures


def load_engine(choice: str, threads: int, folder: str | None = None,
                device: str = "cpu") -> tuple[LoadedModel, Tokenizer]:
    """The model in `folder` (None: the packaged one) on ENGINE:DTYPE `choice` with
    `threads` threads on `device`, and its tokenizer truncating as the server's does."""
    name, dtype = choice.split(":")
    source = {"source": folder} if folder else {}
    spec = resolve_model(ModelConfig(name="default", engine=name, dtype=dtype, device=device, **source))
    model = load_model(spec, threads)
    set_torch_threads([model.engine], threads)
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    return model, tokenizer


def _lone_corpus_seconds(model: LoadedModel, tokenizer: Tokenizer) -> float:
    """Median seconds of one corpus text at a time, from its characters to its vector."""
    one = lone_pass(model, tokenizer)
    return statistics.median(_median_seconds(lambda: one(text), repeats=1) for text in sentences(LONE_TEXTS, 0))


def lone_pass(model: LoadedModel, tokenizer: Tokenizer) -> Callable[[str], object]:
    """One text from its characters to its vector, on the pass the server gives a lone
    input (the wide one where the engine widens)."""
    return lambda text: model.forward(*pad_batch([np.array(tokenizer.encode(text).ids)]), wide=model.engine.widens)


def _median_seconds(call: Callable[[], object], repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
