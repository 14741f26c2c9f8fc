"""Sparse (SPLADE) benchmark: our ``POST /embed_sparse`` against in-process
``SparseEncoder.encode`` on the same folder, in the same run.

No SPLADE weights are available offline, so the model is built once: a BERT-base masked
language model (12 layers, hidden 768, the BERT uncased vocabulary of 30522 from the
packaged all-MiniLM-L6-v2 tokenizer, 512 positions) with random weights
(``torch.manual_seed(0)``), saved by sentence-transformers' ``SparseEncoder``
(Transformer with the fill-mask task, then SpladePooling: max of log(1 + relu)) in
``~/.cache/infinity-bench/splade-bert-base``. Random logits would leave half the
vocabulary nonzero; the MLM output bias is lowered so that a median corpus text keeps
about ``TARGET_NONZERO`` entries, as trained SPLADE documents do, since the answer's size
is part of what a server pays. Its weights mean nothing; its cost is the real model's.

Workload (``workers.inference.corpus``): request k holds the next ``batch`` corpus texts
(``sentences(20000, seed=0)``, 3 to 200 words), so no text repeats.

One run, on this machine:

1. ``--prepare`` child: build the model if it is not cached, and encode the check texts
   with ``SparseEncoder.encode``.
2. ``--ceiling`` child (``--threads`` torch threads): ``SparseEncoder(folder).encode(
   chunk, batch_size=32)`` over consecutive ``--ceiling-chunk``-text chunks of the corpus
   for ``--ceiling-duration`` s (encode() sorts each chunk by length): texts/s.
3. our server (``python -m infinity serve --config models.toml``, engine ``--engine``,
   in its own process group, stopped with it at the end, also on errors and Ctrl-C):
   check that its vectors are the reference's (same indices, max abs difference of
   values), then closed-loop loads (``--loads``, BATCHxCONCURRENCY) on ``/embed_sparse``,
   ``--warmup`` s discarded and ``--duration`` s measured each: texts/s at saturation.

As in ``bench.run``, the ceiling and each load wait for a quiet CPU and are redone when
other processes used more than ``--max-noise`` of it (``bench.cpu``). The table and the
raw JSON go to ``bench/out/``. ``--layers 2`` builds (and caches apart) a shallow model
for checking this script quickly; its numbers are not the benchmark's.

Usage:
    .venv/bin/python -m bench.sparse
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench import cpu
from workers.inference.corpus import sentences
from bench.loadgen import closed_loop
from bench.run import (ConfiguredServer, OUT_DIR, REPO, add_measurement_args, child_answer, fmt_number,
                       least_disturbed, measure_child, parse_pairs, start_run, wait_quiet)

MODEL_ROOT = Path.home() / ".cache" / "infinity-bench"
MODEL_NAME = "splade"
SEED = 0
MAX_LENGTH = 512
BATCH_SIZE = 32
TARGET_NONZERO = 150  # entries of a median corpus text (trained SPLADE documents: some 100 to 300)
DEFAULT_LOADS = "32x4,32x8"
CORPUS_SIZE = 20_000
_BUILT_MARKER = ".bench-built"  # written last: a folder without it is incomplete


def model_dir(layers: int) -> Path:
    return MODEL_ROOT / ("splade-bert-base" if layers == 12 else f"splade-bert-base-{layers}-layers")


class Workload:
    """Request k: the next ``batch`` corpus texts (wrapping around)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self._texts = sentences(CORPUS_SIZE, 0)
        self._next = 0

    def next(self) -> list[str]:
        start, n = self._next, len(self._texts)
        self._next = (start + self.batch) % n
        return [self._texts[(start + i) % n] for i in range(self.batch)]


def check_texts() -> list[str]:
    """Texts on which the server must give the reference's vectors: the first 32 of the
    load, the 8 longest of the corpus, and 4 over ``MAX_LENGTH`` tokens (cut)."""
    corpus = sentences(CORPUS_SIZE, 0)
    longest = sorted(corpus, key=len, reverse=True)
    return corpus[:32] + longest[:8] + [" ".join(longest[i:i + 4]) for i in range(0, 16, 4)]


# --- children: model building, reference vectors, ceiling -----------------------------------


def build_model(layers: int) -> Path:
    """Build the SPLADE model into ``model_dir(layers)`` unless it is already complete."""
    folder = model_dir(layers)
    if (folder / _BUILT_MARKER).is_file():
        return folder
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from infinity.folders.resolve import packaged_model_folder

    staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    masked_lm = staging / "masked-lm"
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_folder()), model_max_length=MAX_LENGTH)
    tokenizer.save_pretrained(masked_lm)
    torch.manual_seed(SEED)
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, num_hidden_layers=layers,
                                       max_position_embeddings=MAX_LENGTH)).eval()  # fmt: skip
    with torch.no_grad():
        model.cls.predictions.bias.fill_(-_bias_quantile(model, tokenizer))
    model.save_pretrained(masked_lm)
    encoder = SparseEncoder(modules=[Transformer(str(masked_lm), transformer_task="fill-mask",
                                                 max_seq_length=MAX_LENGTH), SpladePooling("max")])  # fmt: skip
    encoder.save(str(staging / "model"))
    (staging / "model" / _BUILT_MARKER).write_text(f"{layers} layers, seed {SEED}, ~{TARGET_NONZERO} nonzero\n")
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier build
    os.replace(staging / "model", folder)
    shutil.rmtree(staging)
    print(f"built {folder}", file=sys.stderr)
    return folder


