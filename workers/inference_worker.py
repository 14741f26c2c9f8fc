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
from workers.batching import Batch, Scheduler, media_queue, queue_model
from workers.engines import set_torch_threads, torch_threads
from workers.engines.base import WIDE_COPY_PAUSE, WIDE_COPY_TRIES, Engine, best_seconds
from workers.heads import LoadedModel, load_model
from workers.media_towers import media_module
from workers.process import start_child

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    channel = start_child(args)
    try:
        serve(args, channel)
    finally:
        channel.close()


def serve(args: protocol.WorkerArgs, channel: ChannelToFront,
          load: Callable[[ModelSpec, int], LoadedModel] = load_model) -> None:
    """Load and warm up every model (`load`: how), report `Ready`, then serve until the
    front end closes the channel; a model that cannot load is reported as `StartupFailed`."""
    try:
        devices.require(args.models[0].device, [spec.name for spec in args.models])
        models = {spec.name: load(spec, args.threads) for spec in args.models}
        set_torch_threads([model.engine for model in models.values()], args.threads)
        text_lanes = {spec.name: _text_lanes(models[spec.name].engine, args.threads) for spec in args.models}
        # Made before the warm-up, which starts its OpenMP team: the first lone input does not.
        wide_runner = ThreadPoolExecutor(1, thread_name_prefix="wide-pass")
        costs = {spec.name: _warm_up(models[spec.name], spec.max_length, text_lanes[spec.name], wide_runner)
                 for spec in args.models}
        media_costs = {spec.name: _warm_up_media(models[spec.name], spec, args.threads, wide_runner)
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
        engine, lanes = models[spec.name].engine, text_lanes[spec.name]
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


MIXED_SHORT = 15  # short inputs next to the long one in the warm-up's mixed batch


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


@dataclass(frozen=True)
class _TextLanes:
    """How a model's text passes run."""

    count: int  # passes at once
    widens: bool  # a lone input while the other lanes idle runs on every thread
    threads: tuple[int, int] | None  # as `_Queue.threads`


def _text_lanes(engine: Engine, threads: int) -> _TextLanes:
    """The engine's own lanes; an engine running its passes on the caller's torch threads
    (torch on a CPU) gets a single-threaded lane per core and a lone input on every
    thread, as CTranslate2 and ONNX Runtime run their replicas: served, two passes on one
    thread each beat one pass on both, whose threads wait on each other at every operator
    while the front end and the tokenizers take a core (bench/RESULTS.md, "Text lanes on
    torch")."""
    if engine.on_caller_threads and engine.lanes == 1 and threads > 1:
        return _TextLanes(threads, True, (1, threads))
    return _TextLanes(engine.lanes, engine.widens, None)


# Media passes run in single-threaded lanes only where the same items through them take at
# most this share of one pass's time on every thread (bench/RESULTS.md, "Media lanes").
MEDIA_LANES_MAX_TIME = 0.95
MEDIA_ITEMS_PER_LANE = 2


def _warm_up_media(model: LoadedModel, spec: ModelSpec, threads: int,
                   wide_runner: Executor | None = None) -> tuple[float, int]:
    """Run batches of one and four media items (so the first requests pay no one-time
    costs; where lanes are kept, a lone item also on the wide passes' thread) and return
    the media queue's cost model, the fixed cost of a pass in items' cost units (an
    image's patches, a clip's frames, a page's tokens; a model's items are all alike, so
    there is no padding to price), and how many passes it runs at once."""
    lanes = threads if model.engine.on_caller_threads and threads > 1 else 1
    example = media_module(spec.kind).example_features(spec, max(4, lanes * MEDIA_ITEMS_PER_LANE))

    def forward(count: int) -> Callable[[], object]:
        ids = example.input_ids
        given = () if ids is None else (ids[:count], np.ones_like(ids[:count]), np.zeros_like(ids[:count]))
        grid = None if example.grid is None else example.grid[:count]
        return lambda: model.forward_media(example.features[:count], *given, grid=grid)

    one, four = best_seconds([forward(1), forward(4)])
    per_unit = max((four - one) / (3 * example.cost), 1e-9)
    overhead = min(max(one / per_unit - example.cost, 4.0), 1024.0)
    if lanes > 1:
        lanes = _media_lanes(forward, lanes)
        if lanes > 1 and wide_runner is not None:
            _on_threads(threads, forward(1), wide_runner)
        log.info("media passes: %s", "one at a time on every thread" if lanes == 1
                 else f"{lanes} single-threaded lanes, a lone item on every thread")
    return overhead, lanes


def _media_lanes(forward: Callable[[int], Callable[[], object]], lanes: int) -> int:
    """`lanes` if that many single-threaded passes at once, `MEDIA_ITEMS_PER_LANE` items
    each, take at most `MEDIA_LANES_MAX_TIME` of one pass of all those items on every
    thread; else 1. Two torch threads on one pass wait on each other at every operator;
    two passes do not, but they share the memory bandwidth: which wins depends on the
    model (bench/RESULTS.md, "Media lanes"). As for wide copies (`wide_copy_pays`), a
    start's busy cores can hide the gain, so lanes that do not pay are measured again."""
    together, apart = forward(lanes * MEDIA_ITEMS_PER_LANE), forward(MEDIA_ITEMS_PER_LANE)

    def on_one_thread() -> None:
        with torch_threads(1):
            apart()

    best = [float("inf")] * 2  # seconds: one pass on every thread, the lanes at once
    with ThreadPoolExecutor(lanes) as pool:
        for attempt in range(WIDE_COPY_TRIES):
            if attempt:
                time.sleep(WIDE_COPY_PAUSE)
            seconds = best_seconds([together, lambda: list(pool.map(lambda _: on_one_thread(), range(lanes)))],
                                   repeats=2)
            best = [min(pair) for pair in zip(best, seconds)]
            if best[1] <= MEDIA_LANES_MAX_TIME * best[0]:
                break
    log.info("media passes of %d items: %.0f ms on every thread, %.0f ms in %d single-threaded lanes",
             lanes * MEDIA_ITEMS_PER_LANE, best[0] * 1e3, best[1] * 1e3, lanes)
    return lanes if best[1] <= MEDIA_LANES_MAX_TIME * best[0] else 1


def _warm_up(model: LoadedModel, max_length: int, lanes: _TextLanes | None = None,
             wide_runner: Executor | None = None) -> tuple[float, float]:
    """Run the shapes the first requests will have, so they pay no one-time costs, and
    return the batching cost model: the fixed cost of a forward pass in tokens' worth of
    compute, and what a padding token costs against a token. Timing one short input, four
    long ones and one long with fifteen short fits time = fixed + per_token x (tokens +
    weight x padding). The mixed batch has 16 rows because what padding costs depends on
    the batch: CTranslate2 float32 skips most of it in small batches but not in mid-size
    ones, and the scheduler must not merge long and short inputs where that is dear
    (bench/RESULTS.md, "The engine's ceiling as the engines issue measures it"). The
    passes are timed as a lane runs them (`lanes`: the model's, by default the engine's),
    and a wide pass runs where lanes run them (on `wide_runner`, for lanes of torch threads)."""
    engine = model.engine
    lanes = lanes or _TextLanes(engine.lanes, engine.widens, None)
    on_lane = contextlib.nullcontext if lanes.threads is None else partial(torch_threads, lanes.threads[0])

    def forward(lengths: list[int], wide: bool = False, express: bool = False) -> Callable[[], object]:
        ids = np.full((len(lengths), max(lengths)), engine.pad_id, dtype=np.int64)
        mask = (np.arange(ids.shape[1]) < np.array(lengths)[:, None]).astype(np.int64)
        ids[mask == 1] = engine.pad_id + 1
        types = np.zeros_like(ids)
        return lambda: model.forward(ids, mask, types, wide=wide, express=express)

    def lane_pass(run: Callable[[], object]) -> None:
        with on_lane():
            run()

    # Every lane once, at the same time: a backend may hold one replica per lane.
    with ThreadPoolExecutor(lanes.count) as pool:
        list(pool.map(lambda _: lane_pass(forward([max_length])), range(lanes.count)))
    if lanes.widens:
        wide = forward([max_length], wide=True)
        if lanes.threads is None or wide_runner is None:
            wide()
        else:
            _on_threads(lanes.threads[1], wide, wide_runner)
    if engine.express:
        forward([max_length], express=True)()
    short, long = min(16, max_length), min(128, max_length)
    with on_lane():
        small, large, mixed = best_seconds([forward([short]), forward([long] * 4),
                                            forward([long] + [short] * MIXED_SHORT)])
    per_token = max((large - small) / (4 * long - short), 1e-9)
    # Clamped: a start on a busy machine must not leave a senseless cost model behind.
    overhead_tokens = min(max(small / per_token - short, 4.0), 1024.0)
    padding = MIXED_SHORT * (long - short)
    weight = 1.0 if padding == 0 else min(max(((mixed - small) / per_token - long - (MIXED_SHORT - 1) * short)
                                              / padding, 0.0), 1.0)
    log.info("%s engine, %d lane(s)%s; forward pass: %.2f ms fixed, %.1f us per token: overhead = %.0f tokens, "
             "a padding token costs %.2f of a token", engine.name, lanes.count,
             ", wide pass for a lone input" if lanes.widens else "",
             (small - short * per_token) * 1e3, per_token * 1e6, overhead_tokens, weight)
    return overhead_tokens, weight


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
        _on_threads(queue.threads[batch.wide], partial(_run, batch, queue.model, queue.arena, scheduler, channel),
                    queue.wide_runner if batch.wide else None)


def _on_threads(threads: int, run: Callable[[], object], runner: Executor | None = None) -> None:
    """Run `run` on `threads` torch threads, from `runner`'s thread where given."""
    def on_its_threads() -> None:
        with torch_threads(threads):
            run()

    if runner is None:
        on_its_threads()
    else:
        runner.submit(on_its_threads).result()


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
