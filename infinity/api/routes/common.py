"""What every route shares: the application's keys, the route record, and choosing the
served model a request names."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
import msgspec
from msgspec import Struct

from infinity.api import openapi
from infinity.config import Config
from infinity.api.errors import APIError
from infinity.api.media_fetch import MediaFetcher
from infinity.api.metrics import MODEL
from infinity.client.engine_client import EngineClient
from infinity.client.topology import ServedModel
from infinity.shared.kinds import kinds_with

ENGINE_CLIENT = web.AppKey("engine_client", EngineClient)
CONFIG = web.AppKey("config", Config)
FETCHER = web.AppKey("media_fetcher", MediaFetcher)

# Errors of every route that runs a model.
MODEL_ERRORS = (400, 404, 408, 413, 415, 422, 429, 503)
# The model name infinity's generated client sends when its caller names none.
UNNAMED_MODEL = "default/not-specified"
# The operations that serve each kind ("POST /v1/rerank", ...), from the routes' tables:
# what a request naming a model of another kind is told to use.
KIND_ROUTES = web.AppKey("kind_routes", dict)


def kinds_serving(*capabilities: str, vector_per_input: bool = False) -> tuple[str, ...]:
    """The kinds (`infinity.shared.kinds.KINDS`) that serve any of `capabilities`; with
    `vector_per_input`, only those answering one vector of a fixed size per input: what a
    route declares it serves."""
    return kinds_with(lambda kind: bool(set(capabilities) & set(kind.capabilities))
                      and not (vector_per_input and kind.ragged))


@dataclass(frozen=True)
class RawAnswer:
    """An answer that is not JSON: its body as it is sent, its media type, and headers of
    its own."""

    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """One operation of the API and the function that serves it: `serve(request, body)`
    returns the operation's answer type (`body` is None for routes without one), or a
    `RawAnswer` where the operation declares one (`binary`)."""

    operation: openapi.Operation
    serve: Callable[[web.Request, Any], Awaitable[Struct | list | RawAnswer]]
    # Where the path takes several dialects' bodies (`operation.body` a tuple): the type a
    # request's body (its raw bytes) is decoded into, chosen by its keys.
    body_of: Callable[[web.Request, bytes], type[Struct]] | None = None


def served_model(request: web.Request, name: str | None, kinds: tuple[str, ...]) -> ServedModel:
    """The model a request names, which must be of one of the route's `kinds`; without a
    name, the only model of those kinds."""
    models = request.app[ENGINE_CLIENT].models
    if name is None or name == UNNAMED_MODEL:
        of_kind = [m for m in models.values() if m.spec.kind in kinds]
        if len(of_kind) == 1:
            request[MODEL] = of_kind[0].spec.name
            return of_kind[0]
        raise APIError(422, f"model is required: this server serves {len(of_kind)} models of kind "
                            f"{' or '.join(repr(k) for k in kinds)}", param="model")
    model = models.get(name)
    if model is None:
        raise APIError(404, f"model '{name}' is not served here; served models: {', '.join(models)}",
                       param="model", code="model_not_found")
    request[MODEL] = model.spec.name
    if model.spec.kind not in kinds:
        routes = " and ".join(request.app[KIND_ROUTES][model.spec.kind])
        raise APIError(400, f"model '{name}' is of kind '{model.spec.kind}'; it serves {routes}, not this route",
                       param="model", code="wrong_model_kind")
    return model


def max_items(request: web.Request) -> int:
    """Items one request may carry: never more than a model's whole queue, since such a
    request could never be admitted."""
    server = request.app[CONFIG].server
    return min(server.max_items_per_request, server.max_queued_items)



def body_members(body: bytes) -> dict[str, msgspec.Raw] | None:
    """A JSON object's members, undecoded (what a path of several dialects tells them by);
    None for anything else (its route's own type then says what is wrong)."""
    try:
        return msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
