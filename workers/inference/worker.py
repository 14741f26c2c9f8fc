"""Inference process: holds the models placed on one device, batches their inputs and
writes the vectors into the front end's shared-memory slots. It first checks that this
machine has its device, so a configuration asking for a missing GPU stops the start with
a message naming the models and the device.

Threads: the receiver decodes `Infer` / `Cancel` messages into the scheduler while the
lanes run the engine, so the queue is filled and sorted during each forward pass; one
lane per forward pass the engines can run at once (`Engine.lanes`; for torch on a CPU,
a single-threaded pass per core), each cutting its next batch the moment it is free.
Where the scheduler has an express lane, the lanes run at a lower CPU priority (a higher
nice value) than every other thread of the server, and so do the threads on which an
engine computes its lanes' passes (`workers.engines.lanes.built_at_lane_niceness`): the
express pass of a query that arrives while every lane computes takes a core at once
instead of sharing it with a lane's long pass, and the front end and the tokenizers are
never slowed by the lanes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial

import numpy as np
from numpy.lib.format import dtype_to_descr

from infinity.shared import devices, protocol, tracing
from infinity.shared.channel import ChannelClosed, ChannelToFront
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec
from infinity.shared.shm import Arena, SharedMemoryTooSmall, arena_name
from workers.engines import set_torch_threads
from workers.engines.by_shape import lone_engine_of
from workers.engines.lanes import LANE_NICENESS, add_niceness
from workers.heads import LoadedModel, load_model
from workers.inference.calibration import on_threads
from workers.inference.cores_left import CoresLeft
from workers.inference.loading import load_and_warm
from workers.inference.preparing import load_at_start
from workers.inference.scheduler import Batch, PendingRequest, QueuePolicy, Scheduler, media_queue, queue_model
from workers.preprocess.media import feature_items, media_module
from workers.preprocess.text import collate_tokens, token_items
from workers.process import run_child

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    run_child(args, serve)


def serve(args: protocol.WorkerArgs, channel: ChannelToFront,
          load: Callable[[ModelSpec, int], LoadedModel] = load_model) -> None:
    """Load and warm up every model (`load`: how; where `args.prepare_in_background`, each
    as far as the cache has it prepared: `load_at_start`), report `Ready`, then serve until
    the front end closes the channel; a model that cannot load is reported as `StartupFailed`."""
    prepared: dict[str, bool] = {}
    if args.prepare_in_background:
        load = partial(load_at_start, load=load, prepared=prepared)
    try:
        loaded = load_and_warm(args, load)
        models, lanes_of, costs, media_costs, wide_runner = (loaded.models, loaded.lanes, loaded.costs,
                                                             loaded.media_costs, loaded.wide_runner)
        engines = [model.engine for model in models.values()]
        # A model whose outputs vary in size sends them with `Done`: its arena is empty.
        arenas = {spec.name: Arena(arena_name(args.arena_prefix, args.name, spec.name), args.arena_slots,
                                   0 if KINDS[spec.kind].ragged else models[spec.name].head.dim, create=True)
                  for spec in args.models}
    except (devices.DeviceUnavailable, SharedMemoryTooSmall) as exc:  # a configuration error: no traceback
        channel.send(protocol.StartupFailed(args.name, str(exc)))
        return
    except Exception as exc:
        log.exception("cannot load models")
        channel.send(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}"))
        return
    scheduler = Scheduler(cores_left=CoresLeft())
    # Each queue's model and arena: a model's texts, and a two-tower model's media apart.
    by_queue = {}
    for spec in args.models:
        model, kind, lanes = models[spec.name], KINDS[spec.kind], lanes_of[spec.name]
        overhead, padding_weight = costs[spec.name]
        scheduler.add_queue(spec.name, QueuePolicy(spec.max_batch_tokens, spec.max_batch_size, overhead,
                                                   padding_weight, lanes.count, lanes.widens, lanes.express))
        by_queue[spec.name] = _Queue(model, arenas[spec.name], kind.ragged,
                                     partial(collate_tokens, pad_id=model.engine.pad_id), False, lanes.threads,
                                     wide_runner)
        if spec.name in media_costs:
            overhead, count = media_costs[spec.name]
            # Lanes of single-threaded passes; a lone item while the others idle runs on every thread.
            scheduler.add_queue(media_queue(spec.name), QueuePolicy(spec.max_batch_tokens, spec.max_batch_size,
                                                                    overhead, 1.0, count, widens=count > 1))
            by_queue[media_queue(spec.name)] = _Queue(
                model, arenas[spec.name], kind.ragged, partial(media_module(spec.kind).collate,
                                                               pad_id=model.engine.pad_id),
                True, (args.threads // count, args.threads) if count > 1 else None, wide_runner)
    threading.Thread(target=_guarded, args=(_receive, channel, scheduler, by_queue,
                                            partial(set_torch_threads, engines, args.threads)),
                     daemon=True, name="receiver").start()
    lane_niceness = LANE_NICENESS if scheduler.express else 0
    for lane in range(1, scheduler.lanes):
        threading.Thread(target=_guarded, args=(_serve, by_queue, scheduler, channel, None, lane_niceness),
                         daemon=True, name=f"lane-{lane}").start()
    if scheduler.express:
        threading.Thread(target=_guarded, args=(_serve, by_queue, scheduler, channel, scheduler.next_express_batch),
                         daemon=True, name="express-lane").start()
    infos = [protocol.ModelInfo(spec.name, spec.kind, models[spec.name].head.dim, spec.max_length,
                                models[spec.name].head.labels, models[spec.name].head.activation,
                                arenas[spec.name].name, args.arena_slots, models[spec.name].engine.name,
                                KINDS[spec.kind].ragged, models[spec.name].dtype,
                                lone_engine_of(models[spec.name].engine), prepared.get(spec.name, True))
             for spec in args.models]
    channel.send(protocol.Ready(args.name, os.getpid(), infos))
    _serve(by_queue, scheduler, channel, niceness=lane_niceness)


@dataclass(frozen=True)
class _Queue:
    """What a lane needs to run one queue's batches."""

    model: LoadedModel
    arena: Arena
    ragged: bool  # its outputs vary in size: they go with the request's `Done`, not into the arena
    # A batch's payloads -> the arrays of its pass (the medium's collation, workers/preprocess).
    collate: Callable[[list], dict[str, np.ndarray]]
    media: bool  # its passes are the model's media pass
    # Where the queue's passes run in single-threaded lanes: the torch threads of a lane's
    # pass and of a wide one; None: the threads set at start.
    threads: tuple[int, int] | None = None
    # The one thread that runs the wide passes of queues in lanes. OpenMP keeps a team of
    # threads per calling thread: lanes taking lone inputs in turn would each wake their
    # own team while the last one's threads still spin on the cores it needs.
    wide_runner: Executor | None = None


