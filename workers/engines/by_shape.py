"""A lone input on another runtime: where the engine that runs a model's batches fastest is
not the one that runs one input fastest (back to back on a float32 CPU, CTranslate2's lanes
win batches while ONNX Runtime's and OpenVINO's passes on every thread win a lone text;
after a pause, as one client's requests come, they may tie:
bench/results/engines.md#a-lone-input-on-another-runtime), the inference process keeps
both: its batches on the first, a lone input's pass (the wide pass the scheduler cuts for
an input that arrives while every lane idles) on the second.

`ModelSpec.lone_engines` names the candidates (`infinity.folders.resolve`: float32 on
CPUs, text models, the engines installed that serve the model). Each is loaded and its
lone pass timed against the batches engine's at load; the fastest is kept if it takes at
most `LONE_ENGINE_MAX_TIME` of the batches engine's (a second copy of the weights must pay
for itself), and the others are dropped. Where the batches engine's lone pass takes under
`LONE_PASS_MIN_SECONDS` (timed back to back) none is loaded: the serving path around such a pass costs more
than another runtime could save, and a load costs start time (an export) and memory. A
candidate named in `models.toml` (`ModelSpec.lone_engine_named`) is kept unmeasured; "auto"
loads none for a model larger than the engines' wide copies (`WIDE_COPY_MAX_BYTES`).

Both runtimes compute in float32, so a text gets the same vector alone as in a batch, to
float32's rounding (the same as between two batches of different shapes on one runtime).
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec
import numpy as np
import torch

from infinity.shared.kinds import RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import keep_record, measurement_record, needs_record, read_record
from workers.engines.base import Engine
from workers.engines.lanes import WIDE_COPY_MAX_BYTES, best_seconds, stored_bytes

log = logging.getLogger(__name__)

# A candidate is kept only if its lone passes take at most this share of the batches
# engine's: below that the saving is within what a pass varies between starts.
LONE_ENGINE_MAX_TIME = 0.85
# No candidate is loaded for a model whose lone pass takes less than this on its batches
# engine (over the lengths `LONE_LENGTHS`).
LONE_PASS_MIN_SECONDS = 0.002
# The lengths, in tokens, of the lone inputs timed: a short query and a passage.
LONE_LENGTHS = (16, 64)
LONE_ROUNDS = 5
# Before each timed lone pass: one client's requests come apart.
LONE_PAUSE_S = 0.03
# How the figures are measured: a change here makes every model's kept figures stale.
LONE_VERSION = "1"


class LoneSplit:
    """An `Engine` running batches on `batches` and a lone input's pass (`forward(wide=True)`)
    on `lone`, on every thread where `lone` widens."""

    widens = True  # a lone input's pass is `lone`'s

    def __init__(self, batches: Engine, lone: Engine) -> None:
        self.batches = batches
        self.lone = lone
        self.name = batches.name
        self.pad_id = batches.pad_id
        self.lanes = batches.lanes
        self.express = batches.express
        self.on_caller_threads = batches.on_caller_threads

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor:
        if wide:
            return self.lone.forward(input_ids, attention_mask, token_type_ids, wide=self.lone.widens)
        return self.batches.forward(input_ids, attention_mask, token_type_ids, express=express)

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        return self.batches.forward_media(arrays)


def lone_engine_of(engine: Engine) -> str | None:
    """The engine a lone input's pass runs on, where it is not `engine`'s own."""
    return engine.lone.name if isinstance(engine, LoneSplit) else None


class LoneFigures(msgspec.Struct, frozen=True):
    """What the timing at load found: the engine kept for lone inputs (None: the batches
    engine's own pass), and each engine's lone passes in seconds."""

    chosen: str | None
    seconds: dict[str, float]


def with_lone_engine(engine: Engine, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput],
                     load: Callable[[ModelSpec, int, Mapping[str, RawOutput]], Engine]) -> Engine:
    """`engine` (the spec's batches engine), with the lone engine of `spec.lone_engines`
    that pays where one does (`load`: how an engine is loaded from a spec). The figures
    are kept in the cache directory (`measurement_record`): a later start on the same
    machine loads the engine they chose without timing any."""
    if not spec.lone_engines or spec.dtype != "float32":
        return engine
    specs = {name: msgspec.structs.replace(spec, engine=name, fallback_engine=None, lone_engines=())
             for name in spec.lone_engines}
    if spec.lone_engine_named:
        return LoneSplit(engine, load(specs[spec.lone_engines[0]], threads, outputs))
    if stored_bytes(Path(spec.path)) > WIDE_COPY_MAX_BYTES:
        return engine  # a second copy of weights this large is not made (as the engines' wide copies)
    record = measurement_record("lone-engine", spec, threads, (spec.engine, *spec.lone_engines), LONE_VERSION)
    figures = read_record(record, LoneFigures)
    if figures is not None:
        log.info("'%s': lone inputs on %s (figures of an earlier start, kept in %s)",
                 spec.name, figures.chosen or engine.name, record)
        return engine if figures.chosen is None else LoneSplit(engine, load(specs[figures.chosen], threads, outputs))
    needs_record(record, f"the timing of '{spec.name}''s lone inputs")
    figures, kept = _timed(engine, spec, list(specs.values()), threads, outputs, load)
    keep_record(record, figures)
    log.info("'%s': lone inputs on %s (their passes: %s)", spec.name, figures.chosen or engine.name,
             ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in figures.seconds.items()))
    return engine if kept is None else LoneSplit(engine, kept)


def _timed(engine: Engine, spec: ModelSpec, candidates: list[ModelSpec], threads: int,
           outputs: Mapping[str, RawOutput], load: Callable[[ModelSpec, int, Mapping[str, RawOutput]], Engine],
           ) -> tuple[LoneFigures, Engine | None]:
    """Load the candidates and time their lone passes against `engine`'s: the figures, and
    the candidate chosen (the others dropped)."""
    lengths = sorted({min(length, spec.max_length) for length in LONE_LENGTHS})
    warm = sum(best_seconds([_lone_pass(engine, length)])[0] for length in lengths)
    if warm < LONE_PASS_MIN_SECONDS:
        return LoneFigures(None, {engine.name: warm}), None
    loaded: dict[str, Engine] = {}
    for candidate in candidates:
        try:
            loaded[candidate.engine] = load(candidate, threads, outputs)
        except Exception:
            log.warning("'%s': %s cannot load for lone inputs", spec.name, candidate.engine, exc_info=True)
    own, *seconds = lone_seconds([engine, *loaded.values()], lengths)
    figures = LoneFigures(None, {engine.name: own, **dict(zip(loaded, seconds))})
    chosen = choose_lone_engine(engine.name, own, dict(zip(loaded, seconds)))
    kept = None if chosen is None else loaded.pop(chosen)
    loaded.clear()
    gc.collect()  # the candidates not kept: their weights go before serving
    return msgspec.structs.replace(figures, chosen=chosen), kept


def choose_lone_engine(own_name: str, own_seconds: float, candidates: Mapping[str, float]) -> str | None:
    """Of `candidates` (engine -> seconds of its lone passes), the one to run lone inputs
    instead of the batches engine (`own_seconds` on `own_name`), or None."""
    if not candidates:
        return None
    name, seconds = min(candidates.items(), key=lambda item: item[1])
    return name if name != own_name and seconds <= LONE_ENGINE_MAX_TIME * own_seconds else None


def lone_seconds(engines: list[Engine], lengths: list[int]) -> list[float]:
    """Of each engine, its lone passes (wide where it widens) over one input of each of
    `lengths` tokens, summed: each pass after a pause, as one client's requests come (a
    pass after idle cores finds fewer of its weights in the caches, which can undo a
    runtime's lead), the median of `LONE_ROUNDS`; the engines timed in turns, so a core
    busy elsewhere (at a start, the other processes loading) slows all of them alike."""
    passes = [[_lone_pass(engine, length) for length in lengths] for engine in engines]
    for calls in passes:
        for call in calls:
            call()  # one-time costs
    times: list[list[list[float]]] = [[[] for _ in lengths] for _ in engines]
    for _ in range(LONE_ROUNDS):
        for engine_times, calls in zip(times, passes):
            for length_times, call in zip(engine_times, calls):
                time.sleep(LONE_PAUSE_S)
                start = time.perf_counter()
                call()
                length_times.append(time.perf_counter() - start)
    return [sum(statistics.median(length_times) for length_times in engine_times) for engine_times in times]


def _lone_pass(engine: Engine, length: int) -> Callable[[], object]:
    """One input of `length` tokens through `engine`'s lone pass."""
    ids = np.full((1, length), engine.pad_id + 1, dtype=np.int64)
    mask, types = np.ones_like(ids), np.zeros_like(ids)
    return lambda: engine.forward(ids, mask, types, wide=engine.widens)
