"""A start that serves at once: where a model's conversions and trials are not in the
cache yet (a new machine, a new model), its inference process serves it on the torch
engine in float32, which needs neither, and a preparing process (`prepare`, started by the
front end: `infinity.client.handover`) makes them, loading every model as a full start
would and leaving what it built and measured in the cache; it then reports `Ready` and
exits, freeing all it loaded. The front end then starts an inference process that finds
everything prepared and hands the models over to it once it is ready."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgspec

from infinity.shared import protocol
from infinity.shared.channel import ChannelToFront
from infinity.shared.kinds import dtype_refusal
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import NotPrepared, prepared_only
from workers.heads import LoadedModel, load_model
from workers.inference.loading import load_and_warm
from workers.process import run_child

log = logging.getLogger(__name__)

# Added to the preparing process's nice value: its conversions and trials take the cores
# the serving processes leave.
PREPARING_NICENESS = 10


def load_at_start(spec: ModelSpec, threads: int, load: Callable[[ModelSpec, int], LoadedModel],
                  prepared: dict[str, bool]) -> LoadedModel:
    """`spec`'s model as `load` gives it where the cache holds every conversion and
    measurement that needs; else its model unprepared (`unprepared_spec`). Says which in
    `prepared[spec.name]`."""
    try:
        with prepared_only():
            model = load(spec, threads)
    except NotPrepared as why:
        unprepared = unprepared_spec(spec)
        log.info("'%s' serves on torch in %s while it is prepared in the background: %s", spec.name,
                 unprepared.dtype, why)
        prepared[spec.name] = False
        return load(unprepared, threads)
    prepared[spec.name] = True
    return model


def unprepared_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` on the torch engine, with nothing to convert, try or time: in float32 where a
    trial would have chosen its precision or torch does not compute its dtype (int8), without
    a lone input's engine."""
    exact = spec.float32_engine is not None or dtype_refusal("torch", spec.dtype) is not None
    return msgspec.structs.replace(spec, engine="torch", fallback_engine=None, float32_engine=None,
                                   dtype="float32" if exact else spec.dtype, lone_engines=(),
                                   lone_engine_named=False)


def main(args: protocol.WorkerArgs) -> None:
    os.nice(PREPARING_NICENESS)  # before any thread: every thread it starts inherits it
    run_child(args, prepare)


def prepare(args: protocol.WorkerArgs, channel: ChannelToFront,
            load: Callable[[ModelSpec, int], LoadedModel] = load_model) -> None:
    """Load and warm up every model of `args` as a full start does (`load`: how), so that
    the cache holds what they need; report `Ready` (no models), or `StartupFailed`."""
    try:
        load_and_warm(args, load)
    except Exception as exc:
        log.exception("cannot prepare %s", ", ".join(spec.name for spec in args.models))
        channel.send(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}"))
        return
    channel.send(protocol.Ready(args.name, os.getpid()))
