"""How much of the CPU's matrix throughput the model's forward pass uses.

The pass: batches of 32 texts at fixed lengths, a batch per lane at once (as the server and
`embed` run them), in floating-point operations a second counted from the model's config
(the encoder layers' matrix products and attention; embeddings, norms and pooling not
counted, so the figure is a floor). Against it, the same runtime at the same precision and
thread layout running one plain matrix product per lane: the model's feed-forward product
over the same tokens (what the CPU's matrix units give a pass of the model's own widths).

A pass near the plain product's rate leaves a bulk job nothing to win on this CPU by feeding
the engine differently: it can beat the server only by what the server spends beside the
passes (bench/results/corpus.md#what-the-cpu-can-do).

Usage: .venv/bin/python -m bench.roofline [--model DIR] [--engine openvino:bfloat16] [--lengths 32,64,128]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.engines import load_engine
from bench.replay import pad_batch
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16
from workers.engines.openvino_engine import CompiledOpenVinoGraph

BATCH = 32


def encoder_flops(config: dict, batch: int, length: int) -> float:
    """Floating-point operations of an encoder's layers over `batch` x `length` tokens:
    the four attention projections, the two feed-forward products, and the two attention
    products (scores and weighted values)."""
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    tokens = batch * length
    projections = 2 * tokens * (4 * hidden * hidden + 2 * hidden * inner)
    attention = 2 * 2 * batch * length * length * hidden
    return layers * (projections + attention)


def per_second_on_lanes(lanes: int, run: Callable[[], object], seconds: float) -> float:
    """Calls of `run` a second, `lanes` threads calling it at once for about `seconds`."""
    counts = [0] * lanes

    def loop(lane: int) -> None:
        while time.perf_counter() < deadline:
            run()
            counts[lane] += 1

    run()  # warm: the first call compiles the shape
    start = time.perf_counter()
    deadline = start + seconds
    threads = [threading.Thread(target=loop, args=(lane,)) for lane in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def plain_product(precision: str, lanes: int, tokens: int, hidden: int, inner: int,
                  folder: Path) -> Callable[[], object]:
    """One call: OpenVINO's product of a `tokens` x `hidden` input by a constant `hidden` x
    `inner` matrix, saved in `folder` and compiled as the engine compiles a model's graph
    (`CompiledOpenVinoGraph`: the precision, a stream per lane, one thread each)."""
    import openvino
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    source = ops.parameter([tokens, hidden], openvino.Type.f32, name="x")
    weight = ops.constant(rng.standard_normal((hidden, inner), dtype=np.float32))
    graph = folder / "product.xml"
    openvino.save_model(openvino.Model([ops.matmul(source, weight, False, False)], [source], "product"), graph)
    compiled = CompiledOpenVinoGraph(openvino.Core(), graph, precision, threads=1, runs=lanes)
    feeds = {"x": rng.standard_normal((tokens, hidden), dtype=np.float32)}
    return lambda: compiled(feeds)


def measure(engine: str, folder: str | None, lengths: list[int], seconds: float) -> list[dict]:
    """Per length: the model's pass and the plain product, in GFLOP/s, and their ratio."""
    model, _ = load_engine(engine, len(os.sched_getaffinity(0)), folder)
    lanes = model.engine.lanes
    name, precision = engine.split(":")
    source = {"source": folder} if folder else {}
    spec = resolve_model(ModelConfig(name="default", engine=name, dtype=precision, **source))
    config = json.loads((Path(spec.path) / "config.json").read_text())
    rows = []
    rng = np.random.default_rng(1)
    for length in lengths:
        ids = [rng.integers(1000, 2000, length) for _ in range(BATCH)]
        batch = pad_batch(ids)
        passes = per_second_on_lanes(lanes, lambda: model.forward(*batch), seconds)
        model_rate = passes * encoder_flops(config, BATCH, length) / 1e9
        with tempfile.TemporaryDirectory() as folder:
            product = plain_product(precision, lanes, BATCH * length, config["hidden_size"],
                                    config["intermediate_size"], Path(folder))
            products = per_second_on_lanes(lanes, product, seconds)
        product_rate = products * 2 * BATCH * length * config["hidden_size"] * config["intermediate_size"] / 1e9
        rows.append({"length": length, "lanes": lanes, "passes_per_s": passes, "texts_per_s": passes * BATCH,
                     "model_gflops": model_rate, "product_gflops": product_rate, "share": model_rate / product_rate})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the packaged model), e.g. one of bench.base_models")
    parser.add_argument("--engine", default="openvino:bfloat16" if cpu_computes_bfloat16() else "openvino:float32",
                        help="ENGINE:DTYPE of the model's pass (the plain product is OpenVINO's at that dtype)")
    parser.add_argument("--lengths", default="32,64,128", help="tokens a text, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per figure")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.engine, args.model, [int(n) for n in args.lengths.split(",")], args.seconds)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.engine}, batches of {BATCH}, a batch per lane at once")
    print("| tokens a text | texts/s | model GFLOP/s | plain product GFLOP/s | share |\n|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['length']} | {row['texts_per_s']:.1f} | {row['model_gflops']:.1f} | "
              f"{row['product_gflops']:.1f} | {row['share']:.2f} |")


if __name__ == "__main__":
    main()
