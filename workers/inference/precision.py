"""The bfloat16 trial at load: where `dtype = "auto"` chose bfloat16 on a CPU that computes
it natively (`ModelSpec.float32_engine` is set), the model is loaded in bfloat16 (on
OpenVINO where `auto` chose it, falling back to torch, or on the engine named) and in
float32 on the engine `auto` would otherwise pick, both run the same built-in
inputs (64 corpus texts; for a model that sees or hears, also 8 random images, clips'
features or pages with their prompts), and
bfloat16 is kept only if, on each kind of input, its vectors stay within a cosine bar of
float32's and it is faster; else the float32 model serves. The losing model is dropped
before serving.

The bar (`MEAN_COSINE`, `MIN_COSINE`) is over every output vector (a multi-vector model's,
every token's). "Faster": more inputs per second in batches of similar ones shared by the
lanes, with one input at a time taking at most `LONE_SLOWDOWN` times float32's (the median
over inputs of every length, each after a pause as one client's requests come: on small
models a pass over a few tokens costs torch more fixed time than CTranslate2, and a pass
after idle cores finds fewer of its weights in the caches, while batches run several
times faster: bench/results/bfloat16.md#lone-inputs-timed-as-one-client-sends-them).

The trial's figures are kept in the cache directory, keyed by the model's folder, its
settings, the thread count, the CPU and the libraries' versions: a later start on the same
machine decides from them without the trial (and without loading the losing model), so
it serves the same precision as the first and starts as fast as a float32 one. Deleting
the record (its path is logged) measures again.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import NotPrepared, keep_record, measurement_record, needs_record, read_record
from workers.inference.corpus import sentences
from workers.preprocess.media import feature_items, media_module
from workers.preprocess.text import TokenItem, collate_tokens, load_tokenizer

if TYPE_CHECKING:
    from workers.heads import LoadedModel

log = logging.getLogger(__name__)

MEAN_COSINE = 0.9999
MIN_COSINE = 0.999
LONE_SLOWDOWN = 1.5
TRIAL_TEXTS = 64
TRIAL_BATCH = 8
TRIAL_MEDIA = 8
TRIAL_MEDIA_BATCH = 4
TRIAL_ROUNDS = 2
SPIN_DOWN_S = 0.3
TRIAL_LONE_TEXTS = 16  # of the trial's texts, spread over their lengths, timed one at a time
TRIAL_LONE_MEDIA = 4  # times a lone media item is timed per round
# Before each lone pass: one client's requests come apart, and the other engine's threads
# stop spinning (OpenMP waits actively for a fraction of a millisecond after a pass).
LONE_PAUSE_S = 0.03
_ITEMS = {"image": "images", "audio": "clips"}  # what the figures call a medium's items
_SEED = 20261201  # any fixed seed: the same texts on every start
# How the figures are measured: a change here makes every model's kept figures stale.
TRIAL_VERSION = "1"


@dataclass(frozen=True)
class TrialFigures:
    """bfloat16 against float32 on one kind of the trial's inputs."""

    inputs: str  # "texts", or the media of a model that sees or hears: "images" or "clips"
    mean_cosine: float
    min_cosine: float
    bfloat16_per_s: float  # inputs per second in batches of similar ones shared by the lanes
    float32_per_s: float
    bfloat16_lone_ms: float  # one input at a time, each after a pause: the median over the lone inputs
    float32_lone_ms: float


def keeps_bfloat16(trials: list[TrialFigures]) -> tuple[bool, str]:
    """Whether bfloat16 serves (it must pass on every kind of input), and why (or why not)."""
    verdicts = []
    for figures in trials:
        keep, why = _verdict(figures)
        if not keep:
            return False, f"{figures.inputs}: {why}"
        verdicts.append(f"{figures.inputs}: {why}")
    return True, "; ".join(verdicts)


def _verdict(figures: TrialFigures) -> tuple[bool, str]:
    what = figures.inputs
    if figures.mean_cosine < MEAN_COSINE or figures.min_cosine < MIN_COSINE:
        return False, (f"its vectors are not close enough to float32's (mean cosine {figures.mean_cosine:.6f}, "
                       f"min {figures.min_cosine:.6f}; the bar is {MEAN_COSINE} and {MIN_COSINE})")
    if figures.bfloat16_per_s <= figures.float32_per_s:
        return False, (f"it is not faster ({figures.bfloat16_per_s:.1f} {what}/s against float32's "
                       f"{figures.float32_per_s:.1f})")
    if figures.bfloat16_lone_ms > LONE_SLOWDOWN * figures.float32_lone_ms:
        return False, (f"a lone input is slower ({figures.bfloat16_lone_ms:.1f} ms against float32's "
                       f"{figures.float32_lone_ms:.1f} ms)")
    return True, (f"{figures.bfloat16_per_s:.1f} {what}/s against float32's {figures.float32_per_s:.1f}, a lone "
                  f"input {figures.bfloat16_lone_ms:.1f} ms against {figures.float32_lone_ms:.1f} ms; vectors' cosine "
                  f"to float32's: mean {figures.mean_cosine:.6f}, min {figures.min_cosine:.6f}")