def _serve(by_queue: dict[str, _Queue], scheduler: Scheduler, channel: ChannelToFront,
           take: Callable[[], Batch] | None = None, niceness: int = 0) -> None:
    """One lane: run batches as they are cut (`take`: by the scheduler's `next_batch`)
    until the front end closes the channel; `niceness`: added to this thread's nice value."""
    if niceness:
        add_niceness(niceness)
    take = take or scheduler.next_batch
    with contextlib.suppress(ChannelClosed):
        while True:
            _run_queued(take(), by_queue, scheduler, channel)


def _run_queued(batch: Batch, by_queue: dict[str, _Queue], scheduler: Scheduler, channel: ChannelToFront) -> None:
    """Run a batch with its queue's model and arena, on the torch threads the queue's
    passes take where it runs lanes (a lane's pass its share, a wide pass every thread,
    from the wide passes' own thread where the queue has one)."""
    queue = by_queue[batch.queue]
    if queue.threads is None:
        _run(batch, queue, scheduler, channel)
    else:
        on_threads(queue.threads[batch.wide], partial(_run, batch, queue, scheduler, channel),
                   queue.wide_runner if batch.wide else None)


def _run(batch: Batch, queue: _Queue, scheduler: Scheduler, channel: ChannelToFront) -> None:
    """Run one batch; send what it ran and the answers of the requests it finished, together."""
    padded = len(batch.items) * max(item.cost for item in batch.items)  # tokens, patches, frames
    log.debug("batch of %d inputs, %d padded%s", len(batch.items), padded, ", wide" if batch.wide else "")
    start = time.monotonic()  # the scheduler's clock
    try:
        arrays = queue.collate([item.payload for item in batch.items])
        if queue.media:
            vectors = queue.model.forward_media(arrays)
        else:
            vectors = queue.model.forward(**arrays, wide=batch.wide, express=batch.express,
                                          vector_types=[item.request.vector_types for item in batch.items])
    except Exception as exc:
        log.exception("forward pass failed for a batch of %d", len(batch.items))
        finished = scheduler.finish(batch, error=f"inference failed: {exc}")
        messages: list[protocol.Message] = []
    else:
        if queue.ragged:
            for item, output in zip(batch.items, vectors):
                item.request.outputs[item.slot] = output
        elif isinstance(vectors, list):  # token states asked of a model of one vector per input
            for item, output in zip(batch.items, vectors):
                if isinstance(output, dict):
                    item.request.outputs[item.slot] = output
                else:
                    queue.arena.rows[item.slot] = output
        else:
            queue.arena.rows[[item.slot for item in batch.items]] = vectors
        finished = scheduler.finish(batch)
        end = time.monotonic()
        messages = [protocol.BatchRan(queue_model(batch.queue), len(batch.items), padded,
                                      [start - item.arrived for item in batch.items], end - start,
                                      [item.request.priority for item in batch.items])]
        if tracing.tracer() is not None:
            _trace(batch, queue, padded, start, end)
    for request in finished:
        if request.error is not None:
            messages.append(protocol.Failed(request.request_id, protocol.ErrorKind.INTERNAL, request.error))
        else:
            messages.append(_done(request))
    if messages:
        channel.send(*messages)


