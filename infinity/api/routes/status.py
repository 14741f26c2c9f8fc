"""Status routes: `/health` (ready once every model is loaded on every device), `/live`
(the front end answers: a liveness probe), and the model list (OpenAI's shape, with
infinity's fields and our replicas and queues)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import APIError
from infinity.api.routes.common import ENGINE_CLIENT, Route
from infinity.api.types.status import Health, ModelCard, ModelList, ModelStats, ReplicaCard
from infinity.client.topology import ServedModel
from infinity.shared.folders import Stopped, folder_digest

log = logging.getLogger(__name__)


class FolderDigests:
    """Each model folder's content hash (`folder_digest`), computed in a thread the first
    time the model list is asked for, so that a server never asked reads no folder twice
    and the list never waits on a large one: None until it is done."""

    def __init__(self) -> None:
        self._digests: dict[str, str | None] = {}
        self._running: set[asyncio.Task[str]] = set()
        self._stop = threading.Event()

    def get(self, path: str) -> str | None:
        if path not in self._digests and not self._stop.is_set():
            self._digests[path] = None
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(folder_digest, path, self._stop))
            self._running.add(task)
            task.add_done_callback(lambda done: self._done(path, done))
        return self._digests.get(path)

    async def close(self) -> None:
        """Stop the hashing under way (a server stopping waits for no large folder)."""
        self._stop.set()
        await asyncio.gather(*self._running, return_exceptions=True)

    def _done(self, path: str, task: asyncio.Task[str]) -> None:
        self._running.discard(task)
        if task.cancelled() or isinstance(task.exception(), Stopped):
            del self._digests[path]
        elif task.exception() is not None:
            log.warning("cannot hash the model folder %s: %s", path, task.exception())
            del self._digests[path]  # asked again, it starts again
        else:
            self._digests[path] = task.result()


DIGESTS = web.AppKey("folder_digests", FolderDigests)


async def health(request: web.Request, _: None) -> Health:
    if request.app[ENGINE_CLIENT].draining:
        raise APIError(503, "the server is stopping", code="shutting_down")
    if not request.app[ENGINE_CLIENT].ready:
        raise APIError(503, "models are loading", code="not_ready", headers={"Retry-After": "1"})
    return Health("ok", time.time())


async def live(request: web.Request, _: None) -> Health:
    """200 whenever the front end answers, while models load and while draining too: a
    liveness probe restarts a server only when it is stuck, never for a slow model load."""
    return Health("ok", time.time())


async def models(request: web.Request, _: None) -> ModelList:
    digests = request.app[DIGESTS]
    return ModelList(data=[_model_card(model, digests.get(model.spec.path))
                           for model in request.app[ENGINE_CLIENT].models.values()])


def _model_card(model: ServedModel, digest: str | None) -> ModelCard:
    info, spec = model.info, model.spec
    queued = model.pool.capacity - model.pool.free
    return ModelCard(
        id=spec.name,
        created=int(time.time()),
        kind=spec.kind,
        capabilities=list(model.kind.capabilities),
        backend=info.engine if info else spec.engine,
        dtype=info.dtype if info else spec.dtype,
        lone_backend=info.lone_engine if info else None,
        prepared=all(replica.info.prepared for replica in model.replicas if replica.info is not None),
        stats=ModelStats(queue_fraction=queued / model.pool.capacity, queue_absolute=queued,
                         results_pending=sum(replica.outstanding for replica in model.replicas),
                         batch_size=spec.max_batch_size),
        ready=model.ready,
        dimensions=info.dim if info else None,
        max_length=spec.max_length,
        long_inputs=spec.long_inputs,
        pooling=spec.pooling,
        normalize=spec.normalize,
        modules=[step.label for step in spec.modules],
        digest=digest,
        prompts=spec.prompts,
        default_prompt_name=spec.default_prompt_name,
        devices=[replica.device for replica in model.replicas],
        # Each replica's readiness and the inputs it has computed (how the load spreads).
        replicas=[ReplicaCard(replica.device, replica.ready, replica.served,
                              replica.info.engine if replica.info else None,
                              replica.info.dtype if replica.info else None,
                              replica.info.lone_engine if replica.info else None,
                              replica.info.prepared if replica.info else True) for replica in model.replicas],
    )


ROUTES = [
    Route(openapi.Operation("get", "/v1/models", ("/models",), "The served models, their replicas and queues",
                            None, ModelList, ()), models),
    Route(openapi.Operation("get", "/health", ("/v1/health", "/ping"),
                            "200 once every model is loaded on every device; 503 before", None, Health, (503,)),
          health),
    Route(openapi.Operation("get", "/live", ("/v1/live",),
                            "200 whenever the server answers (also while models load and while stopping)",
                            None, Health, ()), live),
]
