"""Unit tests of the inference process's scheduler (budget of cost, count cap, cost
sorting, the pass cost model, fairness, cancellation), of a text batch's collation, and
of a lane running a batch."""

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from workers.inference.scheduler import Batch, QueuePolicy, Scheduler, split_by_cost
from workers.preprocess.text import TokenItem, collate_tokens


def _scheduler(max_tokens: int = 1000, max_size: int = 32, overhead: float = 1e6, lanes: int = 100,
               widens: bool = False, express: bool = False,
               cores_left: Callable[[], float] | None = None) -> Scheduler:
    """A scheduler; the default pass overhead is so high that only the budget splits, and
    the lanes so many that batches can be cut without finishing the ones before."""
    scheduler = Scheduler(cores_left=cores_left)
    scheduler.add_queue("m", QueuePolicy(max_tokens, max_size, overhead, lanes=lanes, widens=widens, express=express))
    return scheduler


def _submit(scheduler: Scheduler, request_id: int, lengths: list[int], queue: str = "m") -> None:
    """A request of texts `lengths` tokens long, each input's ids all alike (its slot + 1)."""
    slots = [request_id * 100 + i for i in range(len(lengths))]
    items = [TokenItem(np.full(n, slot + 1, dtype=np.int32)) for slot, n in zip(slots, lengths)]
    scheduler.submit(request_id, queue, slots, lengths, items)


