"""Where one client's requests spend their time inside the server, from the server's own
traces: the server runs with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at a collector in this
process (OTLP/HTTP on loopback), one client sends the load generator's first texts one at
a time, and each request's spans give its stages, medians over the requests:

    before tokenize   the server span's start to the tokenize span's (HTTP body, decode, admission)
    tokenize          the tokenize span
    to inference      tokenize's end to the queue span's start (the front end sends Infer; the
                      inference process receives and queues it)
    queue             the queue span (waiting for a lane, the cut)
    pass              the batch spans, first start to last end
    back              the last batch's end to the encode span's start (Done to the front end)
    encode            the encode span
    after encode      the encode span's end to the server span's end
and the client's own time beside the server span's.

Tracing costs the traced requests a little (spans, their export): read the stages against
each other, and the total against an untraced run (`bench.lone`).

Usage: .venv/bin/python -m bench.trace_breakdown [--texts 300] [--model-dir DIR] [--setting 'engine = "torch"']
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import statistics
import threading
import time
from datetime import UTC, datetime
from urllib.parse import urlsplit

from bench.loadgen import DEFAULT_MODEL
from bench.run import OUT_DIR, ConfiguredServer, add_quiet_cpu_args, wait_quiet
from infinity.folders.resolve import packaged_model_folder
from workers.inference.corpus import sentences

PAUSE_S = 0.03  # between requests, as one client's requests come apart
WARM_UP_TEXTS = 30  # sent first, not counted
STAGES = ("before tokenize", "tokenize", "to inference", "queue", "pass", "back", "encode", "after encode")


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps every span, by trace id."""

    spans: dict[bytes, list] = {}
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            for resource_spans in export.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.setdefault(span.trace_id, []).append(span)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def stages(spans: list) -> dict[str, float] | None:
    """A request's stages in ms from its spans (None if some span is missing)."""
    named: dict[str, list] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    try:
        (server,) = [s for s in spans if s.name.startswith("POST ")]
        (tokenize,), (queue,), (encode,) = named["tokenize"], named["queue"], named["encode"]
        batches = named["batch"]
    except (KeyError, ValueError):
        return None
    first = min(b.start_time_unix_nano for b in batches)
    last = max(b.end_time_unix_nano for b in batches)
    edges = [server.start_time_unix_nano, tokenize.start_time_unix_nano, tokenize.end_time_unix_nano,
             queue.start_time_unix_nano, first, last, encode.start_time_unix_nano, encode.end_time_unix_nano,
             server.end_time_unix_nano]
    result = {stage: (edges[i + 1] - edges[i]) / 1e6 for i, stage in enumerate(STAGES[:3])}
    result["queue"] = (first - queue.start_time_unix_nano) / 1e6
    result["pass"] = (last - first) / 1e6
    result["back"] = (encode.start_time_unix_nano - last) / 1e6
    result["encode"] = (encode.end_time_unix_nano - encode.start_time_unix_nano) / 1e6
    result["after encode"] = (server.end_time_unix_nano - encode.end_time_unix_nano) / 1e6
    result["server"] = (server.end_time_unix_nano - server.start_time_unix_nano) / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--model-dir", help="model folder (default: the packaged model), e.g. one of bench.base_models")
    parser.add_argument("--setting", action="append", default=[], help="a models.toml line for the model")
    add_quiet_cpu_args(parser)
    args = parser.parse_args()
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_address[1]}",
                       "OTEL_BSP_SCHEDULE_DELAY": "200"})
    config = "\n".join(["[[models]]", f'name = "{DEFAULT_MODEL}"', f'source = "{args.model_dir or packaged_model_folder()}"',
                        *args.setting]) + "\n"
    texts = sentences(WARM_UP_TEXTS + args.texts, 0)
    client_ms: list[float] = []
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    server = ConfiguredServer.prepare(config, "trace-breakdown", datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))
    with server.running(args.health_timeout):
        wait_quiet(args)
        url = urlsplit(server.url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        for i, text in enumerate(texts):
            body = json.dumps({"model": DEFAULT_MODEL, "input": [text]})
            trace_id = f"{i + 1:032x}"
            start = time.perf_counter()
            connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json",
                                                                "traceparent": f"00-{trace_id}-{1:016x}-01"})
            response = connection.getresponse()
            response.read()
            client_ms.append((time.perf_counter() - start) * 1e3)
            assert response.status == 200, response.status
            time.sleep(PAUSE_S)
        time.sleep(1.0)  # the last spans' export
    warm_up = {f"{i + 1:032x}" for i in range(WARM_UP_TEXTS)}
    with _Collector.lock:
        measured = [s for s in (stages(spans) for trace_id, spans in _Collector.spans.items()
                                if trace_id.hex() not in warm_up) if s is not None]
    client_ms = client_ms[WARM_UP_TEXTS:]
    print(f"{len(measured)} of {len(client_ms)} requests traced whole; medians in ms:")
    for stage in (*STAGES, "server"):
        print(f"  {stage:16s} {statistics.median(m[stage] for m in measured):8.3f}")
    print(f"  {'client':16s} {statistics.median(client_ms):8.3f}")
    collector.shutdown()


if __name__ == "__main__":
    main()