_FIRST_BATCH_LOCK = threading.Lock()


def _trace(batch: Batch, queue: _Queue, padded: int, start: float, end: float) -> None:
    """The spans of a batch that ran, in the trace of each traced request it held inputs of:
    the request's queue wait, if this is its first batch, and the pass."""
    inputs_of = Counter(item.request for item in batch.items if item.request.trace is not None)
    attributes = {"infinity.model": queue_model(batch.queue), "infinity.batch.inputs": len(batch.items),
                  "infinity.batch.padded_tokens": padded, "infinity.engine": queue.model.engine.name,
                  "infinity.dtype": queue.model.dtype, "infinity.batch.wide": batch.wide,
                  "infinity.batch.express": batch.express}
    wall_ns = tracing.monotonic_to_wall_ns()
    for request, inputs in inputs_of.items():
        assert request.trace is not None
        with _FIRST_BATCH_LOCK:  # lanes finish batches of one request at once
            first, request.ran = not request.ran, True
        if first:
            tracing.record_span("queue", request.trace, wall_ns(request.arrived), wall_ns(start),
                                **{"infinity.priority": request.priority})
        tracing.record_span("batch", request.trace, wall_ns(start), wall_ns(end), **attributes,
                            **{"infinity.request.inputs": inputs})


def _done(request: PendingRequest) -> protocol.Done:
    """The answer of a request whose outputs are computed (or that was cancelled): those of
    a model whose outputs vary in size go with it, a hybrid model's by type where it asked
    for several."""
    if not request.outputs or request.cancelled:
        return protocol.Done(request.request_id, request.cancelled)
    if not request.vector_types:
        return protocol.Done(request.request_id, outputs=_ragged(request.outputs))
    by_type = {vector_type: _ragged({slot: arrays[vector_type] for slot, arrays in request.outputs.items()})
               for vector_type in request.vector_types}
    if len(by_type) == 1:  # answered as a model of that one output would be
        return protocol.Done(request.request_id, outputs=by_type[request.vector_types[0]])
    return protocol.Done(request.request_id, outputs_by_type=by_type)


def _ragged(outputs: dict[int, np.ndarray]) -> protocol.Ragged:
    """A request's variable-size outputs, by slot, as one message part."""
    arrays = list(outputs.values())
    return protocol.Ragged(list(outputs), dtype_to_descr(arrays[0].dtype), [list(array.shape) for array in arrays],
                           b"".join(np.ascontiguousarray(array).tobytes() for array in arrays))


def _guarded(target: Callable[..., None], *args: object) -> None:
    """Run a thread's loop; if it fails, the process exits so the supervisor restarts it."""
    try:
        target(*args)
    except Exception:
        log.exception("%s thread failed", threading.current_thread().name)
        os._exit(1)


def _receive(channel: ChannelToFront, scheduler: Scheduler, by_queue: dict[str, _Queue],
             set_threads: Callable[[], None]) -> None:
    """Receiver thread: queue requests, apply cancellations (and acknowledge them), until
    the front end closes the channel. `set_threads` first gives it the torch threads of the
    main thread (OpenMP keeps them per thread), for the lone passes it runs."""
    set_threads()
    with contextlib.suppress(ChannelClosed):
        while True:
            _take_message(channel.receive(), channel, scheduler, by_queue)


def _take_message(message: protocol.Message, channel: ChannelToFront, scheduler: Scheduler,
                  by_queue: dict[str, _Queue]) -> None:
    """Queue a request's inputs (texts on its model's queue, media on its media queue), or
    apply its cancellation. A lone input that nothing else waits beside, nor behind in the
    channel, the scheduler may hand back to run here (`Scheduler.submit`'s `run_here`)."""
    if isinstance(message, protocol.Infer):
        inputs = message.inputs
        if isinstance(inputs, protocol.TokenInputs):
            queue, (costs, items) = message.model, token_items(inputs)
        else:
            queue, (costs, items) = media_queue(message.model), feature_items(inputs)
        batch = scheduler.submit(message.request_id, queue, message.slots, costs, items, message.priority,
                                 message.trace, tuple(message.vector_types), run_here=lambda: not channel.pending())
        if batch is not None:
            _run_queued(batch, by_queue, scheduler, channel)
    elif isinstance(message, protocol.Cancel):
        dropped, finished = scheduler.cancel(message.request_id)
        log.info("request %d: client gone, %d waiting inputs dropped", message.request_id, dropped)
        if finished:
            channel.send(protocol.Done(message.request_id, cancelled=True))