def load_by_trial(spec: ModelSpec, threads: int, load: Callable[[ModelSpec, int], LoadedModel]) -> LoadedModel:
    """The model `spec` asks for in bfloat16, or in float32 on `spec.float32_engine` if the
    trial (or its figures kept from an earlier start) says so (`load`: how one spec is loaded)."""
    assert spec.float32_engine is not None
    float32_spec = msgspec.structs.replace(
        spec, engine=spec.float32_engine, dtype="float32", float32_engine=None,
        fallback_engine="torch" if spec.float32_engine != "torch" else None)
    bfloat16_spec = msgspec.structs.replace(spec, float32_engine=None)
    record = trial_record(spec, threads)
    kept = read_record(record, list[TrialFigures])
    if kept is None:
        needs_record(record, f"the bfloat16 trial of '{spec.name}'")
        return _load_by_new_trial(spec, float32_spec, bfloat16_spec, threads, load, record)
    keep, why = keeps_bfloat16(kept)
    log.info("'%s' serves %s: %s (figures of an earlier start's trial, kept in %s)",
             spec.name, "bfloat16" if keep else "float32", why, record)
    if keep:
        try:
            return load(bfloat16_spec, threads)
        except NotPrepared:
            raise
        except Exception:
            log.warning("'%s' cannot be loaded in bfloat16; serving float32", spec.name, exc_info=True)
    return load(float32_spec, threads)


def _load_by_new_trial(spec: ModelSpec, float32_spec: ModelSpec, bfloat16_spec: ModelSpec, threads: int,
                       load: Callable[[ModelSpec, int], LoadedModel], record: Path) -> LoadedModel:
    exact = load(float32_spec, threads)
    try:
        reduced = load(bfloat16_spec, threads)
        figures = run_trial(spec, reduced, exact, threads)
    except Exception:
        # bfloat16 is an option: a model that cannot load or run it is served as it was.
        log.warning("'%s' cannot be tried in bfloat16; serving float32", spec.name, exc_info=True)
        return exact
    keep_record(record, figures)
    keep, why = keeps_bfloat16(figures)
    log.info("'%s' serves %s: %s", spec.name, "bfloat16" if keep else "float32", why)
    chosen = reduced if keep else exact
    del reduced, exact
    gc.collect()
    return chosen


def trial_record(spec: ModelSpec, threads: int) -> Path:
    """Where the figures of `spec`'s trial with `threads` threads on this machine are kept."""
    return measurement_record("precision", spec, threads, (spec.engine, spec.float32_engine or ""), TRIAL_VERSION)


# Runs one batch (or one lone input) of a trial on a model, giving its output.
Pass = Callable[["LoadedModel"], object]


@dataclass(frozen=True)
class TrialInputs:
    """One kind of a trial's inputs, as batches and lone inputs to run on a model."""

    name: str  # "texts", "images", "clips"
    batches: list[Pass]
    sizes: list[int]  # inputs per batch
    lones: list[Pass]  # inputs run one at a time, in turn


def run_trial(spec: ModelSpec, reduced: LoadedModel, exact: LoadedModel, threads: int) -> list[TrialFigures]:
    """Run both models on the trial's texts (and the media of a model that sees or hears):
    per kind of input, their vectors' cosines and their speeds."""
    pad_id = reduced.engine.pad_id
    trials = [text_inputs(spec, pad_id, sentences(TRIAL_TEXTS, _SEED), TRIAL_BATCH, TRIAL_LONE_TEXTS)]
    if KINDS[spec.kind].medium is not None:
        trials.append(_media(spec, pad_id))
    return [_measure(inputs, {"bfloat16": reduced, "float32": exact}, threads) for inputs in trials]


