"""The scheduler's priorities and fairness: a more urgent request goes first and cuts its
batch without less urgent inputs, aging lifts a waiting request's class, requests of
one class share the passes (a short request does not wait for a large one's batch train),
and an urgent batch takes the express lane while every lane runs less urgent work."""

import threading

import numpy as np
import pytest

from workers.inference import scheduler
from workers.inference.scheduler import AGING_S, QueuePolicy, Scheduler
from workers.preprocess.text import TokenItem


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(max_size: int = 32, lanes: int = 100, express: bool = False) -> tuple[Scheduler, _Clock]:
    """A scheduler on a still clock whose pass overhead is so high that only the count cap
    and the budget (1000 padded tokens) split batches."""
    clock = _Clock()
    scheduler = Scheduler(clock)
    scheduler.add_queue("m", QueuePolicy(1000, max_size, 1e6, lanes=lanes, express=express))
    return scheduler, clock


def _submit(scheduler: Scheduler, request_id: int, lengths: list[int], priority: int = 0) -> None:
    slots = [request_id * 100 + i for i in range(len(lengths))]
    items = [TokenItem(np.full(n, 1, dtype=np.int32)) for n in lengths]
    scheduler.submit(request_id, "m", slots, lengths, items, priority)


def _requests(batch) -> list[int]:
    return sorted({item.request.request_id for item in batch.items})


def test_a_more_urgent_request_goes_first_and_alone():
    scheduler, _ = _scheduler()
    _submit(scheduler, 1, [10] * 8, priority=1)
    _submit(scheduler, 2, [10], priority=0)
    urgent = scheduler.next_batch()
    # Bulk inputs of the same length would fit its budget: they do not ride along.
    assert _requests(urgent) == [2] and urgent.priority == 0
    bulk = scheduler.next_batch()
    assert _requests(bulk) == [1] and len(bulk.items) == 8 and bulk.priority == 1


def test_a_less_urgent_batch_takes_urgent_inputs_along():
    scheduler, clock = _scheduler()
    _submit(scheduler, 1, [10] * 4, priority=1)
    clock.now = AGING_S + 0.1  # request 1 has aged into class 0, and arrived first
    _submit(scheduler, 2, [10], priority=0)
    batch = scheduler.next_batch()
    assert _requests(batch) == [1, 2] and batch.priority == 1


def test_aging_lifts_a_waiting_request_by_one_class_per_period():
    scheduler, clock = _scheduler(max_size=1)
    _submit(scheduler, 1, [10], priority=2)
    clock.now = 1.5 * AGING_S  # request 1 is now of class 1
    _submit(scheduler, 2, [10], priority=0)
    _submit(scheduler, 3, [10], priority=1)
    # Request 1 ties with request 3 in class 1, behind request 2, and came first.
    assert [_requests(scheduler.next_batch()) for _ in range(3)] == [[2], [1], [3]]
    _submit(scheduler, 4, [10], priority=2)
    clock.now += 2 * AGING_S + 0.1  # request 4 has risen to class 0
    _submit(scheduler, 5, [10], priority=1)
    assert [_requests(scheduler.next_batch()) for _ in range(2)] == [[4], [5]]


def test_aging_lifts_a_request_to_the_most_urgent_priority_waiting_and_no_further():
    """Bulk requests that have all waited long take turns with a query that has just
    arrived: the query is in the next batches, not behind every aged bulk input (a deep
    bulk queue); with nothing more urgent waiting, they are served to the end."""
    scheduler, clock = _scheduler(max_size=4)
    for request_id in (1, 2, 3):
        _submit(scheduler, request_id, [50] * 8, priority=1)
    clock.now = 3 * AGING_S + 0.1  # each could have risen three classes, to -2
    _submit(scheduler, 4, [5], priority=0)
    batches = [scheduler.next_batch() for _ in range(7)]
    assert [4] in [_requests(batch) for batch in batches[:2]]  # before: behind all 24 bulk inputs
    assert sum(len(batch.items) for batch in batches) == 3 * 8 + 1


def test_a_short_request_joins_the_next_batch_instead_of_waiting_for_a_batch_train():
    scheduler, _ = _scheduler(max_size=4)
    _submit(scheduler, 1, [10] * 32)  # eight batches' worth
    assert _requests(scheduler.next_batch()) == [1]
    _submit(scheduler, 2, [10])  # at the same priority
    assert 2 in _requests(scheduler.next_batch())


def test_a_small_requests_batch_holds_no_inputs_of_a_far_larger_request():
    clock = _Clock()
    scheduler = Scheduler(clock)
    scheduler.add_queue("m", QueuePolicy(1000, 32, 20, lanes=100))  # a pass's fixed cost: 20 tokens
    _submit(scheduler, 1, [10] * 64)  # as one pass: 20 + 640
    assert len(scheduler.next_batch().items) == 32
    _submit(scheduler, 2, [10])  # 30: under a quarter of request 1
    _submit(scheduler, 3, [10, 10])  # 40: alike, it may join
    assert _requests(scheduler.next_batch()) == [2, 3]
    assert _requests(scheduler.next_batch()) == [1]


