"""Lanes or one pass on every thread, for an engine that runs exported graphs (ONNX
Runtime, OpenVINO) on a model too big for a second copy: the text graph compiled both
ways from the same cached export, then, for each, sentences/s over the corpus in sorted
batches of 32 (a batch per lane at once, or one batch at a time) and the median time of
a lone corpus text. Why `GraphEngine` runs such a model on every thread
(bench/results/engines.md#big-models-lanes-or-every-thread).

Usage: .venv/bin/python -m bench.graph_layouts --engine openvino:bfloat16 --model bench/out/models/bert-large
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.engines import load_engine
from bench.replay import pad_batch
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.kinds import KINDS
from workers.engines import onnx_engine
from workers.engines.onnx_graphs import GRAPH, exported_graphs, run_text_graph
from workers.inference.corpus import sentences

LONE_TEXTS = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="ENGINE:DTYPE, an engine that runs graphs (onnx, openvino)")
    parser.add_argument("--model", required=True, help="model folder, e.g. one of bench.base_models")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    model, tokenizer = load_engine(args.engine, args.threads, args.model)
    engine = model.engine
    name, dtype = args.engine.split(":")
    spec = resolve_model(ModelConfig(name="default", engine=name, dtype=dtype, source=args.model))
    # The cached graphs the engine just loaded: ONNX Runtime's optimised ones, OpenVINO's as exported.
    outputs = KINDS[spec.kind].outputs
    folder = onnx_engine.exported_model(spec, outputs) if name == "onnx" else exported_graphs(spec, outputs)
    corpus = sorted((np.array(e.ids) for e in tokenizer.encode_batch(sentences(args.texts, 0))), key=len)
    batches = [pad_batch(corpus[i:i + 32]) for i in range(0, len(corpus), 32)]
    lone = [pad_batch([np.array(tokenizer.encode(text).ids)]) for text in sentences(LONE_TEXTS, 0)]
    print(f"{args.engine} on {args.model}: the server's layout has {engine.lanes} lane(s)", flush=True)
    for layout, threads, runs in (("lanes", 1, args.threads), ("every thread", args.threads, 1)):
        graph = engine._compile(folder / GRAPH, "cpu", threads, runs)
        for batch in batches[::4]:  # warm-up over the range of lengths
            run_text_graph(graph, *batch)
        start = time.perf_counter()
        with ThreadPoolExecutor(runs) as pool:
            list(pool.map(lambda batch: run_text_graph(graph, *batch), batches))
        per_s = len(corpus) / (time.perf_counter() - start)
        seconds = []
        for batch in lone:
            start = time.perf_counter()
            run_text_graph(graph, *batch)
            seconds.append(time.perf_counter() - start)
        print(f"| {args.engine} | {layout} | {per_s:.2f} | {statistics.median(seconds) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
