"""Bodies of the status routes: the model list and health."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from infinity.shared.kinds import Kind

class ModelStats(Struct):
    """How full the model's queue is (the fields infinity's clients read)."""

    queue_fraction: float
    queue_absolute: int
    results_pending: int
    batch_size: int


class ReplicaCard(Struct):
    device: str
    ready: bool
    inputs: int  # computed so far
    engine: str | None
    dtype: str | None  # what it computes in: float32, bfloat16, ...
    lone_engine: str | None  # the engine a lone input's pass runs on, where not `engine`
    # False: served unprepared while its conversions and trials are made (`[server] prepare`).
    prepared: bool = True


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    owned_by: Literal["infinity"] = "infinity"
    created: int
    kind: Kind
    capabilities: list[str]
    backend: str  # the engine of the first replica that loaded
    dtype: str  # what the first replica that loaded computes in (until one has: what its spec asks)
    lone_backend: str | None  # the first replica's engine for a lone input, where not `backend`
    # False while a replica serves it unprepared, its conversions and trials being made
    # (`[server] prepare`: it is then handed over to a process that loads it prepared).
    prepared: bool = True
    stats: ModelStats
    ready: bool
    dimensions: int | None
    max_length: int
    long_inputs: str  # how inputs longer than max_length are taken: truncate, chunk or error
    pooling: str  # an embedder's mean, cls or lasttoken; a sparse model's max or sum
    normalize: bool  # whether its vectors are scaled to length 1
    # An embedder's modules after its encoder, in the order they run ("Pooling(mean)",
    # "Dense(768->3072, Identity, no bias)", "Normalize"); empty for other kinds.
    modules: list[str]
    # sha256 over the model folder's files (names and contents), computed in the background
    # the first time the list is asked for: null until then.
    digest: str | None
    prompts: dict[str, str]  # put before each text, by name (a request's prompt_name)
    default_prompt_name: str | None  # the prompt of requests that ask for none
    devices: list[str]
    replicas: list[ReplicaCard]


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(Struct):
    status: Literal["ok"]
    unix: float
