"""End to end: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the real server's processes each
export their spans of a request over OTLP/HTTP (to a receiver on loopback here), all in
the trace of the client's `traceparent`, each linked to the front end's server span."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from tests.support.processes import wait_until  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
# Texts the front end leaves to a tokenizer process (more characters than it tokenizes itself).
TEXTS = ["spans of a request that crosses every process of the server " * 4] * 24


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace collector: keeps each span with its process's resource attributes."""

    spans: list[tuple[dict[str, str], object]] = []

    def do_POST(self) -> None:  # noqa: N802 (the handler's name is http.server's)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((resource, span) for span in scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list]]:
    _Receiver.spans = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.spans
    finally:
        server.shutdown()
        server.server_close()


def test_every_process_exports_its_spans_of_a_request_in_the_clients_trace(collector):
    endpoint, spans = collector
    server = ServerProcess(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
                                "OTEL_SERVICE_NAME": "e2e-embedder"}).start()
    try:
        server.wait_ready()
        answer = requests.post(server.url("/v1/embeddings"), json={"input": TEXTS},
                               headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, timeout=60)
        assert answer.status_code == 200
        names = {"POST /v1/embeddings", "tokenize", "queue", "batch", "encode"}
        assert wait_until(lambda: names <= {span.name for _, span in spans}, 30, 0.05), \
            f"spans exported: {sorted({span.name for _, span in spans})}"
    finally:
        assert server.stop() == 0
    ours = [(resource, span) for resource, span in spans if span.trace_id.hex() == CLIENT_TRACE]
    (server_span,) = [span for _, span in ours if span.name == "POST /v1/embeddings"]
    assert server_span.parent_span_id.hex() == CLIENT_SPAN
    process_of = {span.name: resource["infinity.process"] for resource, span in ours}
    assert process_of["POST /v1/embeddings"] == process_of["encode"] == "front"
    assert process_of["tokenize"].startswith("tokenizer-")
    assert process_of["queue"] == process_of["batch"] == "inference-cpu"
    assert {resource["service.name"] for resource, _ in ours} == {"e2e-embedder"}
    for _, span in ours:
        if span is not server_span:
            assert span.parent_span_id == server_span.span_id, span.name
