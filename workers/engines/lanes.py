"""How an engine that runs lanes (a single-threaded pass per core: CTranslate2 and ONNX
Runtime on a CPU) may also keep a copy of the model for passes on every thread: a wide
pass for a lone input while the other lanes idle, and (CTranslate2) the express lane's
copy. A copy is made for small models only (`wants_copy`) and kept only where its passes
measured faster at load (`settle_wide_copy`; the choice kept in the cache, so that later
starts on the machine choose alike without timing). Where an express lane runs beside the lanes,
the threads that compute the lanes' passes run at a higher nice value (`LANE_NICENESS`)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec
import numpy as np
import torch

from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import keep_record, measurement_record, read_record


# A wide pass needs a second copy of the weights, set to use every thread (and CTranslate2's
# express lane one more, on one thread); they are made for models up to this size only, and kept only if it takes at most this share of a one-lane
# pass: some engines' wide passes pay, some are borderline, some lose
# (bench/results/code-choices.md#figures-behind-the-code-choices).
WIDE_COPY_MAX_BYTES = 512 * 2**20
WIDE_COPY_MAX_TIME = 0.85
WIDE_COPY_TRIES = 3
WIDE_COPY_PAUSE = 0.3  # seconds between tries


# Added to the nice value of the threads that compute the lanes' passes where an express lane
# runs beside them: a thread at the default value then gets about 90% of a core it shares
# with a lane (the kernel's weights for nice 0 and 10), so an express pass runs at nearly
# its own speed.
LANE_NICENESS = 10

_Built = TypeVar("_Built")


def add_niceness(niceness: int) -> None:
    """Add `niceness` to the calling thread's nice value (on Linux a nice value belongs to
    a thread: this one's only). Where the system refuses, the thread keeps its value and
    lanes share cores evenly with the express lane."""
    with contextlib.suppress(OSError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)


def built_at_lane_niceness(build: Callable[[], _Built]) -> _Built:
    """`build()`, called on a thread of its own at the lanes' nice value. For a runtime
    that computes its lanes' passes on threads it starts while it is built (OpenVINO's
    streams, CTranslate2's workers), not on its callers': a thread starts at the nice value
    of the thread that starts it, and an unprivileged process cannot lower one again, so
    this is where those threads get the lanes' value (the inference process sets the lanes'
    own threads', workers/inference/worker.py)."""
    built: list[_Built] = []
    failed: list[BaseException] = []

    def run() -> None:
        add_niceness(LANE_NICENESS)
        try:
            built.append(build())
        except BaseException as exc:  # noqa: BLE001 (raised again in the calling thread)
            failed.append(exc)

    builder = threading.Thread(target=run, name="lanes-builder")
    builder.start()
    builder.join()
    if failed:
        raise failed[0]
    return built[0]


def wants_copy(model: Path, lanes: int) -> bool:
    """Whether an engine with `lanes` lanes should load a second copy of the model in
    `model` (a folder, or one file of it) for wide passes or the express lane."""
    return lanes > 1 and stored_bytes(model) <= WIDE_COPY_MAX_BYTES


def stored_bytes(model: Path) -> int:
    """The size of `model`: a folder's files, or one file."""
    files = [model] if model.is_file() else [path for path in model.rglob("*") if path.is_file()]
    return sum(path.stat().st_size for path in files)


def wide_copy_pays(engine: _WithWideCopy, max_length: int) -> bool:
    """Whether the engine's wide passes over one input of 16 and of 64 tokens take under
    `WIDE_COPY_MAX_TIME` of one-lane passes, measured as the server runs them: with one
    torch thread (`workers.engines.set_torch_threads`). They need not: CTranslate2 at int8
    is slower on 2 threads than on 1 (bench/results/lanes.md#engines-in-process-with-lanes). A wide pass suffers most from a core that is busy
    elsewhere (at a server's start, the tokenizer processes loading their models), so a
    copy that does not pay is measured again after a pause, `WIDE_COPY_TRIES` times in
    all, keeping the best time of each pass."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best: dict[int, list[float]] = {}  # input length -> best seconds of [wide, one lane]
        for attempt in range(WIDE_COPY_TRIES):
            if attempt:
                time.sleep(WIDE_COPY_PAUSE)
            for length in {min(16, max_length), min(64, max_length)}:
                ids = np.full((1, length), engine.pad_id + 1, dtype=np.int64)
                mask, types = np.ones_like(ids), np.zeros_like(ids)
                seconds = best_seconds([lambda: engine.forward(ids, mask, types, wide=True),
                                        lambda: engine.forward(ids, mask, types)])
                best[length] = [min(pair) for pair in zip(best.get(length, seconds), seconds)]
            if sum(wide for wide, _ in best.values()) < WIDE_COPY_MAX_TIME * sum(lane for _, lane in best.values()):
                return True
        return False
    finally:
        torch.set_num_threads(threads)


def best_seconds(calls: Sequence[Callable[[], object]], repeats: int = 5) -> list[float]:
    """The least disturbed of `repeats` timed runs of each call, after one untimed run
    that pays any one-time costs. Other processes may be busy (at a server's start most of
    all), so the calls are timed in turns: a disturbance falls on all of them alike."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for index, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[index] = min(best[index], time.perf_counter() - start)
    return best


class _WithWideCopy(Protocol):
    """An engine holding its wide copy in `_wide` (None: none) and saying so in `widens`."""

    name: str
    _wide: object | None
    widens: bool
    pad_id: int

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor: ...


WIDE_COPY_VERSION = "1"  # of `wide_copy_pays`' measurement: a change to it measures again


class WideCopyChoice(msgspec.Struct, frozen=True):
    """Whether a model's wide copy paid when its engine was first loaded on this machine."""

    pays: bool


def settle_wide_copy(engine: _WithWideCopy, spec: ModelSpec, threads: int) -> None:
    """Drop `engine`'s wide copy (of `spec`, on `threads` threads) unless its passes pay
    (`wide_copy_pays`, or the choice an earlier start kept: `measurement_record`); then set
    `widens`. Kept, a start does not time it again, nor choose otherwise by the noise of
    the moment (a server's lone inputs on one thread or two)."""
    if engine._wide is not None:
        record = measurement_record("wide-copy", spec, threads, [engine.name], WIDE_COPY_VERSION)
        choice = read_record(record, WideCopyChoice)
        if choice is None:
            choice = WideCopyChoice(wide_copy_pays(engine, spec.max_length))
            keep_record(record, choice)
        if not choice.pays:
            engine._wide = None
    engine.widens = engine._wide is not None