def _padded(batch: Batch) -> dict[str, np.ndarray]:
    return collate_tokens([item.payload for item in batch.items], pad_id=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _clocked_scheduler(overhead: float) -> tuple[Scheduler, _Clock]:
    clock = _Clock()
    scheduler = Scheduler(clock)
    scheduler.add_queue("m", QueuePolicy(1000, 32, overhead, lanes=100))
    return scheduler, clock


def test_batch_is_padded_to_its_longest_input():
    scheduler = _scheduler()
    _submit(scheduler, 1, [3, 5, 2])
    batch = scheduler.next_batch()
    arrays = _padded(batch)
    assert arrays["input_ids"].shape == (3, 5)
    assert arrays["attention_mask"].sum(axis=1).tolist() == sorted([3, 5, 2])
    for row, item in enumerate(batch.items):
        assert arrays["input_ids"][row, :item.cost].tolist() == item.payload.ids.tolist()
        assert (arrays["input_ids"][row, item.cost:] == 0).all()
    assert "read_mask" not in arrays  # every token is read where it is attended


def test_a_batch_holding_tokens_read_but_not_attended_gets_a_read_mask():
    ids = np.array([5, 6, 7], dtype=np.int32)
    arrays = collate_tokens([TokenItem(ids, np.array([0, 1, 1], np.int8), np.array([1, 1, 0], np.int8)),
                             TokenItem(ids[:2], read=np.array([1, 0], np.int8))], pad_id=9)
    assert arrays["input_ids"].tolist() == [[5, 6, 7], [5, 6, 9]]
    assert arrays["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 0]]
    assert arrays["read_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert arrays["token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0]]


def test_token_budget_counts_padded_tokens():
    scheduler = _scheduler(max_tokens=40)
    _submit(scheduler, 1, [10] * 6)
    first = scheduler.next_batch()
    assert len(first.items) == 4  # 4 x 10 = 40 fits, 5 x 10 does not
    assert len(scheduler.next_batch().items) == 2


def test_count_cap():
    scheduler = _scheduler(max_tokens=10_000, max_size=3)
    _submit(scheduler, 1, [2] * 7)
    assert [len(scheduler.next_batch().items) for _ in range(3)] == [3, 3, 1]


def test_an_input_longer_than_the_budget_still_runs_alone():
    scheduler = _scheduler(max_tokens=8)
    _submit(scheduler, 1, [20, 3])
    sizes = sorted(len(scheduler.next_batch().items) for _ in range(2))
    assert sizes == [1, 1]


def test_batch_groups_similar_lengths_around_the_oldest_input():
    scheduler = _scheduler(max_tokens=100, max_size=3)
    _submit(scheduler, 1, [50])  # oldest
    _submit(scheduler, 2, [2, 3, 48, 49, 4])
    batch = scheduler.next_batch()
    # 2 x 50 fits the budget, 3 x 50 does not; the nearest length joins the oldest.
    assert sorted(item.cost for item in batch.items) == [49, 50]
    assert sorted(item.cost for item in scheduler.next_batch().items) == [2, 3, 4]


def test_inputs_of_the_anchors_length_fill_its_batch_before_shorter_ones():
    # Corpus batches, each sorted by length: the oldest request's inputs are one token longer
    # than the many of another. A window grown shorter first held 63 of those and the anchor,
    # and the cost split left the anchor a pass of its own, again for each of its inputs.
    scheduler = _scheduler(max_tokens=16384, max_size=64, overhead=30)
    _submit(scheduler, 1, [7] * 32)  # oldest
    _submit(scheduler, 2, [6] * 70)
    assert [item.cost for item in scheduler.next_batch().items] == [7] * 32
    assert [item.cost for item in scheduler.next_batch().items] == [6] * 64


@pytest.mark.parametrize("lengths, overhead, weight, groups", [
    ([5, 5, 5], 10, 1.0, [(0, 2)]),  # equal lengths: one pass
    ([2, 3, 100], 10, 1.0, [(0, 1), (2, 2)]),  # 3 x 100 padded is dearer than a second pass
    ([2, 3, 100], 1000, 1.0, [(0, 2)]),  # a pass costs more than the padding it saves
    ([1, 2, 3, 4], 0, 1.0, [(0, 0), (1, 1), (2, 2), (3, 3)]),  # free passes: no padding at all
    ([2, 3, 100], 10, 0.02, [(0, 2)]),  # cheap padding (195 x 0.02) costs less than a pass
    ([2, 3, 100], 10, 0.1, [(0, 1), (2, 2)]),  # 195 x 0.1 costs more
    ([], 5, 1.0, []),
])
def test_split_by_cost(lengths, overhead, weight, groups):
    assert split_by_cost(lengths, overhead, weight) == groups


def test_mixed_lengths_run_in_groups_starting_with_the_oldest():
    scheduler, _ = _clocked_scheduler(overhead=16)  # a still clock: nothing has waited longer
    _submit(scheduler, 1, [100])  # oldest
    _submit(scheduler, 2, [5, 6, 95, 7])
    first = scheduler.next_batch()
    assert sorted(item.cost for item in first.items) == [95, 100]
    assert sorted(item.cost for item in scheduler.next_batch().items) == [5, 6, 7]


def test_a_pass_holds_no_more_padded_tokens_than_a_multiple_of_its_fixed_cost():
    scheduler, _ = _clocked_scheduler(overhead=30)  # at most 16 x 30 = 480 padded tokens
    _submit(scheduler, 1, [256, 256])
    assert [len(scheduler.next_batch().items) for _ in range(2)] == [1, 1]
    _submit(scheduler, 2, [20] * 30)
    assert [len(scheduler.next_batch().items) for _ in range(2)] == [24, 6]


def test_oldest_input_is_never_starved_by_shorter_arrivals():
    scheduler = _scheduler(max_tokens=64, max_size=4)
    _submit(scheduler, 1, [60])
    for request_id in range(2, 12):
        _submit(scheduler, request_id, [2])
    batch = scheduler.next_batch()
    assert any(item.request.request_id == 1 for item in batch.items)


def test_a_short_input_overtakes_long_ones_once_it_has_waited_longer_for_its_cost():
    scheduler, clock = _clocked_scheduler(overhead=30)
    _submit(scheduler, 1, [256])  # cost 286
    clock.now = 1.0
    _submit(scheduler, 2, [10])  # cost 40: waited 0 s
    assert [item.cost for item in scheduler.next_batch().items] == [256]
    _submit(scheduler, 3, [256])
    clock.now = 1.5  # request 3 waited 0.5 s for 286, request 2 0.5 s for 40
    assert [item.request.request_id for item in scheduler.next_batch().items] == [2]
    assert [item.request.request_id for item in scheduler.next_batch().items] == [3]


def test_a_long_input_that_waited_long_enough_is_not_overtaken():
    scheduler, clock = _clocked_scheduler(overhead=30)
    _submit(scheduler, 1, [256])
    clock.now = 10.0
    _submit(scheduler, 2, [10])
    clock.now = 11.0  # 10 s / 286 (request 1) against 1 s / 40 (request 2)
    assert [item.request.request_id for item in scheduler.next_batch().items] == [1]


def test_inputs_of_similar_cost_keep_their_order():
    scheduler, clock = _clocked_scheduler(overhead=30)
    _submit(scheduler, 1, [60])  # cost 90: a 10-token input (40) is not a quarter of it
    clock.now = 1.0
    _submit(scheduler, 2, [10])
    clock.now = 100.0
    assert [item.request.request_id for item in scheduler.next_batch().items] == [1]


def test_models_take_turns_by_age():
    scheduler = _scheduler()
    scheduler.add_queue("other", QueuePolicy(1000, 32, lanes=100))
    _submit(scheduler, 1, [3], queue="other")
    _submit(scheduler, 2, [3], queue="m")
    assert scheduler.next_batch().queue == "other"
    assert scheduler.next_batch().queue == "m"


def test_finish_reports_a_request_when_all_its_inputs_are_done():
    scheduler = _scheduler(max_size=2)
    _submit(scheduler, 1, [3, 3, 3])
    assert scheduler.finish(scheduler.next_batch()) == []
    finished = scheduler.finish(scheduler.next_batch())
    assert [r.request_id for r in finished] == [1]


def test_cancel_drops_waiting_inputs():
    scheduler = _scheduler(max_size=2)
    _submit(scheduler, 1, [3, 3, 3, 3])
    running = scheduler.next_batch()
    assert scheduler.cancel(1) == (2, False)  # two dropped, two still running
    finished = scheduler.finish(running)
    assert [(r.request_id, r.cancelled) for r in finished] == [(1, True)]
    _submit(scheduler, 2, [1])
    assert [item.request.request_id for item in scheduler.next_batch().items] == [2]


def test_cancel_of_a_fully_waiting_request_finishes_it_at_once():
    scheduler = _scheduler()
    _submit(scheduler, 1, [3, 3])
    assert scheduler.cancel(1) == (2, True)
    assert scheduler.cancel(99) == (0, False)  # unknown: already finished


def test_a_failed_batch_fails_its_requests_and_drops_their_waiting_inputs():
    scheduler = _scheduler(max_size=1)
    _submit(scheduler, 1, [3, 3])
    _submit(scheduler, 2, [3])
    finished = scheduler.finish(scheduler.next_batch(), error="boom")
    assert [(r.request_id, r.error) for r in finished] == [(1, "boom")]
    assert [item.request.request_id for item in scheduler.next_batch().items] == [2]


def test_next_batch_blocks_until_work_arrives():
    scheduler = _scheduler()
    got = []
    thread = threading.Thread(target=lambda: got.append(scheduler.next_batch()))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not got  # nothing queued yet: still waiting
    _submit(scheduler, 1, [2])
    thread.join(5)
    assert got and got[0].items[0].request.request_id == 1


def _wait_in_threads(scheduler: Scheduler, count: int) -> tuple[list[threading.Thread], list]:
    """`count` lanes blocked in next_batch (nothing queued yet); their batches land in the list."""
    got = []
    threads = [threading.Thread(target=lambda: got.append(scheduler.next_batch())) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(0.2)
        assert thread.is_alive()
    return threads, got


def test_a_model_runs_no_more_batches_at_once_than_its_lanes():
    scheduler = _scheduler(lanes=1)
    _submit(scheduler, 1, [3])
    running = scheduler.next_batch()
    _submit(scheduler, 2, [3])
    (thread,), got = _wait_in_threads(scheduler, 1)  # the model's one lane is busy
    scheduler.finish(running)
    thread.join(5)
    assert [item.request.request_id for item in got[0].items] == [2]


def test_a_batch_is_shared_with_idle_lanes_interleaved_by_length():
    scheduler = _scheduler(lanes=2)
    threads, got = _wait_in_threads(scheduler, 2)
    _submit(scheduler, 1, [1, 5, 2, 4, 3])
    for thread in threads:
        thread.join(5)
    assert sorted(_padded(batch)["attention_mask"].sum(axis=1).tolist() for batch in got) == [[1, 3, 5], [2, 4]]
    assert sorted(_padded(batch)["input_ids"].shape[1] for batch in got) == [4, 5]  # each padded to its own longest


@pytest.mark.parametrize("cores_left, lengths, shares", [
    (2.0, [10, 10, 10, 10], [2, 2]),  # a core is left for the second part
    (1.2, [10, 10, 10, 10], [4]),  # one core left, and a part would hold less than a pass's fixed cost
    (1.2, [30, 30, 30, 30], [2, 2]),  # one left, but each part holds a fixed cost
])
def test_a_batch_of_several_requests_is_shared_where_a_core_is_left_for_each_part_or_each_part_holds_a_pass(
        cores_left, lengths, shares):
    scheduler = _scheduler(overhead=50, lanes=3, widens=True, cores_left=lambda: cores_left)
    threads, got = _wait_in_threads(scheduler, 3)
    _submit(scheduler, 1, [10])  # a lone input while every lane idles: a wide pass, which holds the others
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    (wide,) = got
    assert wide.wide
    for request_id, length in enumerate(lengths, start=2):  # a request each, queued behind the wide pass
        _submit(scheduler, request_id, [length])
    scheduler.finish(wide)
    for thread in threads:
        thread.join(0.3)
    assert sorted(len(batch.items) for batch in got[1:]) == shares
    _release(scheduler, threads, first_id=10)


@pytest.mark.parametrize("cores_left", [0.0, 2.0])
def test_a_request_alone_is_shared_with_every_idle_lane_whatever_the_cores_load(cores_left):
    scheduler = _scheduler(overhead=50, lanes=2, cores_left=lambda: cores_left)
    threads, got = _wait_in_threads(scheduler, 2)
    _submit(scheduler, 1, [10, 10, 10, 10])
    for thread in threads:
        thread.join(5)
    assert sorted(len(batch.items) for batch in got) == [2, 2]


def _release(scheduler: Scheduler, threads: list[threading.Thread], first_id: int) -> None:
    """Hand each lane still waiting a request of its own, and see them all end."""
    for request_id in range(first_id, first_id + sum(thread.is_alive() for thread in threads)):
        _submit(scheduler, request_id, [10])
        for thread in threads:
            thread.join(0.05)
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_a_batch_is_not_shared_beyond_the_models_lanes():
    scheduler = _scheduler(lanes=1)
    threads, got = _wait_in_threads(scheduler, 2)
    _submit(scheduler, 1, [1, 2, 3])
    for thread in threads:
        thread.join(0.5)
    assert [[item.cost for item in batch.items] for batch in got] == [[1, 2, 3]]
    _submit(scheduler, 2, [2])
    waiting = next(thread for thread in threads if thread.is_alive())
    waiting.join(0.2)
    assert waiting.is_alive()  # the model's one lane is busy
    scheduler.finish(got[0])
    waiting.join(5)
    assert [item.request.request_id for item in got[1].items] == [2]


def test_a_failed_share_fails_its_request_once_every_share_has_finished():
    scheduler = _scheduler(lanes=2)
    threads, got = _wait_in_threads(scheduler, 2)
    _submit(scheduler, 1, [1, 2, 3, 4])
    for thread in threads:
        thread.join(5)
    first, second = got
    assert scheduler.finish(first, error="boom") == []  # the other share still runs
    assert [(r.request_id, r.error) for r in scheduler.finish(second)] == [(1, "boom")]


def test_a_lone_input_runs_wide_while_every_other_lane_is_idle_and_holds_them():
    scheduler = _scheduler(lanes=2, widens=True)
    threads, got = _wait_in_threads(scheduler, 2)
    _submit(scheduler, 1, [3])
    for thread in threads:
        thread.join(0.3)
    (wide,) = got
    assert wide.wide
    _submit(scheduler, 2, [4])
    waiting = next(thread for thread in threads if thread.is_alive())
    waiting.join(0.2)
    assert waiting.is_alive()  # no lane takes work during a wide pass
    scheduler.finish(wide)
    waiting.join(5)
    assert [item.request.request_id for item in got[1].items] == [2]


@pytest.mark.parametrize("widens, busy_lanes", [(False, 0), (True, 1)])
def test_no_wide_pass_for_an_engine_that_cannot_or_while_another_lane_runs(widens, busy_lanes):
    scheduler = _scheduler(lanes=2, widens=widens)
    for request_id in range(busy_lanes):
        _submit(scheduler, request_id, [3])
        assert not scheduler.next_batch().wide  # no other lane is idle
    (thread,), got = _wait_in_threads(scheduler, 1)
    _submit(scheduler, 9, [3])
    thread.join(5)
    assert not got[0].wide


class _Engine:
    """Doubles each input's first id; fails on a batch holding the id 13."""

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        if (input_ids == 13).any():
            raise RuntimeError("bad batch")
        return torch.from_numpy(input_ids[:, :1].astype(np.float32) * 2)


class _RawHead:
    """Returns the engine's output as it is."""

    def __call__(self, raw, attention_mask):
        return raw.numpy()


def _model(engine):
    from workers.heads import LoadedModel

    return LoadedModel(engine, _RawHead(), "float32")


class _Arena:
    def __init__(self) -> None:
        self.rows = np.zeros((1000, 1), dtype=np.float32)


class _Channel:
    """Records what a lane sends, and how many sends it took."""

    def __init__(self) -> None:
        self.sent = []
        self.sends = 0

    def send(self, *messages) -> None:
        self.sent += messages
        self.sends += 1


def test_a_lane_writes_vectors_then_reports_done_or_the_failure():
    from functools import partial

    from infinity.shared import protocol
    from workers.inference.worker import _Queue, _run

    scheduler, channel = _scheduler(max_size=1), _Channel()
    queue = _Queue(_model(_Engine()), _Arena(), False, partial(collate_tokens, pad_id=0), False)
    scheduler.submit(1, "m", [10, 11], [1, 1], [TokenItem(np.array([7], np.int32)), TokenItem(np.array([13], np.int32))])
    for _ in range(2):  # 7 is written, then the batch of 13 fails and with it request 1
        _run(scheduler.next_batch(), queue, scheduler, channel)
    scheduler.submit(2, "m", [12], [1], [TokenItem(np.array([5], np.int32))])
    _run(scheduler.next_batch(), queue, scheduler, channel)
    arena = queue.arena
    answers = [message for message in channel.sent if not isinstance(message, protocol.BatchRan)]
    assert answers == [protocol.Failed(1, protocol.ErrorKind.INTERNAL, "inference failed: bad batch"), protocol.Done(2)]
    assert arena.rows[10, 0] == 14 and arena.rows[12, 0] == 10
    # The two batches that ran are reported for the metrics; the one that failed is not.
    ran = [message for message in channel.sent if isinstance(message, protocol.BatchRan)]
    assert [(message.model, message.inputs, message.tokens, len(message.waits)) for message in ran] == [("m", 1, 1, 1)] * 2
    assert channel.sends == 3  # a batch's report and answers leave in one send


class _CostedEngine:
    """Takes 2 ms + 20 us per token + 5 us per padding token (a padding token costs 0.25
    of a token), pass after pass."""

    pad_id, lanes, widens, express, name = 0, 1, False, False, "costed"

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        tokens = int(attention_mask.sum())
        time.sleep(2e-3 + 20e-6 * tokens + 5e-6 * (attention_mask.size - tokens))
        return torch.zeros((len(input_ids), 1))


def test_warm_up_fits_the_pass_overhead_and_the_cost_of_padding():
    from workers.inference.calibration import warm_up

    overhead, weight = warm_up(_model(_CostedEngine()), max_length=256)
    assert overhead == pytest.approx(100, abs=25)  # 2 ms / 20 us
    assert weight == pytest.approx(0.25, abs=0.1)


class _MidSizePaddingEngine(_CostedEngine):
    """Like CTranslate2 float32: padding costs 0.1 of a token in batches of up to 8 rows,
    0.5 in larger ones."""

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        tokens = int(attention_mask.sum())
        padding_weight = 0.1 if len(input_ids) <= 8 else 0.5
        time.sleep(2e-3 + 20e-6 * (tokens + padding_weight * (attention_mask.size - tokens)))
        return torch.zeros((len(input_ids), 1))


def test_warm_up_prices_padding_as_a_mid_size_batch_pays_it():
    from workers.inference.calibration import warm_up

    _, weight = warm_up(_model(_MidSizePaddingEngine()), max_length=256)
    assert weight == pytest.approx(0.5, abs=0.1)


class _CountedEngine(_CostedEngine):
    """A `_CostedEngine` that counts its passes by batch shape."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        self.shapes.append(input_ids.shape)
        return super().forward(input_ids, attention_mask, token_type_ids, wide, express)


def test_a_kept_cost_model_is_read_back_and_each_shape_runs_once_untimed(tmp_path):
    from workers.inference.calibration import warm_up

    record = tmp_path / "cost-model" / "m.json"
    first = _CountedEngine()
    fitted = warm_up(_model(first), max_length=256, record=record)
    assert record.exists()
    again = _CountedEngine()
    assert warm_up(_model(again), max_length=256, record=record) == fitted
    # The first pass at the model's length, then the three fitted shapes once each: what
    # the first requests would otherwise pay, and no timing repeats.
    assert again.shapes == [(1, 256), (1, 16), (4, 128), (16, 128)]
    assert len(first.shapes) > len(again.shapes)


def _express_in_thread(scheduler: Scheduler) -> tuple[threading.Thread, list]:
    got = []
    thread = threading.Thread(target=lambda: got.append(scheduler.next_express_batch()), daemon=True)
    thread.start()
    return thread, got


def _busy_lanes(scheduler: Scheduler, passes: list[int | list[int] | tuple[int, ...]]) -> list:
    """One pass per entry (an input's length, a request's inputs, or a tuple: requests of
    one input each), each on its own lane, cut one after another."""
    running = []
    for index, lengths in enumerate(passes):
        if isinstance(lengths, tuple):
            for offset, length in enumerate(lengths):
                _submit(scheduler, 100 + 20 * index + offset, [length])
        else:
            _submit(scheduler, 100 + 20 * index, lengths if isinstance(lengths, list) else [lengths])
        running.append(scheduler.next_batch())
    return running


def test_the_express_lane_takes_a_small_request_whole_while_every_lane_runs_a_long_pass():
    # Fixed cost 10 tokens: a pass of one 100-token input is long (8 x 10 or more) and a
    # request of two 8-token inputs (10 + 2 x 8 = 26) costs under a quarter of it.
    scheduler = _scheduler(overhead=10, lanes=2, express=True)
    thread, got = _express_in_thread(scheduler)
    _busy_lanes(scheduler, [100, 100])
    _submit(scheduler, 1, [8, 7])
    thread.join(5)
    (batch,) = got
    assert batch.express and [item.request.request_id for item in batch.items] == [1, 1]
    assert sorted(item.cost for item in batch.items) == [7, 8]
    assert [request.request_id for request in scheduler.finish(batch)] == [1]


def test_the_express_lane_takes_a_small_request_while_every_lane_runs_a_large_requests_inputs():
    # A pass of five 30-token inputs of one request (10 + 5 x 30 = 160) is a batch train:
    # a request costing under a quarter of it does not wait for the train to pass.
    scheduler = _scheduler(overhead=10, lanes=2, express=True)
    thread, got = _express_in_thread(scheduler)
    _busy_lanes(scheduler, [100, [30] * 5])
    _submit(scheduler, 1, [8, 7])
    thread.join(5)
    (batch,) = got
    assert batch.express and [item.request.request_id for item in batch.items] == [1, 1]


@pytest.mark.parametrize("running, lengths", [
    ([100], [8, 7]),  # a lane is free: the request is the lanes' to take
    ([100, 60], [8, 7]),  # one pass is short (10 + 60 < 8 x 10)
    ([100, (30,) * 5], [8, 7]),  # one is long by holding many small requests only
    ([100, 100], [30]),  # the request (10 + 30) costs over a quarter of a pass (110)
    ([100, 100], [5] * 6),  # six inputs: 10 + 6 x 5 = 40, over a quarter
])
def test_the_express_lane_leaves_what_a_lane_should_take(running, lengths):
    scheduler = _scheduler(overhead=10, lanes=2, express=True)
    thread, got = _express_in_thread(scheduler)
    _busy_lanes(scheduler, running)
    _submit(scheduler, 1, lengths)
    thread.join(0.3)
    assert thread.is_alive() and not got


class _CountingCondition(threading.Condition):
    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


@pytest.mark.parametrize("running, lengths, woken", [
    ([100, 100], [8, 7], 1),
    ([100, 100], [30], 0),  # a lane's to take: the express lane sleeps on
    ([100, 60], [8, 7], 0),
    ([60, 60], [8], 0),  # short passes: nothing for it, however many small requests arrive
])
def test_the_express_lane_is_woken_only_for_work_it_takes(running, lengths, woken):
    scheduler = _scheduler(overhead=10, lanes=2, express=True)
    scheduler._express_wakeup = wakeup = _CountingCondition(scheduler._lock)
    _busy_lanes(scheduler, running)
    _submit(scheduler, 1, lengths)
    assert wakeup.notified == woken


def test_the_express_lane_leaves_a_stream_of_small_requests_to_the_lanes():
    scheduler = _scheduler(overhead=10, lanes=2, express=True)
    _busy_lanes(scheduler, [100, 100])
    _submit(scheduler, 1, [8])
    _submit(scheduler, 2, [9])  # 18 + 19 together: over a quarter of a pass (110)
    thread, got = _express_in_thread(scheduler)
    thread.join(0.3)
    assert thread.is_alive() and not got


def test_a_model_without_an_express_lane_never_gives_it_work():
    scheduler = _scheduler(overhead=10, lanes=2)
    scheduler.add_queue("fast", QueuePolicy(1000, 32, 10, lanes=1, express=True))
    assert scheduler.express
    thread, got = _express_in_thread(scheduler)
    _busy_lanes(scheduler, [100, 100])
    _submit(scheduler, 1, [8])
    thread.join(0.3)
    assert thread.is_alive() and not got


def test_an_express_pass_ending_frees_no_lane_and_a_lane_ending_frees_one():
    scheduler = _scheduler(overhead=10, lanes=1, express=True)
    (long,) = _busy_lanes(scheduler, [100])
    _submit(scheduler, 1, [8])
    express = scheduler.next_express_batch()
    scheduler.finish(express)
    _submit(scheduler, 2, [50])
    (thread,), got = _wait_in_threads(scheduler, 1)  # the one lane still runs the long pass
    scheduler.finish(long)
    thread.join(5)
    assert [item.request.request_id for item in got[0].items] == [2]


def _submit_here(scheduler: Scheduler, request_id: int, lengths: list[int], here: bool = True) -> Batch | None:
    """`_submit`, the caller offering to run the pass itself (`here`: what its check answers)."""
    slots = [request_id * 100 + i for i in range(len(lengths))]
    items = [TokenItem(np.full(n, slot + 1, dtype=np.int32)) for slot, n in zip(slots, lengths)]
    return scheduler.submit(request_id, "m", slots, lengths, items, run_here=lambda: here)


@pytest.mark.parametrize(("lanes", "widens", "wide"), [(2, True, True), (1, False, False)])
def test_a_lone_input_among_idle_lanes_is_run_by_the_caller(lanes, widens, wide):
    """Its batch comes back to the receiving thread, as a lane would have cut it, and no
    lane is woken: the lanes take the next work once the pass is finished."""
    scheduler = _scheduler(lanes=lanes, widens=widens)
    threads, got = _wait_in_threads(scheduler, lanes)
    batch = _submit_here(scheduler, 1, [5])
    assert batch is not None and [item.slot for item in batch.items] == [100] and batch.wide == wide
    for thread in threads:
        thread.join(0.2)
        assert thread.is_alive() and not got
    scheduler.finish(batch)
    _submit(scheduler, 2, [5])
    threads[0].join(0.2)
    assert [[item.request.request_id for item in lane.items] for lane in got] == [[2]]
    scheduler.finish(got[0])
    _submit(scheduler, 3, [5])  # for the other lane, where there is one
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


@pytest.mark.parametrize("case", ["two inputs", "a lane busy", "input waiting", "message behind", "lanes that share"])
def test_a_lone_input_otherwise_goes_to_the_lanes(case):
    scheduler = _scheduler(lanes=2, widens=case != "lanes that share")
    if case == "a lane busy":
        _submit(scheduler, 9, [3])
        scheduler.next_batch()
    threads, got = _wait_in_threads(scheduler, 1 if case == "a lane busy" else 2)
    if case == "input waiting":
        scheduler._wide = True  # a wide pass holds the lanes: what is submitted waits
        _submit(scheduler, 8, [3])
        scheduler._wide = False
    lengths = [5, 6] if case == "two inputs" else [5]
    assert _submit_here(scheduler, 1, lengths, here=case != "message behind") is None
    if case == "input waiting":
        with scheduler._wakeup:
            scheduler._wakeup.notify_all()
    deadline = time.monotonic() + 5
    while not any(item.request.request_id == 1 for batch in list(got) for item in batch.items):
        assert time.monotonic() < deadline, "no lane took the input"
        time.sleep(0.01)
    for batch in list(got):  # a wide pass holds the other lane until it is finished
        scheduler.finish(batch)
    for _ in threads:
        _submit(scheduler, 7, [4])
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
