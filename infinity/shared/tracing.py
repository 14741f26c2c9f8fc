"""Traces of requests across the server's processes (OpenTelemetry), on only where the
operator asks for them: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, with
the `otel` extra installed. Each process (front end, tokenizers, inference) exports its own
spans over OTLP/HTTP; the standard `OTEL_*` variables (service name, resource attributes,
sampler, batch processor, headers) apply as the SDK reads them.

One request's trace:
    <METHOD> <route>   front end: the whole request; its parent, the client's W3C `traceparent`
    tokenize           a tokenizer process, or the front end for the small requests it tokenizes
    queue              the inference process: from the request's arrival until its first input runs
    batch              the inference process: one for each pass that ran inputs of the request,
                       with the pass's inputs, tokens, engine and dtype
    encode             front end: from the outputs' arrival until the answer's body is made
The front end's context reaches the children as a `traceparent` string in `Tokenize` and
`Infer` (None when the request is not traced, so an untraced request carries nothing).
Log lines written inside a span end with its trace id.

With tracing off, `tracer()` is None and each hook is that one check.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SERVICE_NAME = "infinity-serve"  # unless OTEL_SERVICE_NAME says otherwise

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
# When the current request's outputs came back (time.time_ns()), where `encode` starts.
_OUTPUTS_ARRIVED: ContextVar[int | None] = ContextVar("outputs_arrived", default=None)


class TracingUnavailable(RuntimeError):
    """Traces are asked for, but the `otel` extra is not installed."""


def asked() -> bool:
    """Whether the environment asks for traces."""
    return any(os.environ.get(name) for name in ENDPOINT_VARIABLES)


def configure(process: str) -> None:
    """Export this process's spans over OTLP/HTTP where the environment asks for traces
    (`process`: the process's name, a resource attribute telling the processes apart)."""
    if not asked() or _tracer is not None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"{' or '.join(ENDPOINT_VARIABLES)} asks for traces, but OpenTelemetry is not installed: "
            "pip install 'infinity-serve[otel]'") from exc
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME,
                                "infinity.process": process})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)


def install(provider: TracerProvider) -> None:
    """Trace with `provider` in this process (`configure` does; tests give an in-memory one)."""
    global _tracer, _provider
    _provider, _tracer = provider, provider.get_tracer("infinity")
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _WithTraceId):
            handler.setFormatter(_WithTraceId(handler.formatter))


def uninstall() -> None:
    """Stop tracing in this process, exporting what its spans have not yet (the provider shuts down)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, _WithTraceId):
            handler.setFormatter(handler.formatter.inner)
    if provider is not None:
        provider.shutdown()


def flush(timeout_s: float) -> None:
    """Export the spans not yet exported, waiting at most `timeout_s` (a child about to exit)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def tracer() -> Tracer | None:
    return _tracer


def traceparent() -> str | None:
    """The current span's context as a W3C `traceparent` value, for a message to carry;
    None where nothing is traced or the span is not sampled."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def parent_context(headers: Mapping[str, str]) -> Any:
    """The context a request's W3C trace headers (`traceparent`, `tracestate`) give its span."""
    return _propagator().extract(headers)


@functools.cache
def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


@contextlib.contextmanager
def span(name: str, parent: str | None, **attributes: Any) -> Iterator[Span | None]:
    """A span around the block, current within it, child of the span whose `traceparent`
    a message carried; None (and no span) where that request is not traced."""
    if _tracer is None or parent is None:
        yield None
        return
    with _tracer.start_as_current_span(name, parent_context({"traceparent": parent}),
                                       attributes=attributes) as current:
        yield current


def record_span(name: str, parent: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A span of work already done, from `start_ns` to `end_ns` (`time.time_ns()`'s clock)."""
    if _tracer is not None:
        _tracer.start_span(name, parent_context({"traceparent": parent}), attributes=attributes,
                           start_time=start_ns).end(end_ns)


def monotonic_to_wall_ns() -> Callable[[float], int]:
    """A conversion of `time.monotonic()` readings (which every process reads alike) to
    `time.time_ns()`'s clock, as the two clocks stand now."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda seconds: int(seconds * 1e9) + offset


def outputs_arrived() -> None:
    """Note that the current request's outputs are back: its `encode` span starts here."""
    if _tracer is not None:
        _OUTPUTS_ARRIVED.set(time.time_ns())


def encoded(parent: Span) -> None:
    """End the current request's `encode` span (the answer's body is made), if its outputs
    came back; the next request on the same task starts afresh."""
    started = _OUTPUTS_ARRIVED.get()
    _OUTPUTS_ARRIVED.set(None)
    if _tracer is not None and started is not None:
        from opentelemetry import trace

        _tracer.start_span("encode", trace.set_span_in_context(parent), start_time=started).end()


class _WithTraceId(logging.Formatter):
    """A handler's formatter, with the trace id of the span current where a line is
    written added at the end."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        from opentelemetry import trace

        text = self.inner.format(record)
        context = trace.get_current_span().get_span_context()
        return f"{text} trace_id={context.trace_id:032x}" if context.is_valid else text