def text_inputs(spec: ModelSpec, pad_id: int, texts: list[str], batch: int, lones: int) -> TrialInputs:
    """`texts` tokenized for `spec`, in batches of `batch` of similar lengths (as the
    scheduler groups them), and `lones` of them spread over their lengths, one at a time."""
    tokenizer = load_tokenizer(spec)
    tokenizer.enable_truncation(spec.max_length)
    encodings = sorted(tokenizer.encode_batch(texts), key=len)

    def padded(chosen: list) -> dict[str, np.ndarray]:
        return collate_tokens([TokenItem(np.array(e.ids, dtype=np.int32)) for e in chosen], pad_id)

    batches = [padded(encodings[i:i + batch]) for i in range(0, len(encodings), batch)]
    step = max(len(encodings) // lones, 1)
    return TrialInputs("texts", [partial(_forward, arrays=arrays) for arrays in batches],
                       [len(arrays["input_ids"]) for arrays in batches],
                       [partial(_forward, arrays=padded([e]), lone=True) for e in encodings[::step]])


def _media(spec: ModelSpec, pad_id: int) -> TrialInputs:
    """Items in the shape of the model's media (pixels, spectrograms, a page model's
    pixels with its prompts), their floating values random: bfloat16's rounding shows on
    any values; blank ones would all give one vector."""
    module = media_module(spec.kind)
    rng = np.random.default_rng(_SEED)
    _, items = feature_items(module.example(spec, TRIAL_MEDIA))
    items = [{name: rng.standard_normal(array.shape).astype(array.dtype) if array.dtype.kind == "f" else array
              for name, array in item.items()} for item in items]

    def batch(start: int, count: int) -> Pass:
        return partial(_forward_media, arrays=module.collate(items[start:start + count], pad_id=pad_id))

    starts = range(0, TRIAL_MEDIA, TRIAL_MEDIA_BATCH)
    return TrialInputs(_ITEMS[KINDS[spec.kind].medium], [batch(start, TRIAL_MEDIA_BATCH) for start in starts],
                       [TRIAL_MEDIA_BATCH] * len(starts), [batch(0, 1)] * TRIAL_LONE_MEDIA)


def _forward(model: LoadedModel, arrays: dict[str, np.ndarray], lone: bool = False) -> object:
    return model.forward(**arrays, wide=lone and model.engine.widens)


def _forward_media(model: LoadedModel, arrays: dict[str, np.ndarray]) -> object:
    return model.forward_media(arrays)


def _measure(inputs: TrialInputs, models: dict[str, LoadedModel], threads: int) -> TrialFigures:
    outputs, per_s, lone_ms = {}, {name: 0.0 for name in models}, {name: [] for name in models}
    for name, model in models.items():
        size_torch_threads(model, threads)
        outputs[name] = [run(model) for run in inputs.batches]  # also the warm-up of these shapes
        for lone in inputs.lones:
            lone(model)
    # Rounds alternate the models and keep each one's best: one engine's threads spin for a
    # while after its pass (OpenMP's block time) and would slow the other's first pass.
    for _ in range(TRIAL_ROUNDS):
        for name, model in models.items():
            time.sleep(SPIN_DOWN_S)
            size_torch_threads(model, threads)
            per_s[name] = max(per_s[name], per_second(model, inputs))
        # Lone inputs alternate the models input by input, so the machine's drift falls on both.
        for lone in inputs.lones:
            for name, model in models.items():
                size_torch_threads(model, threads)
                time.sleep(LONE_PAUSE_S)
                lone_ms[name].append(milliseconds(partial(lone, model)))
    cosines = row_cosines(outputs["bfloat16"], outputs["float32"])
    lone = {name: float(np.median(times)) for name, times in lone_ms.items()}
    return TrialFigures(inputs.name, float(cosines.mean()), float(cosines.min()), per_s["bfloat16"],
                        per_s["float32"], lone["bfloat16"], lone["float32"])


def size_torch_threads(model: LoadedModel, threads: int) -> None:
    """Size torch's threads for `model` as the inference process will
    (workers.engines.set_torch_threads): lanes share no pool."""
    torch.set_num_threads(threads if model.engine.lanes == 1 else 1)


def per_second(model: LoadedModel, inputs: TrialInputs) -> float:
    """Inputs per second of `inputs`' batches, shared by the model's lanes."""
    with ThreadPoolExecutor(model.engine.lanes) as pool:
        start = time.perf_counter()
        list(pool.map(lambda run: run(model), inputs.batches))
        took = time.perf_counter() - start
    return sum(inputs.sizes) / took


def milliseconds(run: Callable[[], object]) -> float:
    """How long one call of `run` takes."""
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def row_cosines(reduced: list, exact: list) -> np.ndarray:
    """The cosine of each output vector to its float32 counterpart (every token's, for
    outputs with a vector per token)."""
    def rows(outputs: list) -> np.ndarray:
        return np.vstack([np.vstack(output) if isinstance(output, list) else output for output in outputs]
                         ).astype(np.float64)

    a, b = rows(reduced), rows(exact)
    return (a * b).sum(axis=1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