def _bias_quantile(model, tokenizer) -> float:  # noqa: ANN001 (torch and transformers stay in the child)
    """The logit that about ``TARGET_NONZERO`` vocabulary entries of a median corpus text
    exceed at some token: lowering every entry's bias by it leaves them nonzero."""
    import torch

    thresholds = []
    for text in sentences(16, 1):
        inputs = tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_LENGTH)
        with torch.inference_mode():
            best = model(**inputs).logits[0].amax(dim=0)
        thresholds.append(float(torch.topk(best, TARGET_NONZERO).values[-1]))
    return float(np.median(thresholds))


def _encoder(layers: int, threads: int):  # noqa: ANN202 (imports stay in the child)
    import torch
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(threads)
    return SparseEncoder(str(model_dir(layers)), device="cpu")


def prepare(layers: int, threads: int) -> dict[str, object]:
    """Build the model; SparseEncoder's nonzero entries of the check texts."""
    build_model(layers)
    model = _encoder(layers, threads)
    vectors = model.encode(check_texts(), batch_size=BATCH_SIZE, convert_to_sparse_tensor=False).numpy()
    return {"max_length": model.max_seq_length,
            "vectors": [[np.flatnonzero(v).tolist(), v[np.flatnonzero(v)].tolist()] for v in vectors]}  # fmt: skip


def ceiling(layers: int, threads: int, duration: float, chunk: int) -> dict[str, object]:
    """Texts/s of encode() over ``chunk``-text calls, one after another."""
    import sentence_transformers
    import torch
    import transformers

    model = _encoder(layers, threads)
    workload = Workload(chunk)
    model.encode(workload.next(), batch_size=BATCH_SIZE)  # warm-up: allocator, kernels, tokenizer
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        done += len(model.encode(workload.next(), batch_size=BATCH_SIZE))
    seconds = time.perf_counter() - start
    return {"threads": threads, "batch_size": BATCH_SIZE, "chunk": chunk, "texts": done, "seconds": seconds,
            "texts_per_s": done / seconds, "torch": torch.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__}  # fmt: skip


# --- the server ------------------------------------------------------------------------------


@dataclass
class LoadRow:
    batch: int
    concurrency: int
    requests: int
    errors: int
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    first_error: str | None
    others_before: float
    others_during: float


def check_sparse(payload: object, batch: int) -> None:
    """Raise ``ValueError`` unless ``payload`` holds ``batch`` lists of entries by index."""
    if not isinstance(payload, list) or len(payload) != batch:
        raise ValueError(f"expected {batch} sparse vectors")
    for entries in payload:
        indices = [entry["index"] for entry in entries]
        if not indices or indices != sorted(indices):
            raise ValueError("a vector is empty or not sorted by index")


def _post(url: str, body: dict[str, object]) -> object:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def check_agreement(url: str, reference: dict[str, object]) -> dict[str, float]:
    """The check texts on the server against SparseEncoder: how many vectors have other
    indices, the largest difference of a value, and the median nonzero entries."""
    served = _post(f"{url}/embed_sparse", {"model": MODEL_NAME, "inputs": check_texts()})
    other_indices, worst = 0, 0.0
    for entries, (indices, values) in zip(served, reference["vectors"], strict=True):
        if [entry["index"] for entry in entries] != indices:
            other_indices += 1
            continue
        worst = max(worst, float(np.max(np.abs(np.array([e["value"] for e in entries]) - values), initial=0.0)))
    return {"texts": len(served), "other_indices": other_indices, "max_abs_diff": worst,
            "median_nonzero": float(np.median([len(indices) for indices, _ in reference["vectors"]]))}  # fmt: skip


def _load_once(args: argparse.Namespace, url: str, batch: int, concurrency: int, pgid: int) -> LoadRow:
    others_before = wait_quiet(args, pgid)
    workload = Workload(batch)

    def next_request() -> tuple[dict[str, object], object]:
        return {"model": MODEL_NAME, "inputs": workload.next()}, lambda payload: check_sparse(payload, batch)

    before = cpu.sample(pgid)
    window = asyncio.run(closed_loop(url, "/embed_sparse", next_request, concurrency=concurrency,
                                     duration=args.duration, warmup=args.warmup, timeout=300.0))  # fmt: skip
    return LoadRow(batch=batch, concurrency=concurrency, requests=window.good, errors=window.errors,
                   texts_per_s=window.good * batch / args.duration, p50_ms=window.percentile(50),
                   p99_ms=window.percentile(99), first_error=window.first_error, others_before=others_before,
                   others_during=cpu.other_share(before, cpu.sample(pgid)))  # fmt: skip


