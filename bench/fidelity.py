"""Fidelity and speed of reduced precisions against float32, in process: for a text
embedding model, each ENGINE:DTYPE given (CTranslate2 or ONNX int8, torch bfloat16, ...)
embeds the same corpus sentences as torch float32 does (the reference); reported per
precision: the cosine of each sentence's vector to the reference's (mean and minimum),
how many of each sentence's 10 nearest neighbours among the corpus stay the same, the
sentences/s of batches of 32 of similar length (shared by the engine's lanes, as the
server shares them) and the fastest lone short sentence.

Usage: .venv/bin/python -m bench.fidelity [--model-dir DIR] [--precision ctranslate2:int8 ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from workers.inference.corpus import sentences
from workers.heads import LoadedModel, load_model
from workers.inference.precision import (TrialInputs, milliseconds, per_second, row_cosines, size_torch_threads,
                                         text_inputs)

REFERENCE = "torch:float32"
DEFAULT_PRECISIONS = ("ctranslate2:float32", "ctranslate2:int8", "onnx:int8", "torch:bfloat16")
BATCH = 32
NEIGHBOURS = 10


def encode(model: LoadedModel, inputs: TrialInputs) -> np.ndarray:
    return np.vstack([np.asarray(run(model)) for run in inputs.batches]).astype(np.float64)


def neighbour_overlap(vectors: np.ndarray, reference: np.ndarray) -> float:
    """The mean share of each sentence's `NEIGHBOURS` nearest others (by cosine) that the
    reference vectors find too."""
    def nearest(v: np.ndarray) -> np.ndarray:
        unit = v / np.linalg.norm(v, axis=1, keepdims=True)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=1)[:, :NEIGHBOURS]

    ours, theirs = nearest(vectors), nearest(reference)
    return float(np.mean([len(set(a) & set(b)) / NEIGHBOURS for a, b in zip(ours, theirs)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="model folder (default: the packaged model)")
    parser.add_argument("--precision", action="append", help=f"ENGINE:DTYPE; repeat (default {DEFAULT_PRECISIONS})")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    precisions = args.precision or list(DEFAULT_PRECISIONS)

    def load(choice: str) -> LoadedModel:
        engine, _, dtype = choice.partition(":")
        source = {"source": args.model_dir} if args.model_dir else {}
        return load_model(resolve_model(ModelConfig(name="model", engine=engine, dtype=dtype, **source)), args.threads)

    reference = load(REFERENCE)
    spec = resolve_model(ModelConfig(name="model", **({"source": args.model_dir} if args.model_dir else {})))
    # Timed as the bfloat16 trial times its inputs (workers/inference/precision.py); the lone
    # sentence is one of the shorter quarter.
    timed = text_inputs(spec, reference.engine.pad_id, sentences(args.texts, 7), BATCH, 4)
    lone = timed.lones[1]
    size_torch_threads(reference, args.threads)
    exact = encode(reference, timed)
    rows = []
    for choice in [REFERENCE, *precisions]:
        try:
            model = reference if choice == REFERENCE else load(choice)
        except Exception as exc:  # an engine that cannot take this model or dtype: say so
            rows.append({"precision": choice, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{choice}: cannot load ({exc})", file=sys.stderr, flush=True)
            continue
        size_torch_threads(model, args.threads)
        vectors = encode(model, timed)  # also the warm-up of these shapes
        cosines = row_cosines([vectors], [exact])
        rows.append({"precision": choice, "engine": model.engine.name, "mean_cosine": float(cosines.mean()),
                     "min_cosine": float(cosines.min()), "top10_overlap": neighbour_overlap(vectors, exact),
                     "sentences_per_s": max(per_second(model, timed) for _ in range(2)),
                     "lone_ms": min(milliseconds(lambda: lone(model)) for _ in range(20))})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"| precision | mean cosine | min cosine | top-{NEIGHBOURS} overlap | sentences/s (batches of {BATCH}) "
              "| lone sentence ms |\n| --- | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            if "error" in row:
                print(f"| {row['precision']} | {row['error']} | | | | |")
            else:
                print(f"| {row['precision']} | {row['mean_cosine']:.6f} | {row['min_cosine']:.6f} | "
                      f"{row['top10_overlap']:.1%} | {row['sentences_per_s']:.1f} | {row['lone_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
