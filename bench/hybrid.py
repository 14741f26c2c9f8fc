"""Hybrid (BGE-M3) benchmark: what asking for all three outputs costs against asking for
the dense vector alone, on one server, under the same load (issue 29's goal: at most
1.15x, in texts/s).

No BGE-M3 weights are available offline, so the model is built once: BGE-M3's encoder
shape (XLM-RoBERTa large: 24 layers, hidden 1024, 16 heads, 4096 intermediate) with
random weights (``torch.manual_seed(0)``), the packaged all-MiniLM-L6-v2 tokenizer (a
30522-entry vocabulary instead of BGE-M3's 250002: only the embedding table, which no
pass multiplies by, is smaller), 512 positions, and random ``sparse_linear.pt`` (1024 -> 1)
and ``colbert_linear.pt`` (1024 -> 1024) beside it, as FlagEmbedding lays BGE-M3 out, in
``~/.cache/infinity-bench/bge-m3-shape``. Its weights mean nothing; its cost is the real
model's but for the vocabulary.

Workload (``workers.inference.corpus``): request k holds the next ``batch`` corpus texts
(``sentences(20000, seed=0)``, 3 to 200 words), the same sequence for both kinds of
request. For each load (``--loads``, BATCHxCONCURRENCY), closed-loop ``POST
/v1/embeddings`` first with the plain body (the dense vector), then with ``"outputs":
["dense", "sparse", "multivector"]``, ``--warmup`` s discarded and ``--duration`` s
measured each, each redone when other processes used more than ``--max-noise`` of the
CPU (``bench.cpu``). The server (``--engine``) runs in its own process group, stopped at
the end, also on errors and Ctrl-C. The table and the raw JSON go to ``bench/out/``.
``--layers 2`` builds (and caches apart) a shallow model for checking this script
quickly; its numbers are not the benchmark's.

Usage:
    .venv/bin/python -m bench.hybrid
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cpu
from bench.loadgen import Corpus, closed_loop
from bench.run import (ConfiguredServer, OUT_DIR, REPO, add_quiet_cpu_args, fmt_number, least_disturbed, parse_pairs,
                       start_run, wait_quiet)
from workers.inference.corpus import sentences

MODEL_ROOT = Path.home() / ".cache" / "infinity-bench"
MODEL_NAME = "bge-m3-shape"
SEED = 0
MAX_LENGTH = 512
HIDDEN = 1024
DEFAULT_LOADS = "32x4,32x8"
CORPUS_SIZE = 20_000
EVERY_OUTPUT = ["dense", "sparse", "multivector"]
_BUILT_MARKER = ".bench-built"  # written last: a folder without it is incomplete


def model_dir(layers: int) -> Path:
    return MODEL_ROOT / ("bge-m3-shape" if layers == 24 else f"bge-m3-shape-{layers}-layers")


def build_model(layers: int) -> Path:
    """Build the model into ``model_dir(layers)`` unless it is already complete."""
    folder = model_dir(layers)
    if (folder / _BUILT_MARKER).is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    from infinity.folders.resolve import packaged_model_folder

    staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_folder()), model_max_length=MAX_LENGTH)
    tokenizer.save_pretrained(staging)
    torch.manual_seed(SEED)
    config = XLMRobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, num_hidden_layers=layers,
                              num_attention_heads=16, intermediate_size=4 * HIDDEN, pad_token_id=tokenizer.pad_token_id,
                              max_position_embeddings=MAX_LENGTH + 2)
    XLMRobertaModel(config).eval().save_pretrained(staging)
    torch.save(torch.nn.Linear(HIDDEN, 1).state_dict(), staging / "sparse_linear.pt")
    torch.save(torch.nn.Linear(HIDDEN, HIDDEN).state_dict(), staging / "colbert_linear.pt")
    (staging / _BUILT_MARKER).write_text(f"{layers} layers, seed {SEED}\n")
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier build
    os.replace(staging, folder)
    print(f"built {folder}", file=sys.stderr)
    return folder


def check_answer(payload: object, batch: int, fields: set[str]) -> None:
    """Raise ``ValueError`` unless ``payload`` holds ``batch`` items, each with ``fields``."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != batch or any(not fields <= set(item) for item in data):
        raise ValueError(f"expected {batch} items with {', '.join(sorted(fields))}")


@dataclass
class LoadRow:
    outputs: str  # "dense" or "all three"
    batch: int
    concurrency: int
    requests: int
    errors: int
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    first_error: str | None
    others_during: float