@dataclass
class ServerReport:
    command: str
    config: str
    log: str
    agreement: dict[str, float] = field(default_factory=dict)
    rows: list[LoadRow] = field(default_factory=list)
    error: str | None = None


def bench_server(args: argparse.Namespace, reference: dict[str, object], stamp: str) -> ServerReport:
    config = f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{model_dir(args.layers)}"\nengine = "{args.engine}"\n'
    ours = ConfiguredServer.prepare(config, "sparse", stamp)
    report = ServerReport(ours.command, config, str(ours.log.relative_to(REPO)))
    try:
        with ours.running(args.health_timeout) as server:
            report.agreement = a = check_agreement(ours.url, reference)
            print(f"  agreement with SparseEncoder.encode ({a['texts']} texts, median {a['median_nonzero']:.0f} "
                  f"nonzero): {a['other_indices']} with other indices, max abs diff {a['max_abs_diff']:.2e}",
                  flush=True)  # fmt: skip
            for batch, concurrency in parse_pairs(args.loads):
                row = least_disturbed(args, lambda: _load_once(args, ours.url, batch, concurrency, server.pid),
                                      lambda r: r.others_during)  # fmt: skip
                report.rows.append(row)
                print(f"  {batch} texts x c{concurrency}: {row.texts_per_s:7.1f} texts/s  p50 {row.p50_ms:8.1f} ms  "
                      f"p99 {row.p99_ms:8.1f} ms  errors {row.errors}  others' CPU {row.others_during:.0%}",
                      flush=True)  # fmt: skip
                if row.first_error:
                    print(f"    first error: {row.first_error}", flush=True)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        print(f"  FAILED: {report.error} (see {report.log})", flush=True)
    return report


# --- report and entry point -------------------------------------------------------------------


def markdown_table(ceil: dict[str, object], report: ServerReport, engine: str) -> str:
    peak = float(ceil["texts_per_s"])
    lines = [
        "| target | load | texts/s | p50 ms | p99 ms | errors | vs ceiling | others' CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        f"| ceiling (in-process) | SparseEncoder.encode batch 32, {ceil['chunk']} texts per call | {peak:.1f} "
        f"| - | - | 0 | 1.00 | {ceil['others_during']:.0%} |",
    ]  # fmt: skip
    if report.error and not report.rows:
        lines.append(f"| ours ({engine}) | FAILED: {report.error} | | | | | | |")
    for row in report.rows:
        lines.append(f"| ours ({engine}) | {row.batch} texts per request, c{row.concurrency} | {row.texts_per_s:.1f} "
                     f"| {fmt_number(row.p50_ms)} | {fmt_number(row.p99_ms)} | {row.errors} "
                     f"| {row.texts_per_s / peak:.2f} | {row.others_during:.0%} |")  # fmt: skip
    return "\n".join(lines)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="BATCHxCONCURRENCY list")
    parser.add_argument("--engine", default="auto", choices=["auto", "onnx", "torch"], help="our server's engine")
    add_measurement_args(parser, duration=30.0, warmup=5.0, ceiling_duration=30.0, health_timeout=900.0)
    parser.add_argument("--ceiling-chunk", type=int, default=256, help="texts per encode() call")
    parser.add_argument("--layers", type=int, default=12, help="fewer only to check this script quickly")
    child = parser.add_mutually_exclusive_group()
    child.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    child.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def _child(args: argparse.Namespace, mode: str) -> list[str]:
    command = [sys.executable, "-m", "bench.sparse", f"--{mode}", "--threads", str(args.threads),
               "--layers", str(args.layers)]  # fmt: skip
    if mode == "ceiling":
        command += ["--ceiling-duration", str(args.ceiling_duration), "--ceiling-chunk", str(args.ceiling_chunk)]
    return command


def main() -> int:
    args = _parse_args()
    if args.prepare:
        print(json.dumps(prepare(args.layers, args.threads)))
        return 0
    if args.ceiling:
        print(json.dumps(ceiling(args.layers, args.threads, args.ceiling_duration, args.ceiling_chunk)))
        return 0

    parse_pairs(args.loads)  # a bad load list fails before anything is built
    stamp = start_run()

    reference = child_answer(_child(args, "prepare"))
    print(f"  model: {model_dir(args.layers)} (SparseEncoder max_seq_length {reference['max_length']})", flush=True)

    command = _child(args, "ceiling")
    ceil = measure_child(args, command)
    print(f"  ceiling: {ceil['texts_per_s']:.1f} texts/s ({ceil['chunk']} texts per call); "
          f"others' CPU {ceil['others_during']:.0%}", flush=True)  # fmt: skip

    report = bench_server(args, reference, stamp)
    table = markdown_table(ceil, report, args.engine)
    print(f"\n{table}\n")
    (OUT_DIR / f"{stamp}-sparse.md").write_text(table + "\n")
    raw = {"date": stamp, "args": vars(args), "model": str(model_dir(args.layers)), "ceiling": ceil,
           "server": asdict(report)}  # fmt: skip
    (OUT_DIR / f"{stamp}-sparse.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-sparse.md and .json")
    return 1 if report.error else 0


if __name__ == "__main__":
    sys.exit(main())
