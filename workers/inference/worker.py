"""Inference process: holds the models placed on one device, batches their inputs and
writes the vectors into the front end's shared-memory slots. It first checks that this
machine has its device, so a configuration asking for a missing GPU stops the start with
a message naming the models and the device.

Threads: the receiver decodes `Infer` / `Cancel` messages into the scheduler while the
lanes run the engine, so the queue is filled and sorted during each forward pass; one
lane per forward pass the engines can run at once (`Engine.lanes`; for torch on a CPU,
a single-threaded pass per core), each cutting its next batch the moment it is free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
from numpy.lib.format import dtype_to_descr

from infinity.shared import devices, protocol
from infinity.shared.channel import ChannelClosed, ChannelToFront
from infinity.shared.protocol import ModelSpec
from infinity.shared.shm import Arena, SharedMemoryTooSmall
from workers.inference.scheduler import Batch, Scheduler, media_queue, queue_model
from workers.engines import set_torch_threads
from workers.inference.calibration import on_threads, text_lanes, warm_up, warm_up_media
from workers.heads import LoadedModel, load_model
from workers.preprocess.media import media_module
from workers.process import run_child

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    run_child(args, serve)


def serve(args: protocol.WorkerArgs, channel: ChannelToFront,
          load: Callable[[ModelSpec, int], LoadedModel] = load_model) -> None:
    """Load and warm up every model (`load`: how), report `Ready`, then serve until the
    front end closes the channel; a model that cannot load is reported as `StartupFailed`."""
    try:
        devices.require(args.models[0].device, [spec.name for spec in args.models])
        models = {spec.name: load(spec, args.threads) for spec in args.models}
        set_torch_threads([model.engine for model in models.values()], args.threads)
        lanes_of = {spec.name: text_lanes(models[spec.name].engine, args.threads) for spec in args.models}
        # Made before the warm-up, which starts its OpenMP team: the first lone input does not.
        wide_runner = ThreadPoolExecutor(1, thread_name_prefix="wide-pass")
        costs = {spec.name: warm_up(models[spec.name], spec.max_length, lanes_of[spec.name], wide_runner)
                 for spec in args.models}
        media_costs = {spec.name: warm_up_media(models[spec.name], spec, args.threads, wide_runner)
                       for spec in args.models if media_module(spec.kind) is not None}
        # A model whose outputs vary in size sends them with `Done`: its arena is empty.
        arenas = {spec.name: Arena(_arena_name(args, spec.name), args.arena_slots,
                                   0 if models[spec.name].head.ragged else models[spec.name].head.dim, create=True)
                  for spec in args.models}
    except (devices.DeviceUnavailable, SharedMemoryTooSmall) as exc:  # a configuration error: no traceback
        channel.send(protocol.StartupFailed(args.name, str(exc)))
        return
    except Exception as exc:
        log.exception("cannot load models")
        channel.send(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}"))
        return
    scheduler = Scheduler()
    # Each queue's model and arena: a model's texts, and a two-tower model's media apart.
    by_queue = {}
    for spec in args.models:
        engine, lanes = models[spec.name].engine, lanes_of[spec.name]
        scheduler.add_model(spec.name, spec.max_batch_tokens, spec.max_batch_size, engine.pad_id,
                            *costs[spec.name], lanes.count, lanes.widens, engine.express)
        by_queue[spec.name] = _Queue(models[spec.name], arenas[spec.name], lanes.threads, wide_runner)
        if spec.name in media_costs:
            overhead, lanes = media_costs[spec.name]
            # Lanes of single-threaded passes; a lone item while the others idle runs on every thread.
            scheduler.add_model(media_queue(spec.name), spec.max_batch_tokens, spec.max_batch_size, engine.pad_id,
                                overhead, 1.0, lanes, widens=lanes > 1)
            by_queue[media_queue(spec.name)] = _Queue(models[spec.name], arenas[spec.name],
                                                      (args.threads // lanes, args.threads) if lanes > 1 else None,
                                                      wide_runner)
    threading.Thread(target=_guarded, args=(_receive, channel, scheduler), daemon=True, name="receiver").start()
    for lane in range(1, scheduler.lanes):
        threading.Thread(target=_guarded, args=(_serve, by_queue, scheduler, channel), daemon=True,
                         name=f"lane-{lane}").start()
    if scheduler.express:
        threading.Thread(target=_guarded, args=(_serve, by_queue, scheduler, channel, scheduler.next_express_batch),
                         daemon=True, name="express-lane").start()
    infos = [protocol.ModelInfo(spec.name, spec.kind, models[spec.name].head.dim, spec.max_length,
                                models[spec.name].head.labels, models[spec.name].head.activation,
                                arenas[spec.name].name, args.arena_slots, models[spec.name].engine.name,
                                models[spec.name].head.ragged, models[spec.name].dtype)
             for spec in args.models]
    channel.send(protocol.Ready(args.name, os.getpid(), infos))
    _serve(by_queue, scheduler, channel)


def _arena_name(args: protocol.WorkerArgs, model: str) -> str:
    return args.arena_prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{args.name}-{model}")


@dataclass(frozen=True)
class _Queue:
    """What a lane needs to run one queue's batches."""

    model: LoadedModel
    arena: Arena
    # Where the queue's passes run in single-threaded lanes: the torch threads of a lane's
    # pass and of a wide one; None: the threads set at start.
    threads: tuple[int, int] | None = None
    # The one thread that runs the wide passes of queues in lanes. OpenMP keeps a team of
    # threads per calling thread: lanes taking lone inputs in turn would each wake their
    # own team while the last one's threads still spin on the cores it needs.
    wide_runner: Executor | None = None


