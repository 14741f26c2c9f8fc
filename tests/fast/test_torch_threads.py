"""`torch_threads`: a thread's own torch thread count; the warm-up's choice between media
lanes and one pass on every thread, on stand-in passes of known length; the threads a
lane gives each pass of a queue in lanes; text lanes for engines on the caller's threads,
and the warm-up timing their passes as a lane runs them."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch

from infinity.shared import protocol
from workers.engines import torch_threads
from workers.inference.calibration import TextLanes, media_lanes, text_lanes, warm_up
from workers.inference.scheduler import QueuePolicy, Scheduler, media_queue
from workers.inference.worker import _Queue, _run_queued
from workers.preprocess.media import stack_items


def test_a_threads_count_is_its_own_and_is_restored():
    before = torch.get_num_threads()
    seen: list[int] = []

    def lane() -> None:
        with torch_threads(1):
            seen.append(torch.get_num_threads())
            time.sleep(0.05)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=lane)
    thread.start()
    time.sleep(0.02)
    during = torch.get_num_threads()
    thread.join()
    assert seen[0] == 1 and during == before
    assert torch.get_num_threads() == before


def _sleeping_passes(seconds_per_item: dict[bool, float]):  # noqa: ANN202
    """forward(count) for the warm-up: a pass of `count` items sleeps for them, at the rate
    of a lane's pass (True: run from a lane's thread, on one torch thread) or of one on
    every thread (False)."""
    def forward(count: int):  # noqa: ANN202
        def run() -> None:
            in_lane = threading.current_thread() is not threading.main_thread()
            assert not in_lane or torch.get_num_threads() == 1
            time.sleep(count * seconds_per_item[in_lane])
        return run
    return forward


def test_lanes_are_kept_where_they_measure_faster():
    # Two lanes of 2 items at once: 2 x 8 ms = 16 ms, against 4 x 8 ms = 32 ms on every thread.
    assert media_lanes(_sleeping_passes({True: 0.008, False: 0.008}), lanes=2) == 2


def test_lanes_are_refused_where_they_are_slower():
    # A lane's item costs 3x a wide pass's: 2 x 24 ms = 48 ms at once against 32 ms.
    assert media_lanes(_sleeping_passes({True: 0.024, False: 0.008}), lanes=2) == 1


class _ThreadsSeen:
    """A media model that records the torch threads each of its passes ran on."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.callers: list[str] = []

    def forward_media(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        self.seen.append(torch.get_num_threads())
        self.callers.append(threading.current_thread().name)
        return np.zeros((len(arrays["pixel_values"]), 1), dtype=np.float32)


def test_a_queue_in_lanes_runs_a_lanes_pass_on_its_share_and_a_wide_pass_on_every_thread_of_its_own():
    queue = media_queue("m")
    scheduler = Scheduler()
    scheduler.add_queue(queue, QueuePolicy(1000, 1, 1.0, lanes=2, widens=True))
    for request in (1, 2):
        scheduler.submit(request, queue, [request], [1], [{"pixel_values": np.zeros(4, dtype=np.float32)}])
    model, sent = _ThreadsSeen(), SimpleNamespace(send=lambda *messages: None)
    with ThreadPoolExecutor(1, thread_name_prefix="wide-pass") as wide_runner:
        by_queue = {queue: _Queue(model, SimpleNamespace(rows=np.zeros((4, 1), np.float32)), False, stack_items,
                                  True, (1, 3), wide_runner)}
        before = torch.get_num_threads()
        _run_queued(scheduler.next_batch(), by_queue, scheduler, sent)
        _run_queued(dataclasses.replace(scheduler.next_batch(), wide=True), by_queue, scheduler, sent)
    assert model.seen == [1, 3]
    # The lane's pass on the lane; the wide pass on the one thread every wide pass runs on.
    assert model.callers[0] == threading.current_thread().name and model.callers[1].startswith("wide-pass")
    assert torch.get_num_threads() == before


def _engine(on_caller_threads: bool, lanes: int = 1, widens: bool = False) -> SimpleNamespace:
    return SimpleNamespace(on_caller_threads=on_caller_threads, lanes=lanes, widens=widens, express=False)


def test_torch_on_a_cpu_runs_texts_in_a_single_threaded_lane_per_core():
    assert text_lanes(_engine(True), threads=2) == TextLanes(2, True, (1, 2), express=True)
    assert text_lanes(_engine(True), threads=1) == TextLanes(1, False, None)
    # Engines with threads of their own keep their lanes (CTranslate2's replicas, ONNX Runtime's runs).
    assert text_lanes(_engine(False, lanes=2, widens=True), threads=2) == TextLanes(2, True, None)


class _ThreadsCosted:
    """A text engine on the caller's threads: each pass records its torch threads, whether
    it was wide and the thread it ran on, and sleeps 1 ms + 10 us per token."""

    pad_id, lanes, widens, express, name, on_caller_threads = 0, 1, False, False, "threads-costed", True

    def __init__(self) -> None:
        self.passes: list[tuple[int, bool]] = []
        self.wide_callers: list[str] = []

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):  # noqa: ANN001, ANN201
        self.passes.append((torch.get_num_threads(), wide))
        if wide:
            self.wide_callers.append(threading.current_thread().name)
        time.sleep(1e-3 + 10e-6 * int(attention_mask.sum()))
        return torch.zeros((*input_ids.shape, 1))


