"""Does computing a batch's shared instruction prompt once pay? In process, on the torch
engine's padding-free pass of a decoder embedder (`workers.engines.packed_decoder`), for
queries behind the model's `query` prompt (Qwen3-Embedding's "Instruct: ...\\nQuery:").

Per batch size, the best time of the same padded batch:

- `shared`: the prompt's tokens computed once for the batch (the default);
- `each`: every query computing the prompt (`PackedDecoder.shares_prefix = False`);
- `queries only`: the queries without the prompt, the floor no sharing can beat;

and the share of `each`'s time that sharing saves. Token counts are the server
tokenizer's.

Usage: .venv/bin/python -m bench.shared_prefix --model bench/out/models/qwen3-embedding-0.6b
           [--dtype float32] [--sizes 1,8,32] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from workers.heads import load_model
from workers.inference.corpus import sentences
from workers.preprocess.text import TokenItem, collate_tokens, load_tokenizer

# Queries: corpus texts cut to a query's length, in words.
QUERY_WORDS = (4, 24)


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up of this shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a decoder embedder's folder with a `query` prompt")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", default="1,8,32", help="queries per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    spec = resolve_model(ModelConfig(name="decoder", source=args.model, engine="torch", dtype=args.dtype))
    prompt = spec.prompts["query"]
    model = load_model(spec, threads=args.threads)
    packed = model.engine._packed
    tokenizer = load_tokenizer(spec)
    tokenizer.enable_truncation(spec.max_length)
    rng = np.random.default_rng(0)
    queries = [" ".join(text.split()[:int(rng.integers(*QUERY_WORDS))]) for text in sentences(256, 7)]

    def batch(texts: list[str]) -> tuple[dict[str, np.ndarray], int]:
        ids = [np.array(encoding.ids, dtype=np.int32) for encoding in tokenizer.encode_batch(texts)]
        return collate_tokens([TokenItem(row) for row in ids], model.engine.pad_id), sum(map(len, ids))

    def seconds(arrays: dict[str, np.ndarray], shares: bool) -> float:
        packed.shares_prefix = shares
        return best_seconds(lambda: model.forward(**arrays), args.repeats)

    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    print(f"prompt: {prompt_tokens} tokens; {args.dtype}, {args.threads} threads, best of {args.repeats}")
    print("| queries | tokens with prompt | without | shared ms | each ms | queries only ms | sharing saves |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        prompted, tokens = batch([prompt + query for query in queries[:size]])
        bare, bare_tokens = batch(queries[:size])
        shared, each, floor = seconds(prompted, True), seconds(prompted, False), seconds(bare, True)
        print(f"| {size} | {tokens} | {bare_tokens} | {shared * 1e3:.0f} | {each * 1e3:.0f} | {floor * 1e3:.0f} "
              f"| {1 - shared / each:.0%} |", flush=True)


if __name__ == "__main__":
    main()
