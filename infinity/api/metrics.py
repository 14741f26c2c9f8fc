"""Prometheus metrics at `GET /metrics`, in the text exposition format.

The front end owns the registry, one per server. What it sees of each HTTP request (route,
model, priority, status, duration) is recorded by the `record_request` middleware; what the engine client
counts (inputs, tokens, truncated inputs, queue slots in use, child restarts, readiness)
is read from it when scraped; inference processes report each batch they run
(`protocol.BatchRan`: its size, tokens, the inputs' waits, its time), observed here, so
no figure lives in a child and a restarted child loses nothing. Like `/health`,
`/metrics` needs no API key (scrapers reach each replica directly, not through the
balancer); it reveals model names and counts only.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from infinity.api.connections import Handler
from infinity.client.engine_client import EngineClient
from infinity.shared import protocol

MODEL = web.RequestKey("model", str)  # the model a route served (set by `served_model`)
PRIORITY = web.RequestKey("priority", int)  # the priority a route ran at (set by the app's handler)
# Seconds: from a lone short sentence (a few ms) to large batches and image requests.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A pass: from one input of a few tokens to max_batch_size x max_length.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)

class Metrics:
    """The server's registry and the per-request instruments."""

    def __init__(self, client: EngineClient, version: str) -> None:
        self.registry = CollectorRegistry()
        # Each instrument by its labels' values (`_Children`), looked up per request and per batch.
        self.requests = _Children(Counter("infinity_requests", "HTTP requests answered, by route, model, priority and "
                                          "status", ["route", "model", "priority", "status"], registry=self.registry))
        self.duration = _Children(Histogram("infinity_request_duration_seconds", "Time from a request's headers to "
                                            "its answer", ["route", "model", "priority"], buckets=DURATION_BUCKETS,
                                            registry=self.registry))
        self.queue_time = _Children(Histogram("infinity_queue_duration_seconds", "Time an input waited in its "
                                              "inference process for a batch", ["model", "priority"],
                                              buckets=DURATION_BUCKETS, registry=self.registry))
        self.inference_time = _Children(Histogram("infinity_inference_duration_seconds", "Time of one batch's "
                                                  "forward pass and head", ["model"], buckets=DURATION_BUCKETS,
                                                  registry=self.registry))
        self.batch_size = _Children(Histogram("infinity_batch_size", "Inputs per batch", ["model"],
                                              buckets=BATCH_SIZE_BUCKETS, registry=self.registry))
        self.batch_tokens = _Children(Histogram("infinity_batch_tokens", "Padded tokens per batch (an image batch: "
                                                "its patches)", ["model"], buckets=BATCH_TOKEN_BUCKETS,
                                                registry=self.registry))
        self.registry.register(_EngineClientCollector(client, version))
        client.on_batch_ran = self._observe_batch

    def _observe_batch(self, batch: protocol.BatchRan) -> None:
        self.inference_time(batch.model).observe(batch.seconds)
        self.batch_size(batch.model).observe(batch.inputs)
        self.batch_tokens(batch.model).observe(batch.tokens)
        for wait, priority in zip(batch.waits, batch.priorities, strict=True):
            self.queue_time(batch.model, str(priority)).observe(wait)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Children:
    """A labelled metric's children by their label values (strings), each looked up in
    prometheus_client once: its `labels` checks the values and takes a lock at every call."""

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _EngineClientCollector:
    """What the engine client holds and has counted, read at each scrape."""

    def __init__(self, client: EngineClient, version: str) -> None:
        self._client = client
        self._version = version

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("infinity_build_info", "The server's version (always 1)", labels=["version"])
        build.add_metric([self._version], 1)
        yield build
        info = GaugeMetricFamily("infinity_model_info", "Each served model's kind, engine, dtype and replicas "
                                 "(always 1)", labels=["model", "kind", "engine", "dtype", "replicas"])
        families = {
            "ready": GaugeMetricFamily("infinity_model_ready", "1 while at least one replica of the model serves",
                                       labels=["model"]),
            "inputs": CounterMetricFamily("infinity_inputs", "Inputs (texts, pairs, images) computed",
                                          labels=["model"]),
            "tokens": CounterMetricFamily("infinity_prompt_tokens", "Tokens of the inputs computed, as `usage` "
                                          "counts them (an image: its patches)", labels=["model"]),
            "truncated": CounterMetricFamily("infinity_inputs_truncated", "Inputs cut to the model's max_length",
                                             labels=["model"]),
            "in_use": GaugeMetricFamily("infinity_queue_slots_in_use", "Inputs admitted and not yet answered "
                                        "(429 once every slot is in use)", labels=["model"]),
            "slots": GaugeMetricFamily("infinity_queue_slots", "Inputs a model may hold at once (max_queued_items)",
                                       labels=["model"]),
            "queued_tokens": GaugeMetricFamily("infinity_queued_tokens", "Tokens of the requests sent to an "
                                               "inference process and not yet answered", labels=["model"]),
            "backlog": GaugeMetricFamily("infinity_backlog_seconds", "How long the model would take to compute "
                                         "the tokens it holds at its measured rate (tokens per second while busy, "
                                         "over about the last minute): what an autoscaler scales on",
                                         labels=["model"]),
            "by_priority": GaugeMetricFamily("infinity_queue_slots_in_use_by_priority", "Inputs admitted and not yet "
                                             "answered, by the priority of their requests (those above 0 get 429 "
                                             "beyond max_queued_items_low_priority together)",
                                             labels=["model", "priority"]),
        }
        for model in self._client.models.values():
            name = model.spec.name
            engine, dtype = (model.info.engine, model.info.dtype) if model.info else (model.spec.engine, model.spec.dtype)
            info.add_metric([name, model.spec.kind, engine, dtype, str(len(model.replicas))], 1)
            families["ready"].add_metric([name], int(model.ready))
            families["inputs"].add_metric([name], model.served.inputs)
            families["tokens"].add_metric([name], model.served.prompt_tokens)
            families["truncated"].add_metric([name], model.served.truncated)
            families["in_use"].add_metric([name], model.pool.capacity - model.pool.free)
            families["slots"].add_metric([name], model.pool.capacity)
            families["queued_tokens"].add_metric([name], model.served.queued_tokens)
            families["backlog"].add_metric([name], model.served.backlog_seconds)
            for priority, count in sorted(model.pool.held.items()):
                families["by_priority"].add_metric([name, str(priority)], count)
        yield info
        yield from families.values()
        restarts = CounterMetricFamily("infinity_child_restarts", "Child processes restarted after they died",
                                       labels=["child"])
        for child in self._client.children:
            restarts.add_metric([child.name], child.restarts)
        yield restarts


def record_request(metrics: Metrics) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The outermost middleware: count every answer and time it, by route (its path
    template, so that unknown paths share one label, "unmatched") and model."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            model, priority = request.get(MODEL, ""), str(request.get(PRIORITY, ""))
            metrics.requests(route, model, priority, str(status)).inc()
            metrics.duration(route, model, priority).observe(time.perf_counter() - start)

    return record


METRICS = web.AppKey("metrics", Metrics)


async def serve_metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