def test_a_short_input_of_a_large_request_does_not_overtake_as_a_small_request_would():
    clock = _Clock()
    scheduler = Scheduler(clock)
    scheduler.add_queue("m", QueuePolicy(1000, 1, 30, lanes=100))  # one input per batch
    _submit(scheduler, 1, [256])  # one long input: 286 as a pass
    clock.now = 0.5
    _submit(scheduler, 2, [10] * 8)  # each input 40 alone, the request 110: over a quarter of 286
    _submit(scheduler, 3, [10])  # 40: a small request
    clock.now = 1.0  # per cost, requests 2 and 3 have waited longer than request 1
    assert _requests(scheduler.next_batch()) == [3]
    assert _requests(scheduler.next_batch()) == [1]


def test_requests_of_one_class_take_turns():
    scheduler, _ = _scheduler(max_size=2)
    _submit(scheduler, 1, [10] * 6)
    _submit(scheduler, 2, [10] * 6)
    firsts = [item.request.request_id for _ in range(6) for item in scheduler.next_batch().items]
    # In every stretch of four inputs served, each request has two.
    for start in range(0, 12, 4):
        assert sorted(firsts[start:start + 4]) == [1, 1, 2, 2]


def test_less_urgent_work_is_served_when_nothing_urgent_waits():
    scheduler, _ = _scheduler(max_size=4)
    _submit(scheduler, 1, [10] * 4, priority=5)
    assert _requests(scheduler.next_batch()) == [1]


def test_an_urgent_batch_takes_the_express_lane_while_every_lane_runs_less_urgent_work():
    scheduler, _ = _scheduler(max_size=4, lanes=1, express=True)
    _submit(scheduler, 1, [10] * 8, priority=1)
    running = scheduler.next_batch()  # the one lane runs bulk
    _submit(scheduler, 2, [10], priority=0)
    express = scheduler.next_express_batch()
    assert express.express and _requests(express) == [2]
    scheduler.finish(express)
    scheduler.finish(running)
    assert _requests(scheduler.next_batch()) == [1]


def test_no_express_pass_for_work_as_urgent_as_the_lanes():
    scheduler, _ = _scheduler(max_size=4, lanes=1, express=True)
    _submit(scheduler, 1, [10] * 8, priority=1)
    scheduler.next_batch()
    _submit(scheduler, 2, [10], priority=1)
    got = []
    thread = threading.Thread(target=lambda: got.append(scheduler.next_express_batch()), daemon=True)
    thread.start()
    thread.join(0.2)
    assert not got  # still waiting


def test_cancelling_a_request_forgets_its_priority():
    scheduler, _ = _scheduler()
    _submit(scheduler, 1, [10] * 4, priority=0)
    _submit(scheduler, 2, [10] * 4, priority=3)
    scheduler.cancel(1)
    batch = scheduler.next_batch()
    assert _requests(batch) == [2] and len(batch.items) == 4


# --- the front end: where a request's priority comes from, and admission by class -------

def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _count(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_request_runs_at_its_bodys_priority_else_its_keys():
    import asyncio

    from infinity.config import ApiKey
    from tests.fast.inprocess import serving

    async def test():
        keys = [ApiKey("ingest", priority=1)]
        async with serving(api_key="queries", api_keys=keys) as client:
            def post(key: str, **body):
                return client.post("/v1/embeddings", json={"input": ["a"], **body},
                                   headers={"Authorization": f"Bearer {key}"})

            assert (await post("queries")).status == 200
            assert (await post("ingest")).status == 200
            assert (await post("ingest", priority=-2)).status == 200
            assert (await post("other")).status == 401
            refused = await post("queries", priority=101)
            assert refused.status == 422 and "priority" in (await refused.json())["error"]["message"]
            samples = _samples(await (await client.get("/metrics")).text())
            for priority in ("0", "1", "-2"):
                assert _count(samples, "infinity_requests_total", route="/v1/embeddings", model="m",
                              priority=priority, status="200") == 1
                assert _count(samples, "infinity_queue_duration_seconds_count", model="m", priority=priority) == 1

    asyncio.run(test())


def test_less_urgent_requests_get_429_beyond_their_share_and_urgent_ones_still_get_in():
    import asyncio

    from tests.fast.inprocess import ThreadLauncher, serving

    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher, max_queued_items=8, max_queued_items_low_priority=4) as client:
            launcher.gate.clear()  # the fake engine holds every pass
            held = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["b"] * 4, "priority": 1}))
            await asyncio.sleep(0.2)
            samples = _samples(await (await client.get("/metrics")).text())
            assert _count(samples, "infinity_queue_slots_in_use_by_priority", model="m", priority="1") == 4
            refused = await client.post("/v1/embeddings", json={"input": ["c"], "priority": 2})
            assert refused.status == 429 and "priority above 0" in (await refused.json())["error"]["message"]
            urgent = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["q"] * 4}))
            await asyncio.sleep(0.2)
            launcher.gate.set()
            assert (await held).status == 200 and (await urgent).status == 200
            samples = _samples(await (await client.get("/metrics")).text())
            assert _count(samples, "infinity_queue_slots_in_use_by_priority", model="m", priority="1") == 0

    asyncio.run(test())


