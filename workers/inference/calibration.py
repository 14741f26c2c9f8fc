"""What an inference process measures at start to run its models well: how a model's text
passes run (`text_lanes`: lanes of single-threaded passes, a wide pass for a lone
input), the batching cost model from timed warm-up passes (`warm_up`), and whether media
passes run in single-threaded lanes (`warm_up_media`). The warm-up passes also pay every
one-time cost before the first request. The cost model is kept in the cache directory
(`cost_model_record`): a later start on the same machine runs each shape once, timing none."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec
import numpy as np

from infinity.shared.protocol import ModelSpec
from workers.engines import torch_threads
from workers.engines.artifacts import keep_record, measurement_record, read_record
from workers.engines.base import Engine
from workers.engines.by_shape import lone_engine_of
from workers.engines.lanes import WIDE_COPY_PAUSE, WIDE_COPY_TRIES, best_seconds
from workers.heads import LoadedModel
from workers.preprocess.media import feature_items, media_module

log = logging.getLogger(__name__)


MIXED_SHORT = 15  # short inputs next to the long one in the warm-up's mixed batch
COST_MODEL_VERSION = "1"  # of `warm_up`'s fit: a change to it measures again


class CostModel(msgspec.Struct, frozen=True):
    """What `warm_up` fits: a pass's fixed cost in tokens, what a padding token costs."""

    overhead_tokens: float
    padding_weight: float


@dataclass(frozen=True)
class TextLanes:
    """How a model's text passes run."""

    count: int  # passes at once
    widens: bool  # a lone input while the other lanes idle runs on every thread
    threads: tuple[int, int] | None  # as `_Queue.threads`
    express: bool = False  # one more pass may run beside the lanes (the scheduler's express lane)


def text_lanes(engine: Engine, threads: int) -> TextLanes:
    """The engine's own lanes; an engine running its passes on the caller's torch threads
    (torch on a CPU) gets a single-threaded lane per core and a lone input on every
    thread, as CTranslate2 and ONNX Runtime run their replicas: served, two passes on one
    thread each beat one pass on both, whose threads wait on each other at every operator
    while the front end and the tokenizers take a core
    (bench/results/lanes.md#text-lanes-on-torch). Such lanes also have an express lane:
    one more single-threaded pass on the same weights, from its own thread."""
    if engine.on_caller_threads and engine.lanes == 1 and threads > 1:
        return TextLanes(threads, True, (1, threads), express=True)
    return TextLanes(engine.lanes, engine.widens, None, engine.express)


# Media passes run in single-threaded lanes only where the same items through them take at
# most this share of one pass's time on every thread (bench/results/lanes.md#media-lanes).
MEDIA_LANES_MAX_TIME = 0.95


MEDIA_ITEMS_PER_LANE = 2


def warm_up_media(model: LoadedModel, spec: ModelSpec, threads: int,
                   wide_runner: Executor | None = None) -> tuple[float, int]:
    """Run batches of one and four media items (so the first requests pay no one-time
    costs; where lanes are kept, a lone item also on the wide passes' thread) and return
    the media queue's cost model, the fixed cost of a pass in items' cost units (an
    image's patches, a clip's frames, a page's tokens; a model's items are all alike, so
    there is no padding to price), and how many passes it runs at once."""
    lanes = threads if model.engine.on_caller_threads and threads > 1 else 1
    module = media_module(spec.kind)
    costs, items = feature_items(module.example(spec, max(4, lanes * MEDIA_ITEMS_PER_LANE)))

    def forward(count: int) -> Callable[[], object]:
        arrays = module.collate(items[:count], pad_id=model.engine.pad_id)
        return lambda: model.forward_media(arrays)

    one, four = best_seconds([forward(1), forward(4)])
    per_unit = max((four - one) / (3 * costs[0]), 1e-9)
    overhead = min(max(one / per_unit - costs[0], 4.0), 1024.0)
    if lanes > 1:
        lanes = media_lanes(forward, lanes)
        if lanes > 1 and wide_runner is not None:
            on_threads(threads, forward(1), wide_runner)
        log.info("media passes: %s", "one at a time on every thread" if lanes == 1
                 else f"{lanes} single-threaded lanes, a lone item on every thread")
    return overhead, lanes


