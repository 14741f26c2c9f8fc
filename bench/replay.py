"""In-process replay of how a group of mixed-length texts is run by the torch engine:
one padded batch, passes cut by the batching cost model (padded), and the same passes
with the padding-free BERT forward.

Usage: .venv/bin/python -m bench.replay [--groups 12] [--size 16] [--overhead 28]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tokenizers import Tokenizer

from workers.inference.corpus import sentences
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from workers.inference.scheduler import split_by_cost
from workers.heads import load_model


def pad_batch(group: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.zeros((len(group), max(len(x) for x in group)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, x in enumerate(group):
        ids[row, :len(x)] = x
        mask[row, :len(x)] = 1
    return ids, mask, np.zeros_like(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--size", type=int, default=16, help="texts per group (the queue depth)")
    parser.add_argument("--overhead", type=float, default=28.0, help="pass cost in tokens (the server calibrates it)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    spec = resolve_model(ModelConfig(name="default", engine="torch"))
    model = load_model(spec, args.threads)
    engine = model.engine
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    corpus = [np.array(e.ids) for e in tokenizer.encode_batch(sentences(4000, 0))]
    rng = np.random.default_rng(0)
    groups = [sorted((corpus[i] for i in rng.choice(len(corpus), args.size, replace=False)), key=len)
              for _ in range(args.groups)]
    packed = engine._packed
    strategies = {
        "one padded batch": (None, False),
        "cost-model passes, padded": (args.overhead, False),
        "cost-model passes, padding-free": (args.overhead, True),
    }
    model.forward(*pad_batch(groups[0]))  # warm-up
    print("| how a group runs | sentences/s |\n|---|---:|")
    for name, (overhead, padding_free) in strategies.items():
        engine._packed = packed if padding_free else None
        start = time.perf_counter()
        for group in groups:
            passes = [(0, len(group) - 1)] if overhead is None else split_by_cost([len(x) for x in group], overhead)
            for first, last in passes:
                model.forward(*pad_batch(group[first:last + 1]))
        print(f"| {name} | {args.groups * args.size / (time.perf_counter() - start):.1f} |")


if __name__ == "__main__":
    main()
