"""Rerank benchmark: our ``POST /v1/rerank`` against in-process ``CrossEncoder.predict``.

No cross-encoder weights are available offline, so the model is built once: the
packaged all-MiniLM-L6-v2 encoder (6 layers, hidden 384, the size of
cross-encoder/ms-marco-MiniLM-L-6-v2) under a one-logit sequence-classification head
with random weights (``torch.manual_seed(0)``), saved with ``save_pretrained`` next to
its BERT fast tokenizer (which hands out ``token_type_ids`` for pairs), in
``~/.cache/infinity-bench/minilm-cross-encoder``. Its scores mean nothing; its cost is
that of the real model.

Workload (``workers.inference.corpus``): queries are corpus sentences of 3 to 10 words
(``sentences(4000, seed=1)``), documents are consecutive corpus passages
(``sentences(20000, seed=0)``, 3 to 200 words). Request k pairs query k with the next
``docs`` passages, so no pair repeats.

One run, on this machine:

1. ``--prepare`` child: build the model if it is not cached, and score the check pairs
   with ``CrossEncoder.predict`` (sigmoid and raw logits).
2. ``--ceiling`` child (2 torch threads): ``CrossEncoder(folder, max_length=512)
   .predict(pairs, batch_size=32)`` over consecutive pairs of the 64-document workload,
   ``--ceiling-chunk`` pairs per call (predict() sorts each call's pairs by length), for
   ``--ceiling-duration`` s: the throughput ceiling. Then one request's worth per call
   (16 and 64 pairs) for ``--request-duration`` s each: latency and throughput of a
   server that would run each request alone.
3. our server (``python -m infinity serve --config models.toml``, in its own process
   group, stopped with it at the end, also on errors and Ctrl-C): check that its scores
   equal ``CrossEncoder.predict`` (max abs diff), then closed-loop loads (``--loads``,
   DOCSxCONCURRENCY), ``--warmup`` s discarded and ``--duration`` s measured each.

As in ``bench.run``, the ceiling and each load wait for a quiet CPU and are redone
when other processes used more than ``--max-noise`` of it (``bench.cpu``). The table
and the raw JSON go to ``bench/out/``.

Usage:
    .venv/bin/python -m bench.rerank
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
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

MODEL_DIR = Path.home() / ".cache" / "infinity-bench" / "minilm-cross-encoder"
MODEL_NAME = "reranker"
SEED = 0
MAX_LENGTH = 512  # max_position_embeddings of MiniLM-L6 and tokenizer's model_max_length
BATCH_SIZE = 32
DEFAULT_LOADS = "16x1,16x8,64x1,64x8"
QUERY_MAX_WORDS = 10
_BUILT_MARKER = ".bench-built"  # written last: a folder without it is incomplete


# --- workload ---------------------------------------------------------------------------


def queries(count: int = 4000, seed: int = 1) -> list[str]:
    """Short queries: the corpus sentences of 3 to ``QUERY_MAX_WORDS`` words."""
    return [t for t in sentences(count, seed) if len(t.split()) <= QUERY_MAX_WORDS]


class Workload:
    """Request k: query k with the next ``docs`` passages of the corpus (wrapping around)."""

    def __init__(self, docs: int, corpus_size: int = 20_000) -> None:
        self.docs = docs
        self._queries = queries()
        self._passages = sentences(corpus_size, 0)
        self._request = 0
        self._passage = 0

    def next(self) -> tuple[str, list[str]]:
        query = self._queries[self._request % len(self._queries)]
        self._request += 1
        start, n = self._passage, len(self._passages)
        self._passage = (start + self.docs) % n
        return query, [self._passages[(start + i) % n] for i in range(self.docs)]

    def pairs(self, count: int) -> list[tuple[str, str]]:
        """The next ``count`` pairs, request after request (``count`` a multiple of docs)."""
        out: list[tuple[str, str]] = []
        while len(out) < count:
            query, docs = self.next()
            out += [(query, d) for d in docs]
        return out[:count]


def check_requests() -> dict[str, tuple[str, list[str]]]:
    """Pairs on which the server must give CrossEncoder's scores: the first 64-document
    request of the load, a query with the 32 longest corpus passages, and one with
    documents longer than ``MAX_LENGTH`` tokens (cut on the document side)."""
    passages = sentences(20_000, 0)
    longest = sorted(passages, key=len, reverse=True)
    qs = queries()
    over = [" ".join(longest[i : i + 4]) for i in range(0, 16, 4)]  # about 800 words each
    return {
        "workload": Workload(64).next(),
        "longest": (qs[1], longest[:32]),
        "truncated": (qs[2], over + passages[:4]),
    }


# --- children: model building, reference scores, ceiling ----------------------------------


def build_model(folder: Path = MODEL_DIR) -> Path:
    """Build the MiniLM-L6 cross-encoder into ``folder`` unless it is already complete."""
    if (folder / _BUILT_MARKER).is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from infinity.folders.resolve import packaged_model_folder

    source = packaged_model_folder()
    torch.manual_seed(SEED)
    model = BertForSequenceClassification.from_pretrained(str(source), num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if not tokenizer.is_fast or "token_type_ids" not in tokenizer.model_input_names:
        raise RuntimeError(f"{source}: expected a BERT fast tokenizer with token_type_ids")
    staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / _BUILT_MARKER).write_text(f"from {source}, seed {SEED}\n")
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # an incomplete earlier build
        import shutil

        shutil.rmtree(folder)
    os.replace(staging, folder)
    print(f"built {folder}", file=sys.stderr)
    return folder


def _cross_encoder(threads: int):  # noqa: ANN202 (imports stay in the child)
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    return CrossEncoder(str(MODEL_DIR), device="cpu", max_length=MAX_LENGTH)


def prepare(threads: int) -> dict[str, object]:
    """Build the model; CrossEncoder's sigmoid scores and raw logits of the check pairs."""
    import torch

    build_model()
    model = _cross_encoder(threads)
    out: dict[str, object] = {"max_length": model.max_seq_length}
    for name, (query, docs) in check_requests().items():
        pairs = [(query, d) for d in docs]
        scores = model.predict(pairs, batch_size=BATCH_SIZE, show_progress_bar=False)
        raw = model.predict(pairs, batch_size=BATCH_SIZE, show_progress_bar=False,
                            activation_fn=torch.nn.Identity())  # fmt: skip
        tokens = [len(ids) for ids in model.tokenizer(pairs, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
        out[name] = {"scores": [float(s) for s in scores], "raw": [float(s) for s in raw],
                     "tokens": tokens}  # fmt: skip
    return out


def ceiling(threads: int, duration: float, chunk: int, request_duration: float) -> dict[str, object]:
    """Pairs/s of predict() over ``chunk``-pair calls; per-call latency of 16 and 64 pairs."""
    import sentence_transformers
    import torch
    import transformers

    model = _cross_encoder(threads)

    def predict(pairs: list[tuple[str, str]]) -> None:
        model.predict(pairs, batch_size=BATCH_SIZE, show_progress_bar=False)

    workload = Workload(64)
    predict(workload.pairs(64))  # warm-up: allocator, kernels, tokenizer
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        pairs = workload.pairs(chunk)
        predict(pairs)
        done += len(pairs)
    seconds = time.perf_counter() - start
    result: dict[str, object] = {
        "threads": threads, "batch_size": BATCH_SIZE, "chunk": chunk, "max_length": model.max_seq_length,
        "pairs": done, "seconds": seconds, "pairs_per_s": done / seconds,
        "torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
    }  # fmt: skip
    for docs in (16, 64):
        workload = Workload(docs)
        latencies = []
        begin = time.perf_counter()
        while time.perf_counter() - begin < request_duration:
            pairs = workload.pairs(docs)
            t0 = time.perf_counter()
            predict(pairs)
            latencies.append((time.perf_counter() - t0) * 1000.0)
        result[f"request_{docs}"] = {
            "calls": len(latencies),
            "pairs_per_s": docs * len(latencies) / (time.perf_counter() - begin),
            "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99)),
        }
    return result


# --- the server -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadShape:
    docs: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"1 query x {self.docs} docs, c{self.concurrency}"


def parse_loads(spec: str) -> list[LoadShape]:
    """``"16x1,64x8"``: DOCSxCONCURRENCY, comma separated."""
    return [LoadShape(docs, concurrency) for docs, concurrency in parse_pairs(spec)]


@dataclass
class LoadRow:
    docs: int
    concurrency: int
    requests: int
    errors: int
    pairs_per_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    first_error: str | None
    others_before: float
    others_during: float
    # CPU-seconds (user + system) per server process and of the load generator, during the load
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def check_rerank(payload: object, docs: int) -> None:
    """Raise ``ValueError`` unless ``payload`` ranks all ``docs`` documents, best first,
    with scores in [0, 1] and a token count."""
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise ValueError("response has no 'results' list")
    results = payload["results"]
    if sorted(r["index"] for r in results) != list(range(docs)):
        raise ValueError(f"expected indices 0..{docs - 1}, got {len(results)} results")
    scores = [r["relevance_score"] for r in results]
    if not all(0.0 <= s <= 1.0 for s in scores) or scores != sorted(scores, reverse=True):
        raise ValueError("scores out of [0, 1] or not in descending order")
    if not payload["usage"]["total_tokens"] > 0:
        raise ValueError("usage.total_tokens is not positive")


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def check_agreement(url: str, reference: dict[str, object]) -> dict[str, dict[str, float]]:
    """Score the check requests on the server; max abs difference to CrossEncoder.predict
    (sigmoid scores, raw logits) and the token counts."""
    out = {}
    for name, (query, docs) in check_requests().items():
        ref = reference[name]
        got = {}
        for raw in (False, True):
            payload = _post(f"{url}/v1/rerank", {"model": MODEL_NAME, "query": query,
                                                  "documents": docs, "raw_scores": raw})  # fmt: skip
            scores = np.full(len(docs), np.nan)
            for r in payload["results"]:
                scores[r["index"]] = r["relevance_score"]
            got[raw] = (scores, payload["usage"]["total_tokens"])
        out[name] = {
            "pairs": len(docs),
            "max_abs_diff": float(np.max(np.abs(got[False][0] - np.array(ref["scores"])))),
            "max_abs_diff_raw": float(np.max(np.abs(got[True][0] - np.array(ref["raw"])))),
            "tokens_server": got[False][1],
            "tokens_reference": sum(ref["tokens"]),
        }
    return out


def _group_cpu(pgid: int) -> dict[int, tuple[str, int]]:
    """pid -> (short command line, utime+stime ticks) of every process in group ``pgid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(rest[2]) != pgid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        command = b" ".join(argv).decode(errors="replace")
        pid = int(entry.name)
        name = ("front end" if pid == pgid else "resource tracker" if "resource_tracker" in command
                else "worker")  # fmt: skip
        out[pid] = (name, int(rest[11]) + int(rest[12]))
    return out


def _cpu_seconds(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, (name, ticks) in after.items():
        key = f"{name} [{pid}]"
        out[key] = (ticks - before.get(pid, (name, 0))[1]) / tick
    return out


def _load_once(args: argparse.Namespace, url: str, shape: LoadShape, workload: Workload,
               pgid: int) -> LoadRow:  # fmt: skip
    others_before = wait_quiet(args, pgid)

    def check(payload: object) -> None:
        check_rerank(payload, shape.docs)

    def next_request() -> tuple[dict[str, object], object]:
        query, docs = workload.next()
        return {"model": MODEL_NAME, "query": query, "documents": docs}, check

    before, procs_before = cpu.sample(pgid), _group_cpu(pgid)
    client_before = time.process_time()
    window = asyncio.run(closed_loop(url, "/v1/rerank", next_request, concurrency=shape.concurrency,
                                     duration=args.duration, warmup=args.warmup, timeout=120.0))  # fmt: skip
    others = cpu.other_share(before, cpu.sample(pgid))
    seconds = _cpu_seconds(procs_before, _group_cpu(pgid))
    seconds["load generator (this process)"] = time.process_time() - client_before
    return LoadRow(
        docs=shape.docs, concurrency=shape.concurrency, requests=window.good, errors=window.errors,
        pairs_per_s=window.good * shape.docs / args.duration,
        requests_per_s=window.good / args.duration,
        p50_ms=window.percentile(50), p99_ms=window.percentile(99), mean_ms=window.mean_ms(),
        first_error=window.first_error, others_before=others_before, others_during=others,
        cpu_seconds=seconds,
    )  # fmt: skip


@dataclass
class ServerReport:
    command: str
    config: str
    log: str
    agreement: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: list[LoadRow] = field(default_factory=list)
    error: str | None = None


def bench_server(args: argparse.Namespace, shapes: list[LoadShape], reference: dict[str, object],
                 stamp: str) -> ServerReport:  # fmt: skip
    config = f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{MODEL_DIR}"\n'
    ours = ConfiguredServer.prepare(config, "rerank", stamp)
    report = ServerReport(ours.command, config, str(ours.log.relative_to(REPO)))
    try:
        with ours.running(args.health_timeout) as server:
            report.agreement = check_agreement(ours.url, reference)
            for name, a in report.agreement.items():
                print(f"  agreement with CrossEncoder.predict, {name} ({a['pairs']} pairs): max abs diff "
                      f"{a['max_abs_diff']:.2e} (sigmoid), {a['max_abs_diff_raw']:.2e} (raw logits); "
                      f"tokens {a['tokens_server']} (server) vs {a['tokens_reference']}", flush=True)  # fmt: skip
            for shape in shapes:
                workload = Workload(shape.docs)
                row = least_disturbed(
                    args, lambda: _load_once(args, ours.url, shape, workload, server.pid),
                    lambda r: r.others_during,
                )  # fmt: skip
                report.rows.append(row)
                print(f"  {shape.label:>26}: {row.pairs_per_s:7.1f} pairs/s  p50 {row.p50_ms:8.1f} ms  "
                      f"p99 {row.p99_ms:8.1f} ms  errors {row.errors}  others' CPU {row.others_during:.0%}",
                      flush=True)  # fmt: skip
                cpu_line = ", ".join(f"{k} {v:.2f}" for k, v in
                                     sorted(row.cpu_seconds.items(), key=lambda kv: -kv[1]))  # fmt: skip
                print(f"    CPU-seconds: {cpu_line}", flush=True)
                if row.first_error:
                    print(f"    first error: {row.first_error}", flush=True)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        print(f"  FAILED: {report.error} (see {report.log})", flush=True)
    return report


# --- report ---------------------------------------------------------------------------


def markdown_table(ceil: dict[str, object], report: ServerReport) -> str:
    peak = float(ceil["pairs_per_s"])
    others = f"{ceil['others_during']:.0%}"
    lines = [
        "| target | load | pairs/s | requests/s | p50 ms | p99 ms | errors | vs ceiling | others' CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| ceiling (in-process) | predict batch 32, {ceil['chunk']} pairs per call | {peak:.1f} | - | - | - "
        f"| 0 | 1.00 | {others} |",
    ]
    for docs in (16, 64):
        r = ceil[f"request_{docs}"]
        lines.append(
            f"| ceiling (in-process) | predict {docs} pairs per call, one after another | "
            f"{r['pairs_per_s']:.1f} | {r['pairs_per_s'] / docs:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
            f"| 0 | {r['pairs_per_s'] / peak:.2f} | {others} |"
        )
    if report.error and not report.rows:
        lines.append(f"| ours | FAILED: {report.error} | | | | | | | |")
    for row in report.rows:
        lines.append(
            f"| ours | {LoadShape(row.docs, row.concurrency).label} | {row.pairs_per_s:.1f} | "
            f"{row.requests_per_s:.1f} | {fmt_number(row.p50_ms)} | {fmt_number(row.p99_ms)} | {row.errors} | "
            f"{row.pairs_per_s / peak:.2f} | {row.others_during:.0%} |"
        )
    return "\n".join(lines)


def _environment(ceil: dict[str, object]) -> dict[str, str]:
    import aiohttp
    import tokenizers

    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")), platform.processor())  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "cpu": f"{os.cpu_count()} vCPUs, {model_name}",
        "python": platform.python_version(),
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "versions": f"torch {ceil['torch']}, sentence-transformers {ceil['sentence_transformers']}, "
        f"transformers {ceil['transformers']}, tokenizers {tokenizers.__version__}, "
        f"numpy {np.__version__}, aiohttp {aiohttp.__version__}",
    }


# --- entry point ------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="DOCSxCONCURRENCY list")
    add_measurement_args(parser)
    parser.add_argument("--ceiling-chunk", type=int, default=1024, help="pairs per predict() call")
    parser.add_argument("--request-duration", type=float, default=8.0,
                        help="seconds of the one-request-per-call ceilings (16 and 64 pairs)")  # fmt: skip
    child = parser.add_mutually_exclusive_group()
    child.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    child.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def _child(args: argparse.Namespace, mode: str) -> list[str]:
    command = [sys.executable, "-m", "bench.rerank", f"--{mode}", "--threads", str(args.threads)]
    if mode == "ceiling":
        command += ["--ceiling-duration", str(args.ceiling_duration), "--ceiling-chunk", str(args.ceiling_chunk),
                    "--request-duration", str(args.request_duration)]  # fmt: skip
    return command


def main() -> int:
    args = _parse_args()
    if args.prepare:
        print(json.dumps(prepare(args.threads)))
        return 0
    if args.ceiling:
        print(json.dumps(ceiling(args.threads, args.ceiling_duration, args.ceiling_chunk, args.request_duration)))
        return 0

    shapes = parse_loads(args.loads)
    stamp = start_run()

    reference = child_answer(_child(args, "prepare"))
    print(f"  model: {MODEL_DIR} (CrossEncoder max_length {reference['max_length']})", flush=True)

    command = _child(args, "ceiling")
    ceil = measure_child(args, command)
    print(f"  ceiling: {ceil['pairs_per_s']:.1f} pairs/s ({ceil['chunk']} pairs per call); "
          + "; ".join(f"{d} pairs per call: {ceil[f'request_{d}']['pairs_per_s']:.1f} pairs/s, "
                      f"p50 {ceil[f'request_{d}']['p50_ms']:.1f} ms" for d in (16, 64))
          + f"; others' CPU {ceil['others_during']:.0%}", flush=True)  # fmt: skip

    report = bench_server(args, shapes, reference, stamp)
    table = markdown_table(ceil, report)
    env = _environment(ceil)
    print(f"\n{table}\n")
    for key, value in env.items():
        print(f"{key}: {value}")
    (OUT_DIR / f"{stamp}-rerank.md").write_text(table + "\n")
    raw = {"date": stamp, "args": vars(args), "environment": env, "model": str(MODEL_DIR),
           "ceiling": ceil, "server": asdict(report)}  # fmt: skip
    (OUT_DIR / f"{stamp}-rerank.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"\nsaved bench/out/{stamp}-rerank.md and .json")
    return 1 if report.error else 0


if __name__ == "__main__":
    sys.exit(main())
