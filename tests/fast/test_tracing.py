"""Traces (infinity/shared/tracing.py): a request's spans across the front end, the
tokenizer and the inference process (threads here), their parent links, the client's
`traceparent` honoured, what they record, the trace id in the log; and nothing of it
with tracing off."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from infinity.shared import protocol, tracing  # noqa: E402
from tests.fast.inprocess import ThreadLauncher, serving  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
# Longer than the front end tokenizes itself while another request is in flight, and than
# it tokenizes when idle: it goes to the tokenizer thread.
LONG_TEXTS = ["a sentence of a long request " * 10] * 20


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.uninstall()


def _by_name(finished: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        named.setdefault(span.name, []).append(span)
    return named


def _wait_for(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The exported spans once there are `count` (the request's answer can come back before
    the lane's spans of the batch are recorded)."""
    for _ in range(200):
        finished = list(exporter.get_finished_spans())
        if len(finished) >= count:
            return finished
        time.sleep(0.01)
    return list(exporter.get_finished_spans())


# A short query is tokenized in the front end, the long texts in the tokenizer thread.
@pytest.mark.parametrize("texts", [["a short query"], LONG_TEXTS], ids=["front-end-tokenized", "tokenizer"])
def test_a_request_is_one_trace_under_the_clients_span(spans, texts):
    async def request():
        async with serving() as client:
            answer = await client.post("/v1/embeddings", json={"input": texts, "model": "m", "priority": 3},
                                       headers={"traceparent": TRACEPARENT})
            assert answer.status == 200
            return (await answer.json())["usage"]["prompt_tokens"]

    tokens = asyncio.run(request())
    named = _by_name(_wait_for(spans, 5))
    (server,) = named["POST /v1/embeddings"]
    (tokenize,) = named["tokenize"]
    (queue,) = named["queue"]
    batches = named["batch"]
    (encode,) = named["encode"]
    assert server.context.trace_id == int(CLIENT_TRACE, 16)
    assert server.parent is not None and server.parent.span_id == int(CLIENT_SPAN, 16)
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["infinity.model"] == "m" and server.attributes["infinity.priority"] == 3
    for child in (tokenize, queue, *batches, encode):
        assert child.context.trace_id == server.context.trace_id
        assert child.parent.span_id == server.context.span_id
    assert tokenize.attributes["infinity.inputs"] == len(texts) and tokenize.attributes["infinity.tokens"] == tokens
    assert sum(batch.attributes["infinity.request.inputs"] for batch in batches) == len(texts)
    for batch in batches:
        assert batch.attributes["infinity.engine"] == "fake" and batch.attributes["infinity.dtype"] == "float32"
        assert batch.attributes["infinity.batch.inputs"] >= batch.attributes["infinity.request.inputs"]
        assert batch.attributes["infinity.batch.padded_tokens"] > 0
    assert queue.attributes["infinity.priority"] == 3
    # In order: tokenized, queued, run, encoded, all within the request's span.
    assert server.start_time <= tokenize.start_time <= tokenize.end_time <= queue.end_time
    assert queue.end_time == min(batch.start_time for batch in batches)
    assert max(batch.end_time for batch in batches) <= encode.start_time <= encode.end_time <= server.end_time


def test_a_request_without_traceparent_starts_a_trace_and_errors_are_marked(spans):
    async def requests():
        async with serving() as client:
            assert (await client.post("/v1/embeddings", json={"input": "x", "model": "nope"})).status == 404
            assert (await client.get("/no/such/route")).status == 404

    asyncio.run(requests())
    named = _by_name(spans.get_finished_spans())
    (unknown_model,) = named["POST /v1/embeddings"]
    assert unknown_model.parent is None and unknown_model.attributes["http.response.status_code"] == 404
    assert "encode" not in named and "tokenize" not in named  # nothing ran
    (unmatched,) = named["GET"]
    assert "http.route" not in unmatched.attributes


def test_messages_carry_the_trace_only_where_a_request_is_traced(spans):
    sent: list[protocol.Message] = []
    started: list[protocol.WorkerArgs] = []

    class Recording(ThreadLauncher):
        def __call__(self, entry_point, args):
            started.append(args)
            return super().__call__(entry_point, args)

    async def request(headers):
        async with serving(Recording()) as client:
            answer = await client.post("/v1/embeddings", json={"input": LONG_TEXTS, "model": "m"}, headers=headers)
            assert answer.status == 200

    saved = protocol.encode

    def recording_encode(messages):
        sent.extend(messages)
        return saved(messages)

    protocol.encode = recording_encode
    try:
        asyncio.run(request({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}))  # not sampled
        unsampled = [m for m in sent if isinstance(m, (protocol.Tokenize, protocol.Infer))]
        sent.clear()
        asyncio.run(request({"traceparent": TRACEPARENT}))
        sampled = [m for m in sent if isinstance(m, (protocol.Tokenize, protocol.Infer))]
    finally:
        protocol.encode = saved
    assert started and all(args.traced for args in started)  # the children export their spans
    assert unsampled and all(message.trace is None for message in unsampled)
    assert {type(m) for m in sampled} == {protocol.Tokenize, protocol.Infer}
    assert all(message.trace.startswith(f"00-{CLIENT_TRACE}-") for message in sampled)


def test_without_tracing_no_span_and_no_trace_in_messages():
    assert tracing.tracer() is None and tracing.traceparent() is None
    with tracing.span("tokenize", TRACEPARENT) as span:
        assert span is None
    tracing.record_span("batch", TRACEPARENT, 0, 1)  # nothing to record it with: no error


def test_log_lines_inside_a_span_end_with_its_trace_id(spans):
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    tracing.install(tracing._provider)  # formatters of the handlers there now
    try:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "served", None, None)
        assert handler.format(record) == "served"
        with tracing.span("tokenize", TRACEPARENT):
            assert handler.format(record) == f"served trace_id={CLIENT_TRACE}"
    finally:
        root.removeHandler(handler)


def test_configure_exports_over_otlp_only_where_the_environment_asks(monkeypatch):
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    tracing.configure("front")
    assert tracing.tracer() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "search-embedder")
    tracing.configure("front")
    try:
        provider = tracing._provider
        assert provider is not None and tracing.tracer() is not None
        assert provider.resource.attributes["service.name"] == "search-embedder"
        assert provider.resource.attributes["infinity.process"] == "front"
        exporters = [processor.span_exporter for processor in provider._active_span_processor._span_processors]
        assert [type(exporter).__name__ for exporter in exporters] == ["OTLPSpanExporter"]
    finally:
        tracing.uninstall()


def test_traces_asked_for_without_the_extra_stop_the_start_naming_it(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(tracing.TracingUnavailable, match=r"infinity-serve\[otel\]"):
        tracing.configure("front")
    assert tracing.tracer() is None