def test_the_warm_up_times_a_lanes_passes_on_a_lanes_threads():
    from workers.heads import LoadedModel
    from workers.heads.pooled import PooledEmbedding

    engine = _ThreadsCosted()
    head = PooledEmbedding.__new__(PooledEmbedding)
    head._plain_mean, head._normalize = True, False
    with torch_threads(2), ThreadPoolExecutor(1, thread_name_prefix="wide-pass") as wide_runner:
        warm_up(LoadedModel(engine, head, "float32"), max_length=256, lanes=TextLanes(2, True, (1, 2)),
                 wide_runner=wide_runner)
        assert torch.get_num_threads() == 2
    wide = [threads for threads, is_wide in engine.passes if is_wide]
    narrow = [threads for threads, is_wide in engine.passes if not is_wide]
    assert wide == [2]  # the lone input's pass, on every thread
    # ... from the thread that runs them served, so the first lone input finds its OpenMP team started.
    assert len(engine.wide_callers) == 1 and engine.wide_callers[0].startswith("wide-pass")
    assert len(narrow) > 2 and set(narrow) == {1}  # each lane once at start, then every timed pass


def test_the_media_warm_up_runs_a_lone_item_on_the_wide_passes_thread_where_lanes_are_kept(monkeypatch):
    import workers.inference.calibration as calibration

    example = protocol.FeatureInputs([protocol.ArrayPart.of("pixel_values", np.zeros((8, 4), np.float32))], [1] * 8)
    monkeypatch.setattr(calibration, "media_module",
                        lambda kind: SimpleNamespace(example=lambda spec, n: example, collate=stack_items))
    monkeypatch.setattr(calibration, "media_lanes", lambda forward, lanes: lanes)  # lanes kept
    model = _ThreadsSeen()
    model.engine = SimpleNamespace(on_caller_threads=True, pad_id=0)
    with torch_threads(2), ThreadPoolExecutor(1, thread_name_prefix="wide-pass") as wide_runner:
        _, lanes = calibration.warm_up_media(model, SimpleNamespace(kind="image_text"), threads=2, wide_runner=wide_runner)
    assert lanes == 2
    # The timed passes on the calling thread; then one on the wide passes' thread, on every thread.
    assert model.callers[-1].startswith("wide-pass") and model.seen[-1] == 2
    assert not any(caller.startswith("wide-pass") for caller in model.callers[:-1])