def _serve(by_queue: dict[str, _Queue], scheduler: Scheduler, channel: ChannelToFront,
           take: Callable[[], Batch] | None = None) -> None:
    """One lane: run batches as they are cut (`take`: by the scheduler's `next_batch`)
    until the front end closes the channel."""
    take = take or scheduler.next_batch
    with contextlib.suppress(ChannelClosed):
        while True:
            _run_queued(take(), by_queue, scheduler, channel)


def _run_queued(batch: Batch, by_queue: dict[str, _Queue], scheduler: Scheduler, channel: ChannelToFront) -> None:
    """Run a batch with its queue's model and arena, on the torch threads the queue's
    passes take where it runs lanes (a lane's pass its share, a wide pass every thread,
    from the wide passes' own thread where the queue has one)."""
    queue = by_queue[batch.model]
    if queue.threads is None:
        _run(batch, queue.model, queue.arena, scheduler, channel)
    else:
        on_threads(queue.threads[batch.wide], partial(_run, batch, queue.model, queue.arena, scheduler, channel),
                    queue.wide_runner if batch.wide else None)


def _run(batch: Batch, model: LoadedModel, arena: Arena, scheduler: Scheduler, channel: ChannelToFront) -> None:
    """Run one batch; send what it ran and the answers of the requests it finished, together."""
    log.debug("batch of %d inputs, %d x %d tokens%s", len(batch.items), *batch.input_ids.shape,
              ", wide" if batch.wide else "")
    start = time.monotonic()  # the scheduler's clock
    try:
        if batch.features is not None:
            prompts = (batch.input_ids, batch.attention_mask, batch.token_type_ids) if batch.input_ids.size else ()
            vectors = model.forward_media(batch.features, *prompts, grid=batch.grid)
        else:
            vectors = model.forward(batch.input_ids, batch.attention_mask, batch.token_type_ids, wide=batch.wide,
                                    read_mask=batch.read_mask, express=batch.express)
    except Exception as exc:
        log.exception("forward pass failed for a batch of %d", len(batch.items))
        finished = scheduler.finish(batch, error=f"inference failed: {exc}")
        messages: list[protocol.Message] = []
    else:
        if model.head.ragged:
            for item, output in zip(batch.items, vectors):
                item.request.outputs[item.slot] = output
        else:
            arena.rows[[item.slot for item in batch.items]] = vectors
        finished = scheduler.finish(batch)
        tokens = sum(item.media_cost for item in batch.items) if batch.features is not None else batch.input_ids.size
        messages = [protocol.BatchRan(queue_model(batch.model), len(batch.items), tokens,
                                      [start - item.arrived for item in batch.items], time.monotonic() - start)]
    for request in finished:
        if request.error is not None:
            messages.append(protocol.Failed(request.request_id, protocol.ErrorKind.INTERNAL, request.error))
        else:
            outputs = _ragged(request.outputs) if request.outputs and not request.cancelled else None
            messages.append(protocol.Done(request.request_id, request.cancelled, outputs))
    if messages:
        channel.send(*messages)


def _ragged(outputs: dict[int, np.ndarray]) -> protocol.Ragged:
    """A request's variable-size outputs, by slot, as one message part."""
    arrays = list(outputs.values())
    return protocol.Ragged(list(outputs), dtype_to_descr(arrays[0].dtype), [list(array.shape) for array in arrays],
                           b"".join(np.ascontiguousarray(array).tobytes() for array in arrays))


def _masks(masks: protocol.TokenMasks | None) -> tuple[bytes | None, bytes | None]:
    return (None, None) if masks is None else (masks.attended, masks.read)


def _guarded(target: Callable[..., None], *args: object) -> None:
    """Run a thread's loop; if it fails, the process exits so the supervisor restarts it."""
    try:
        target(*args)
    except Exception:
        log.exception("%s thread failed", threading.current_thread().name)
        os._exit(1)


def _receive(channel: ChannelToFront, scheduler: Scheduler) -> None:
    """Receiver thread: queue requests, apply cancellations (and acknowledge them), until
    the front end closes the channel."""
    with contextlib.suppress(ChannelClosed):
        while True:
            _take_message(channel.receive(), channel, scheduler)


def _take_message(message: protocol.Message, channel: ChannelToFront, scheduler: Scheduler) -> None:
    """Queue a request's inputs, or apply its cancellation."""
    if isinstance(message, protocol.Infer) and message.features is not None:
        features = np.frombuffer(message.features, dtype=np.float32).reshape(message.feature_shape)
        ids = np.frombuffer(message.ids, dtype="<i4") if message.ids else None
        type_ids = None if message.type_ids is None else np.frombuffer(message.type_ids, dtype=np.int8)
        grid = None if message.feature_grid is None else np.array(message.feature_grid, dtype=np.int64)
        scheduler.submit_media(message.request_id, media_queue(message.model), features, message.lengths,
                               message.slots, ids, type_ids, grid)
    elif isinstance(message, protocol.Infer):
        ids = np.frombuffer(message.ids, dtype="<i4")
        type_ids, attended, read = (None if flags is None else np.frombuffer(flags, dtype=np.int8)
                                    for flags in (message.type_ids, *_masks(message.masks)))
        scheduler.submit(message.request_id, message.model, ids, message.lengths, message.slots, type_ids,
                         attended, read)
    elif isinstance(message, protocol.Cancel):
        dropped, finished = scheduler.cancel(message.request_id)
        log.info("request %d: client gone, %d waiting inputs dropped", message.request_id, dropped)
        if finished:
            channel.send(protocol.Done(message.request_id, cancelled=True))