def media_lanes(forward: Callable[[int], Callable[[], object]], lanes: int) -> int:
    """`lanes` if that many single-threaded passes at once, `MEDIA_ITEMS_PER_LANE` items
    each, take at most `MEDIA_LANES_MAX_TIME` of one pass of all those items on every
    thread; else 1. Two torch threads on one pass wait on each other at every operator;
    two passes do not, but they share the memory bandwidth: which wins depends on the
    model (bench/results/lanes.md#media-lanes). As for wide copies (`wide_copy_pays`), a
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


def cost_model_record(model: LoadedModel, spec: ModelSpec, threads: int, lanes: TextLanes) -> Path:
    """Where `warm_up`'s fit for `model` as loaded from `spec` is kept: keyed as the other
    measurements at load (`measurement_record`), and by what the start settled that the
    spec does not say (the precision, the engines of batches and of lone inputs, the lanes)."""
    engines = (model.engine.name, lone_engine_of(model.engine) or "")
    settled = f"{COST_MODEL_VERSION} {model.dtype} {' '.join(engines)} {lanes}"
    return measurement_record("cost-model", spec, threads, [name for name in engines if name], settled)


def warm_up(model: LoadedModel, max_length: int, lanes: TextLanes | None = None,
            wide_runner: Executor | None = None, record: Path | None = None) -> tuple[float, float]:
    """Run the shapes the first requests will have, so they pay no one-time costs, and
    return the batching cost model: the fixed cost of a forward pass in tokens' worth of
    compute, and what a padding token costs against a token. Timing one short input, four
    long ones and one long with fifteen short fits time = fixed + per_token x (tokens +
    weight x padding). The mixed batch has 16 rows because what padding costs depends on
    the batch: CTranslate2 float32 skips most of it in small batches but not in mid-size
    ones, and the scheduler must not merge long and short inputs where that is dear
    (bench/results/batching.md#the-padding-weight-refitted-on-sixteen-rows). The
    passes are timed as a lane runs them (`lanes`: the model's, by default the engine's),
    and a wide pass runs where lanes run them (on `wide_runner`, for lanes of torch threads).
    With a `record` that holds a fit (`cost_model_record`), each shape runs once, untimed,
    and the fit is taken from it; without one, what is fitted is written there."""
    engine = model.engine
    lanes = lanes or TextLanes(engine.lanes, engine.widens, None, engine.express)
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
            on_threads(lanes.threads[1], wide, wide_runner)
    if lanes.express:
        lane_pass(forward([max_length], express=True))
    short, long = min(16, max_length), min(128, max_length)
    shapes = [forward([short]), forward([long] * 4), forward([long] + [short] * MIXED_SHORT)]
    kept = None if record is None else read_record(record, CostModel)
    if kept is not None:
        with on_lane():
            for run in shapes:
                run()
        log.info("%s engine, %d lane(s)%s; overhead = %.0f tokens, a padding token costs %.2f of a token "
                 "(figures of an earlier start, kept in %s)", engine.name, lanes.count,
                 ", wide pass for a lone input" if lanes.widens else "", kept.overhead_tokens,
                 kept.padding_weight, record)
        return kept.overhead_tokens, kept.padding_weight
    with on_lane():
        small, large, mixed = best_seconds(shapes)
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
    if record is not None:
        keep_record(record, CostModel(overhead_tokens, weight))
    return overhead_tokens, weight


def on_threads(threads: int, run: Callable[[], object], runner: Executor | None = None) -> None:
    """Run `run` on `threads` torch threads, from `runner`'s thread where given."""
    def on_its_threads() -> None:
        with torch_threads(threads):
            run()

    if runner is None:
        on_its_threads()
    else:
        runner.submit(on_its_threads).result()