def _load_once(args: argparse.Namespace, url: str, batch: int, concurrency: int, outputs: list[str] | None,
               pgid: int) -> LoadRow:
    wait_quiet(args, pgid)
    corpus = Corpus(sentences(CORPUS_SIZE, 0))
    asked = {"outputs": outputs} if outputs else {}
    fields = set(outputs) if outputs else {"embedding"}

    def next_request() -> tuple[dict[str, object], object]:
        return ({"model": MODEL_NAME, "input": corpus.take(batch), **asked},
                lambda payload: check_answer(payload, batch, fields))

    before = cpu.sample(pgid)
    window = asyncio.run(closed_loop(url, "/v1/embeddings", next_request, concurrency=concurrency,
                                     duration=args.duration, warmup=args.warmup, timeout=300.0))  # fmt: skip
    return LoadRow(outputs="all three" if outputs else "dense", batch=batch, concurrency=concurrency,
                   requests=window.good, errors=window.errors, texts_per_s=window.good * batch / args.duration,
                   p50_ms=window.percentile(50), p99_ms=window.percentile(99), first_error=window.first_error,
                   others_during=cpu.other_share(before, cpu.sample(pgid)))  # fmt: skip


def bench_server(args: argparse.Namespace, stamp: str) -> tuple[ConfiguredServer, list[LoadRow], str | None]:
    config = f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{model_dir(args.layers)}"\nengine = "{args.engine}"\n'
    ours = ConfiguredServer.prepare(config, "hybrid", stamp)
    rows: list[LoadRow] = []
    try:
        with ours.running(args.health_timeout) as server:
            for batch, concurrency in parse_pairs(args.loads):
                for outputs in (None, EVERY_OUTPUT):
                    row = least_disturbed(args, lambda: _load_once(args, ours.url, batch, concurrency, outputs,
                                                                   server.pid), lambda r: r.others_during)
                    rows.append(row)
                    print(f"  {row.outputs:>9}, {batch} texts x c{concurrency}: {row.texts_per_s:7.1f} texts/s  "
                          f"p50 {row.p50_ms:8.1f} ms  p99 {row.p99_ms:8.1f} ms  errors {row.errors}  "
                          f"others' CPU {row.others_during:.0%}", flush=True)  # fmt: skip
                    if row.first_error:
                        print(f"    first error: {row.first_error}", flush=True)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"  FAILED: {error} (see {ours.log.relative_to(REPO)})", flush=True)
        return ours, rows, error
    return ours, rows, None


def markdown_table(rows: list[LoadRow], engine: str) -> str:
    """A line per load: texts/s of each kind of request and what all three cost (dense
    texts/s over all three's texts/s)."""
    lines = ["| engine | load | dense texts/s | all three texts/s | all three cost | p50 ms dense / all three |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for dense, every in zip(rows[::2], rows[1::2]):
        cost = dense.texts_per_s / every.texts_per_s if every.texts_per_s else float("inf")
        lines.append(f"| {engine} | {dense.batch} texts per request, c{dense.concurrency} | {dense.texts_per_s:.1f} "
                     f"| {every.texts_per_s:.1f} | {cost:.2f}x | {fmt_number(dense.p50_ms)} / "
                     f"{fmt_number(every.p50_ms)} |")  # fmt: skip
    return "\n".join(lines)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="BATCHxCONCURRENCY list")
    parser.add_argument("--engine", default="auto", choices=["auto", "torch", "onnx", "ctranslate2", "openvino"],
                        help="our server's engine")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=5.0, help="discarded seconds per load")
    parser.add_argument("--layers", type=int, default=24, help="fewer only to check this script quickly")
    add_quiet_cpu_args(parser, health_timeout=900.0)
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    parse_pairs(args.loads)  # a bad load list fails before anything is built
    stamp = start_run()
    print(f"  model: {build_model(args.layers)}", flush=True)
    ours, rows, error = bench_server(args, stamp)
    table = markdown_table(rows, args.engine)
    print(f"\n{table}\n")
    (OUT_DIR / f"{stamp}-hybrid.md").write_text(table + "\n")
    raw = {"date": stamp, "args": vars(args), "model": str(model_dir(args.layers)), "command": ours.command,
           "log": str(ours.log.relative_to(REPO)), "rows": [asdict(row) for row in rows], "error": error}
    (OUT_DIR / f"{stamp}-hybrid.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-hybrid.md and .json")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