def test_a_lane_lowers_its_own_threads_cpu_priority_and_no_other():
    import os

    from infinity.shared.channel import ChannelClosed
    from workers.inference.worker import _serve

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []

    def take():
        seen.append(nice())
        raise ChannelClosed

    before = nice()
    lane = threading.Thread(target=_serve, args=({}, Scheduler(), None, take, 3))
    lane.start()
    lane.join(5)
    assert seen == [min(before + 3, 19)]
    assert nice() == before


def test_threads_a_runtime_starts_while_built_for_the_lanes_get_their_nice_value_and_the_caller_keeps_its():
    import os

    from workers.engines.lanes import LANE_NICENESS, built_at_lane_niceness

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []

    def build() -> str:  # a runtime starting its worker while it is built
        worker = threading.Thread(target=lambda: seen.append(nice()))
        worker.start()
        worker.join(5)
        return "runtime"

    before = nice()
    assert built_at_lane_niceness(build) == "runtime"
    assert seen == [min(before + LANE_NICENESS, 19)]
    assert nice() == before

    def fail() -> None:
        raise ValueError("no such graph")

    with pytest.raises(ValueError, match="no such graph"):
        built_at_lane_niceness(fail)


def _reference_cut(queue, now: float) -> list:
    """The batch `queue` cuts next, found the plain way: every waiting input looked at for
    the anchor and for the riders (what `scheduler._cut` finds from the requests)."""
    entries = queue.by_cost
    ceiling = min(entry[2].request.priority for entry in entries)
    urgency = {entry[2].request: entry[2].request.urgency(now, ceiling) for entry in entries}
    most_urgent = min(urgency.values())
    eligible = [entry[2] for entry in entries if urgency[entry[2].request] == most_urgent]
    first = min(eligible, key=lambda item: (item.tag, item.seq))
    first_cost = queue.pass_overhead_tokens + first.cost
    cheap = [item for item in eligible if item.request.cost <= first_cost / scheduler.OVERTAKE_FACTOR]
    anchor = first
    if cheap:
        candidate = min(cheap, key=lambda item: (item.tag, item.seq))
        if (now - candidate.arrived) / candidate.request.cost > (now - first.arrived) / first_cost:
            anchor = candidate
    riders = [entry for entry in entries if scheduler._rides_with(entry[2].request, anchor.request)]
    index = next(i for i, entry in enumerate(riders) if entry[2] is anchor)
    lo, hi = scheduler._window(riders, index, queue.max_batch_tokens, queue.max_batch_size)
    groups = scheduler.split_by_cost([entry[0] for entry in riders[lo:hi + 1]], queue.pass_overhead_tokens,
                                     queue.padding_weight)
    first_index, last_index = scheduler._group_of(index - lo, groups)
    return [entry[2] for entry in riders[lo + first_index:lo + last_index + 1]]


@pytest.mark.parametrize("seed", range(12))
def test_cuts_are_those_of_the_plain_search(seed):
    """Mixed priorities, sizes and ages, cancellations: each batch is the one the plain
    search over every waiting input would cut."""
    rng = np.random.default_rng(seed)
    clock = _Clock()
    sched = Scheduler(clock)
    sched.add_queue("m", QueuePolicy(int(rng.choice([256, 2048])), int(rng.choice([4, 32])),
                                     float(rng.choice([2.0, 19.0, 200.0])), lanes=1000))
    queue = sched._queues["m"]
    submitted = 0
    for _ in range(120):
        for _ in range(int(rng.integers(0, 4))):
            size = int(rng.choice([1, 2, 8, 32]))
            _submit(sched, submitted, [int(n) for n in rng.integers(3, 250, size)], int(rng.integers(0, 3)))
            submitted += 1
        if submitted and rng.random() < 0.1:
            sched.cancel(int(rng.integers(0, submitted)))
        clock.now += float(rng.choice([0.0, 0.01, 2.0]))
        if queue.by_cost:
            expected = _reference_cut(queue, clock.now)
            assert sched.next_batch().items == expected
        assert sorted(entry[1] for entry in queue.by_cost) == sorted(
            item.seq for waiting in queue.waiting_requests.values() for item in waiting.remaining())
