"""A lone client against the same pass in process, text by text: how much the serving
path adds to one request's latency (bench/results/lone-request.md).

The machine's speed drifts by a fifth or more within minutes, so a served median and an
in-process median taken minutes apart do not compare. Here our server runs the model
(`dtype = "auto"` unless `--setting` says otherwise), this process loads the same folder
on the engine and dtype the server reports in `/v1/models` for a lone input (its
`lone_backend` where it has one), and each of the load
generator's first texts is run both ways, alternately: in process (tokenized, on the pass
a lone input gets), then as one `POST /v1/embeddings` over a kept-alive connection, with
a pause between so neither's threads still spin when the other runs. Reported: both
medians, their ratio, the median of the per-text ratios, and where a served request's
time went by the server's own histograms (`/metrics`: its time from headers to answer,
the queue, the pass) against the client's.

Usage: .venv/bin/python -m bench.lone [--model-dir FOLDER] [--texts 400] [--setting 'dtype = "float32"']
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit

from bench.engines import lone_pass, load_engine
from bench.loadgen import DEFAULT_MODEL, check_response
from bench.run import OUT_DIR, ConfiguredServer, add_quiet_cpu_args, wait_quiet
from infinity.folders.resolve import packaged_model_folder
from workers.inference.corpus import sentences

WARM_UP_TEXTS = 30
PAUSE_S = 0.03
# The server's histograms of a request's time, by what they time.
HISTOGRAMS = {"request": "infinity_request_duration_seconds", "queue": "infinity_queue_duration_seconds",
              "inference": "infinity_inference_duration_seconds"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="model folder (default: the packaged model), e.g. one of bench.base_models")
    parser.add_argument("--texts", type=int, default=400, help="measured texts, after the warm-up's")
    parser.add_argument("--setting", action="append", default=[], help="a models.toml line for the served model")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the in-process model")
    add_quiet_cpu_args(parser)
    args = parser.parse_args()
    folder = args.model_dir or str(packaged_model_folder())
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    config = "\n".join(["[[models]]", f'name = "{DEFAULT_MODEL}"', f'source = "{folder}"', *args.setting]) + "\n"
    server = ConfiguredServer.prepare(config, "lone", stamp)
    with server.running(args.health_timeout):
        url = urlsplit(server.url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        engine, dtype = _served_engine(connection)
        print(f"  served on {engine} {dtype}; loading the same in process", flush=True)
        model, tokenizer = load_engine(f"{engine}:{dtype}", args.threads, args.model_dir)
        run_locally = lone_pass(model, tokenizer)
        texts = sentences(WARM_UP_TEXTS + args.texts, 0)
        wait_quiet(args)
        local, served = [], []
        for index, text in enumerate(texts):
            if index == WARM_UP_TEXTS:
                local, served, before = [], [], _histogram_totals(connection)
            local.append(_seconds(lambda: run_locally(text)))
            time.sleep(PAUSE_S)
            served.append(_seconds(lambda: _embed(connection, text)))
            time.sleep(PAUSE_S)
        after = _histogram_totals(connection)
    figures = {"date": stamp, "folder": folder, "settings": args.setting, "engine": engine, "dtype": dtype,
               "texts": args.texts, "in_process_p50_ms": statistics.median(local) * 1e3,
               "served_p50_ms": statistics.median(served) * 1e3,
               "per_text_ratio_p50": statistics.median(s / t for s, t in zip(served, local)),
               "in_process_mean_ms": statistics.mean(local) * 1e3, "served_mean_ms": statistics.mean(served) * 1e3}
    figures["ratio_of_medians"] = figures["served_p50_ms"] / figures["in_process_p50_ms"]
    for what, name in HISTOGRAMS.items():
        total, count = (after[name][i] - before[name][i] for i in (0, 1))
        figures[f"server_{what}_mean_ms"] = total / count * 1e3 if count else float("nan")
    print(f"  {engine} {dtype}, {args.texts} texts one at a time: in process p50 {figures['in_process_p50_ms']:.2f} ms, "
          f"served p50 {figures['served_p50_ms']:.2f} ms: {figures['ratio_of_medians']:.2f}x "
          f"(per-text ratio p50 {figures['per_text_ratio_p50']:.2f})", flush=True)
    serving_path = (figures["server_request_mean_ms"] - figures["server_queue_mean_ms"]
                    - figures["server_inference_mean_ms"])
    print(f"  means: in process {figures['in_process_mean_ms']:.2f} ms; served {figures['served_mean_ms']:.2f} ms = "
          f"server {figures['server_request_mean_ms']:.2f} (queue {figures['server_queue_mean_ms']:.2f}, pass "
          f"{figures['server_inference_mean_ms']:.2f}, the rest {serving_path:.2f}) + client and HTTP "
          f"{figures['served_mean_ms'] - figures['server_request_mean_ms']:.2f}", flush=True)
    (OUT_DIR / f"{stamp}-lone.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-lone.json")


def _served_engine(connection: http.client.HTTPConnection) -> tuple[str, str]:
    """The engine and dtype the server runs a lone input on."""
    connection.request("GET", "/v1/models")
    model = next(m for m in json.loads(connection.getresponse().read())["data"] if m["id"] == DEFAULT_MODEL)
    return model["lone_backend"] or model["backend"], model["dtype"]


def _embed(connection: http.client.HTTPConnection, text: str) -> None:
    body = json.dumps({"model": DEFAULT_MODEL, "input": text})
    connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {payload[:200]!r}")
    check_response(json.loads(payload), 1, "float")


def _histogram_totals(connection: http.client.HTTPConnection) -> dict[str, tuple[float, float]]:
    """Each of `HISTOGRAMS`' (sum of seconds, count) over all its labels, from `/metrics`."""
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return {name: tuple(sum(float(value) for value in re.findall(rf"^{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M))
                        for part in ("sum", "count"))
            for name in HISTOGRAMS.values()}


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
