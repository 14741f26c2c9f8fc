"""Dynamic batching for the inference process: a queue of inputs per model and medium
(a model's texts; a two-tower model's images or clips beside them), cut into batches by
a budget of cost (a text's tokens, an image's patches) and a count cap. The scheduler
sees what each input costs and never what it is: a lane collates a batch's payloads for
the engine (workers/inference/worker.py).

A batch is cut around an anchor input of the model that has waited longest: the oldest
waiting input, unless an input that costs far less (`OVERTAKE_FACTOR`) has waited
longer for its cost (the highest response ratio, waited time over cost, wins), so a
short request does not queue behind long inputs and a long one still runs once it has
waited in proportion; nothing starves. The batch holds the anchor plus inputs close to
it in length, within `max_batch_tokens` (counted padded: inputs × longest input; never
more than `PASS_OVERHEADS` times a pass's fixed cost) and `max_batch_size`. Where
lengths differ widely, the candidates are split into groups by a cost model (a fixed cost
per forward pass, one unit per token, and a fraction of one per padding token, both
measured at warm-up), and only the anchor's group runs now; the others
wait for the next pass, where later arrivals may join them. There is no waiting window: a
batch is cut as soon as a lane is free, from whatever has arrived. Inputs of a
cancelled request are dropped before they reach a batch.

An engine may run several forward passes at once, each on its own core (its `lanes`);
the inference process then has one thread per lane, each cutting its own batch the moment
it is free, so one lane's padding, result writing and messaging overlap the others'
compute. When a lane cuts a batch while other lanes of the model wait idle, the batch is
shared with them: rows i, i + k, i + 2k, ... of the length-sorted batch go to lane i, so
the parts take about as long and a lone large request still uses every core. Each part
beyond the first is a pass more, with its fixed cost: in a batch of several requests'
inputs it is cut only where a core is left for it (`cores_left`: the CPUs other processes
left this one of late) or where it holds at least a pass's fixed cost in tokens; under a
stream of small requests that keeps the cores busy a small batch stays whole rather than
spend a second pass's overhead on a core that has other work. One request's inputs are
shared with every idle lane, for its latency. A batch of
one input cut while every other lane waits idle runs as a wide pass, on every core, if the
model's engine can (`widens`); the other lanes take no work until it ends. Such a pass (or
one for a model of a single lane) for a lone input that arrives while every lane idles
and nothing else waits is run by the thread that received the input (`submit`'s
`run_here`), which saves waking a lane for it.

An engine may also run one pass beyond its lanes (`express`): the express lane, for a
small request while every lane of its model runs a pass made long by a long input, or a
pass of a far larger request's inputs (a batch train). Without it a request of one or two
sentences arriving behind long inputs (one input of 256 tokens keeps a lane for tens of
ms) or behind a bulk request waits for a lane to end before its own short pass starts.
The express lane takes one request at a time, and only when each running pass costs
`OVERTAKE_FACTOR` times the request's own pass or more by its longest input (which alone
makes a long pass, at least `LONG_PASS_OVERHEADS` fixed costs) or by its smallest request
(as one pass), and when the small requests waiting together cost no more than that. A
pass long only by holding many small requests, or many small requests waiting, are a
stream of small work that the lanes batch better than one request at a time; so under
loads of small requests it stays idle.

Requests carry a priority (lower is served first, as in vLLM). A batch is cut around an
input of the most urgent class waiting. A request's class rises by one every `AGING_S`
seconds it waits, up to the most urgent priority waiting: there it takes turns with those
requests, so nothing starves, and a deep queue of bulk requests that have all waited long
never outranks a query that has just arrived. Within a class the order is fair between requests
rather than first come, first served over inputs: each input gets a virtual start
(`Item.tag`) in tokens' worth of work, a request's first input starting at the queue's
virtual time (the tag of the last batch's anchor) and each next input after the cost of
the ones before it, as in start-time fair queueing. A short request arriving behind a
large one's batch train is thus next in turn; the large one's inputs keep their turns.
A batch holds no input of a less urgent priority than its anchor's, nor of a request far
larger (`_rides_with`), so a query's pass stays as short as its own inputs make it. Where
every lane runs a pass of a less urgent priority, an urgent batch runs at once on the
express lane (if the engine has one) instead of waiting for a lane.

The scheduler is shared by the thread that receives requests and the lanes; one lock
guards it.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False, slots=True)
class PendingRequest:
    request_id: int
    queue: str
    remaining: int
    cost: float = 0.0  # its inputs as one pass: fixed cost + padded tokens
    priority: int = 0  # lower is served first
    arrived: float = 0.0  # the scheduler's clock when it was queued
    seq: int = 0  # its first input's arrival order
    cancelled: bool = False
    error: str | None = None  # why it failed; it is reported once none of its inputs runs
    trace: str | None = None  # its traceparent, where it is traced
    ran: bool = False  # an input of it has been cut into a batch (its queue wait is over)
    # The outputs of a model whose outputs vary in size, by slot, until all are computed (a
    # hybrid model's: the arrays of the types asked, by type).
    outputs: dict[int, np.ndarray | dict[str, np.ndarray]] = field(default_factory=dict)
    vector_types: tuple[str, ...] = ()  # the outputs it asks of a hybrid model (`KindSpec.vector_types`)

    def urgency(self, now: float, ceiling: int) -> int:
        """Its class now: its priority, raised by one per `AGING_S` waited, up to `ceiling`
        (the most urgent priority waiting): there it takes turns with those requests in the
        fair order, so it never starves, nor overtakes a request more urgent than itself."""
        return max(self.priority - int((now - self.arrived) / AGING_S), ceiling)


@dataclass(eq=False, slots=True)
class Item:
    """One input of a request: what it costs a pass (a text's tokens, an image's patches,
    a clip's frames, a page's tokens), the arena slot its output goes to, and its payload,
    which the scheduler never reads (the lane collates a batch's payloads for the engine)."""

    request: PendingRequest
    slot: int
    cost: int
    payload: object
    seq: int  # arrival order, for fairness
    arrived: float  # the scheduler's clock when it was queued
    tag: float = 0.0  # its virtual start: its place in the fair order between requests
    waiting: bool = True  # in its queue still (not cut into a batch, not dropped)


@dataclass
class Batch:
    queue: str
    items: list[Item]
    wide: bool = False  # run on every core: the other lanes are held idle for it
    express: bool = False  # run on the express lane, beside the queue's lanes
    running: RunningPass | None = None  # its record among its queue's passes (not for the express lane)

    @property
    def priority(self) -> int:
        """Its least urgent input's."""
        return _least_urgent(self.items)


@dataclass(frozen=True)
class QueuePolicy:
    """How one queue's batches are cut and run."""

    max_batch_tokens: int  # padded cost of a batch at most (inputs x the costliest)
    max_batch_size: int
    # The fixed cost of one forward pass, in tokens' worth of compute, and what a padding
    # token costs against a token: they decide when inputs of different costs share a
    # padded batch (measured at warm-up: workers/inference/calibration.py).
    pass_overhead_tokens: float = 0.0
    padding_weight: float = 1.0
    lanes: int = 1  # how many of its batches may run at once
    widens: bool = False  # its engine can run one pass on every core, for a lone input
    express: bool = False  # its engine can run one more pass beside its lanes


@dataclass(eq=False)
class RunningPass:
    """What the express lane needs to know of a pass running on a lane."""

    longest: float  # its longest input alone, as `_longest_cost`
    smallest_request: float  # the cost of its smallest request (`PendingRequest.cost`)
    priority: int  # its least urgent input's

    @classmethod
    def of(cls, queue: _Queue, items: list[Item]) -> RunningPass:
        return cls(_longest_cost(queue, items), min(item.request.cost for item in items), _least_urgent(items))


@dataclass
class _Queue:
    max_batch_tokens: int
    max_batch_size: int
    pass_overhead_tokens: float
    padding_weight: float
    lanes: int
    widens: bool
    express: bool
    passes: list[RunningPass] = field(default_factory=list)  # batches cut for its lanes and not yet finished
    # Waiting items (cost, seq, item) sorted by `_sort_key`: a batch is a run of them.
    by_cost: list[tuple[int, int, Item]] = field(default_factory=list)
    # The requests with inputs in `by_cost`, and those inputs: far fewer requests than
    # inputs, so what holds for every waiting input (its class, whether it may ride along,
    # the first in the fair order) is found from them.
    waiting_requests: dict[PendingRequest, _Waiting] = field(default_factory=dict)
    virtual: float = 0.0  # the virtual time: the tag of the last batch's anchor

    def add(self, items: list[Item]) -> None:
        """Queue a request's inputs (in the request's order)."""
        for item in items:
            bisect.insort(self.by_cost, _entry(item), key=_sort_key)
        self.waiting_requests[items[0].request] = _Waiting(items, len(items))

    def remove(self, items: list[Item]) -> None:
        """Take `items` out of the waiting ones: each found by bisection."""
        for item in items:
            del self.by_cost[_index_of(self.by_cost, item)]
        self.forget(items)

    def forget(self, items: list[Item]) -> None:
        """Count `items` out of `waiting_requests` (they have left `by_cost`)."""
        waiting = self.waiting_requests
        for item in items:
            item.waiting = False
            inputs = waiting[item.request]
            inputs.count -= 1
            if not inputs.count:
                del waiting[item.request]


@dataclass(slots=True)
class _Waiting:
    """One request's inputs in a queue, in the request's order, which is their fair order
    (each input's virtual start is after the one before it); those cut or dropped stay
    in the list, marked, until the request leaves the queue."""

    items: list[Item]
    count: int  # how many still wait
    head: int = 0  # no input before this index waits

    def first(self) -> Item:
        """The waiting input first in the fair order."""
        while not self.items[self.head].waiting:
            self.head += 1
        return self.items[self.head]

    def remaining(self) -> list[Item]:
        return [item for item in self.items[self.head:] if item.waiting]


# A pass holds at most this many times its fixed cost in padded tokens (or one input
# alone): a larger one saves under 1/16 of its time but makes whatever arrives wait for
# all of it, so a short request beside long ones would queue behind two or more of them.
PASS_OVERHEADS = 16

# An input overtakes the oldest only if the oldest costs this many times as much: among
# inputs of similar cost the order stays first come, first served, which keeps the tail
# of uniform loads where it is.
OVERTAKE_FACTOR = 4.0

# The express lane serves a model only while each of its running passes holds an input
# that alone costs this many times a pass's fixed cost: behind shorter inputs a small
# request waits little.
LONG_PASS_OVERHEADS = 8

# A request's class rises by one per this many seconds waited: a bulk request at priority 1
# takes turns with queries after this long at most, however many queries arrive. Longer
# than a bulk batch's ordinary wait, so that aging does not undo priority under load.
AGING_S = 5.0


class Scheduler:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cores_left: Callable[[], float] | None = None) -> None:
        """`cores_left`: how many CPUs other processes left this one of late
        (`workers.inference.cores_left`); None: as many as there are lanes, so every idle
        lane takes a share."""
        self._clock = clock
        self._cores_left = cores_left
        self._queues: dict[str, _Queue] = {}
        self._requests: dict[int, PendingRequest] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._express_wakeup = threading.Condition(self._lock)
        self._idle = 0  # lanes waiting in `next_batch`
        self._wide = False  # a wide pass runs: no lane takes work
        self._shares: deque[Batch] = deque()  # parts of a batch cut for idle lanes

    def add_queue(self, name: str, policy: QueuePolicy) -> None:
        budget = min(policy.max_batch_tokens, max(int(PASS_OVERHEADS * policy.pass_overhead_tokens), 1))
        self._queues[name] = _Queue(budget, policy.max_batch_size, policy.pass_overhead_tokens,
                                    policy.padding_weight, policy.lanes, policy.widens, policy.express)

    @property
    def lanes(self) -> int:
        """How many threads should call `next_batch`: the most lanes of any model."""
        return max((queue.lanes for queue in self._queues.values()), default=1)

    @property
    def express(self) -> bool:
        """Whether a thread should call `next_express_batch`: a model has an express lane."""
        return any(queue.express for queue in self._queues.values())

    def submit(self, request_id: int, queue: str, slots: list[int], costs: list[int], payloads: list,
               priority: int = 0, trace: str | None = None, vector_types: tuple[str, ...] = (),
               run_here: Callable[[], bool] | None = None) -> Batch | None:
        """Queue a request's inputs on `queue`: each its arena slot, its cost and its payload;
        `priority`: lower is served first; `trace`: its traceparent, where it is traced;
        `vector_types`: what it asks of a hybrid model.

        `run_here`, where given: the caller may run the request's pass itself. It is handed
        the batch (and no lane is woken) when the request is one input, nothing else waits,
        every lane idles, the pass is one no other could run beside (a wide pass, or the
        queue's only lane), and `run_here()`, asked last, agrees: a lone query then skips
        the hand-off to a lane, a thread woken from sleep (a fifth of a millisecond and
        more on a VM)."""
        arrived = self._clock()
        with self._lock:
            waiting = self._queues[queue]
            lone = (run_here is not None and len(slots) == 1 and self._idle == self.lanes and not self._shares
                    and not self._wide and not any(other.by_cost for other in self._queues.values())
                    and (waiting.widens or waiting.lanes == 1) and run_here())
            request = PendingRequest(request_id, queue, len(slots), waiting.pass_overhead_tokens
                                     + len(costs) * max(costs), priority, arrived, trace=trace,
                                     vector_types=vector_types)
            self._requests[request_id] = request
            # Each input starts where the ones before it in the request end.
            tags = itertools.accumulate(costs[:-1], initial=waiting.virtual)
            items = [Item(request, slot, cost, payload, next(self._seq), arrived, tag)
                     for slot, cost, payload, tag in zip(slots, costs, payloads, tags, strict=True)]
            waiting.add(items)
            request.seq = items[0].seq
            if lone:
                # Cut as the lanes' own would be, the caller in the place of one of them.
                return self._cut_for(queue, self.lanes - 1)
            self._wakeup.notify()
            self._notify_express(waiting)
            return None

    def cancel(self, request_id: int) -> tuple[int, bool]:
        """Drop the waiting inputs of a request; return how many were dropped and whether
        the request is thereby finished (nothing of it is running).

        The front end sends Cancel on the socket that carried the request, so an unknown
        id is one that has already finished.
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return 0, False
            request.cancelled = True
            dropped = self._drop_waiting(request)
            if request.remaining == 0:
                del self._requests[request_id]
                return dropped, True
            return dropped, False

    def next_batch(self) -> Batch:
        """Block until inputs wait for a free lane, then cut a batch."""
        with self._lock:
            return self._take()

    def next_express_batch(self) -> Batch:
        """Block until urgent work waits while every lane of an express model runs a pass
        of a less urgent priority (then cut its batch), or a small request waits behind
        long passes on every lane (then take its inputs, all of them, as one batch)."""
        with self._lock:
            while (model := self._urgent_model()) is None and (found := self._express_request()) is None:
                self._express_wakeup.wait()
            if model is not None:
                return Batch(model, _cut(self._queues[model], self._clock()), express=True)
            model, request = found
            queue = self._queues[model]
            items = queue.waiting_requests[request].remaining()
            queue.remove(items)
        return Batch(model, items, express=True)

    def _urgent_model(self) -> str | None:
        """The express model whose lanes all run passes less urgent than an input waiting
        (the most urgent such input of all models); lock held."""
        if self._wide:
            return None
        best, best_priority = None, None
        for name, queue in self._queues.items():
            if queue.express and queue.by_cost and len(queue.passes) >= queue.lanes:
                priority = min(request.priority for request in queue.waiting_requests)
                if (priority < min(running.priority for running in queue.passes)
                        and (best_priority is None or priority < best_priority)):
                    best, best_priority = name, priority
        return best

    def _express_request(self) -> tuple[str, PendingRequest] | None:
        """(model, request) the express lane should run now, the oldest eligible; lock held."""
        if self._wide:
            return None
        best, best_seq = None, None
        for name, queue in self._queues.items():
            if not (queue.express and queue.by_cost and len(queue.passes) >= queue.lanes):
                continue
            # Every lane's pass is long by a long input, or holds only requests far larger.
            shortest = min(running.longest for running in queue.passes)
            if shortest < LONG_PASS_OVERHEADS * queue.pass_overhead_tokens:
                shortest = 0.0
            most = max(shortest, min(running.smallest_request for running in queue.passes)) / OVERTAKE_FACTOR
            small: dict[PendingRequest, int] = {}  # the small requests waiting, by their first input
            # Sorted by length, and no request costs less than one of its inputs alone.
            for length, seq, item in queue.by_cost:
                if queue.pass_overhead_tokens + length > most:
                    break
                if item.request.cost <= most:
                    small[item.request] = min(seq, small.get(item.request, seq))
            # More small work than that is a stream of small requests: the lanes batch them.
            if sum(request.cost for request in small) > most:
                continue
            for request, seq in small.items():
                if request.cost <= most and (best_seq is None or seq < best_seq):
                    best, best_seq = (name, request), seq
        return best

    def _take(self) -> Batch:
        """The calling lane's next batch; lock held."""
        while not self._shares and (model := self._model_to_serve()) is None:
            self._idle += 1
            self._wakeup.wait()
            self._idle -= 1
        if self._shares:
            return self._shares.popleft()
        return self._cut_for(model, self._idle - len(self._shares))

    def _cut_for(self, model: str, idle: int) -> Batch:
        """The calling lane's batch of `model`'s queue, shared with the `idle` other lanes
        (waiting and not yet handed a share) or run wide; lock held."""
        queue = self._queues[model]
        items = _cut(queue, self._clock())
        if len(items) == 1 and queue.widens and idle == self.lanes - 1:
            self._wide = True
            running = RunningPass.of(queue, items)
            queue.passes.append(running)
            return Batch(model, items, wide=True, running=running)
        parts = 1 + max(0, min(idle, queue.lanes - len(queue.passes) - 1, len(items) - 1))
        if parts > 1 and self._cores_left is not None and _of_several_requests(items):
            parts = min(parts, max(round(self._cores_left()), _parts_holding_a_pass(queue, items)))
        batches = [Batch(model, items[i::parts], running=RunningPass.of(queue, items[i::parts]))
                   for i in range(parts)]
        queue.passes.extend(batch.running for batch in batches)
        self._shares.extend(batches[1:])
        self._wakeup.notify(parts - 1)
        self._notify_express(queue)  # every lane may now be busy with a long pass
        return batches[0]

    def _notify_express(self, queue: _Queue) -> None:
        """Wake the express lane if it has work in `queue` now (lock held): each wake-up
        costs a thread switch and the GIL, and under a stream of small requests, while
        every lane runs, most would find nothing it may take."""
        if (queue.express and queue.by_cost and len(queue.passes) >= queue.lanes
                and (self._urgent_model() is not None or self._express_request() is not None)):
            self._express_wakeup.notify()

    def finish(self, batch: Batch, error: str | None = None) -> list[PendingRequest]:
        """Account for a batch that ran (`error`: it failed, which fails its requests and
        drops their waiting inputs); return the requests now complete, failed ones with
        their `error`."""
        finished = []
        with self._lock:
            queue = self._queues[batch.queue]
            if batch.running is not None:
                queue.passes.remove(batch.running)
            if batch.wide:
                self._wide = False
                self._wakeup.notify_all()
            for item in batch.items:
                request = item.request
                request.remaining -= 1
                if error is not None and request.error is None:
                    request.error = error
                    self._drop_waiting(request)
                if request.remaining == 0:
                    self._requests.pop(request.request_id, None)
                    finished.append(request)
            if queue.by_cost:
                self._wakeup.notify()  # a lane of this model is free for them
        return finished

    def _drop_waiting(self, request: PendingRequest) -> int:
        """Remove the request's inputs from its queue (lock held); return how many."""
        queue = self._queues[request.queue]
        waiting = queue.waiting_requests.get(request)
        dropped = waiting.remaining() if waiting else []
        queue.remove(dropped)
        request.remaining -= len(dropped)
        return len(dropped)

    def _model_to_serve(self) -> str | None:
        """The model with a free lane whose most urgent waiting input is the most urgent
        of all (the oldest first among equals); lock held."""
        if self._wide:
            return None
        now = self._clock()
        ceiling = min((request.priority for queue in self._queues.values() for request in queue.waiting_requests),
                      default=0)
        best, best_key = None, None
        for name, queue in self._queues.items():
            if queue.by_cost and len(queue.passes) < queue.lanes:
                key = min((request.urgency(now, ceiling), request.seq) for request in queue.waiting_requests)
                if best_key is None or key < best_key:
                    best, best_key = name, key
        return best


def _entry(item: Item) -> tuple[int, int, Item]:
    """`item` as `_Queue.by_cost` holds it."""
    return item.cost, item.seq, item


def _index_of(entries: list[tuple[int, int, Item]], item: Item) -> int:
    """Where `item` is in `entries`, sorted by `_sort_key`."""
    return bisect.bisect_left(entries, _sort_key(_entry(item)), key=_sort_key)


def _sort_key(entry: tuple[int, int, Item]) -> tuple[int, float, int]:
    """By cost, then in the fair order: a batch's neighbours of equal cost are the inputs
    whose turn comes first."""
    return entry[0], entry[2].tag, entry[1]


def _of_several_requests(items: list[Item]) -> bool:
    """Whether `items` are inputs of more than one request. One request's inputs are shared
    as every idle lane allows, whatever the cores' load of late: its latency is what the
    parts buy, and the same request on an idle server is cut the same way each time, so its
    vectors repeat to the bit where the engine's do (docs/configuration.md#repeatable-vectors).
    Several requests' are a stream of small ones, where a part's fixed cost on a busy core
    costs throughput."""
    first = items[0].request
    return any(item.request is not first for item in items)


def _parts_holding_a_pass(queue: _Queue, items: list[Item]) -> int:
    """Into how many parts `items` split with each part's tokens at least a pass's fixed cost."""
    return max(1, int(sum(item.cost for item in items) // max(queue.pass_overhead_tokens, 1.0)))


def _longest_cost(queue: _Queue, items: list[Item]) -> float:
    """A pass of the longest of `items` alone: its fixed cost and its tokens."""
    return queue.pass_overhead_tokens + max(item.cost for item in items)


def _cut(queue: _Queue, now: float) -> list[Item]:
    """Remove and return the next batch of `queue`: the cheapest group, per token, of
    inputs of similar length around the anchor, of those that may ride along with it
    (`_rides_with`). What depends on the requests is found from them, so a cut costs
    O(requests) besides the batch's own neighbourhood (and, where a few riders are
    picked out of many waiting inputs, sorting those riders)."""
    ceiling = min(request.priority for request in queue.waiting_requests)
    urgency = {request: request.urgency(now, ceiling) for request in queue.waiting_requests}
    most_urgent = min(urgency.values())
    anchor_item = _anchor(queue, [request for request, value in urgency.items() if value == most_urgent], now)
    riders = [request for request in urgency if _rides_with(request, anchor_item.request)]
    # Most often every waiting input may ride with any other: the waiting list as it is.
    whole = len(riders) == len(urgency)
    entries = queue.by_cost if whole else _rider_entries(queue, riders)
    anchor = _index_of(entries, anchor_item)
    lo, hi = _window(entries, anchor, queue.max_batch_tokens, queue.max_batch_size)
    lengths = [entry[0] for entry in entries[lo:hi + 1]]
    first, last = _group_of(anchor - lo, split_by_cost(lengths, queue.pass_overhead_tokens,
                                                                  queue.padding_weight))
    batch = [entry[2] for entry in entries[lo + first:lo + last + 1]]
    if whole:
        del entries[lo + first:lo + last + 1]
        queue.forget(batch)
    else:
        queue.remove(batch)
    queue.virtual = max(queue.virtual, anchor_item.tag)
    return batch


def _rider_entries(queue: _Queue, riders: list[PendingRequest]) -> list[tuple[int, int, Item]]:
    """The waiting entries of `riders`, sorted as `by_cost`: from the riders' own inputs
    where they are few (a query's among bulk), else picked out of `by_cost`."""
    waiting = queue.waiting_requests
    count = sum(waiting[request].count for request in riders)
    if count * 8 < len(queue.by_cost):
        return sorted((_entry(item) for request in riders for item in waiting[request].remaining()), key=_sort_key)
    chosen = set(riders)
    return [entry for entry in queue.by_cost if entry[2].request in chosen]


def _least_urgent(items: list[Item]) -> int:
    return max(item.request.priority for item in items)


def _rides_with(request: PendingRequest, anchor: PendingRequest) -> bool:
    """Whether an input of `request` may join a batch cut around an input of `anchor`'s:
    if it is more urgent, or as urgent and not far larger (at most `OVERTAKE_FACTOR`
    times its cost as one pass). A query's pass is thus not lengthened by bulk inputs,
    of a less urgent priority or of a large request beside it, while it may take along
    any that are alike."""
    return request.priority < anchor.priority or (request.priority == anchor.priority
                                                  and request.cost <= OVERTAKE_FACTOR * anchor.cost)


def _anchor(queue: _Queue, eligible: list[PendingRequest], now: float) -> Item:
    """The input the next batch is built around, among those of the `eligible` requests
    (the most urgent class): the first in the fair order (the lowest tag, then the oldest),
    or the first input of the small requests, those costing at most 1 / OVERTAKE_FACTOR of
    it (a pass alone: overhead + length; a request: all its inputs as one pass), if that
    request has waited longer in proportion to its cost. A short input of a large request
    is no small request: it keeps its turn in the fair order."""
    firsts = [queue.waiting_requests[request].first() for request in eligible]
    first = min(firsts, key=_fair_order)
    first_cost = queue.pass_overhead_tokens + first.cost
    cheap = [item for item in firsts if item.request.cost <= first_cost / OVERTAKE_FACTOR]
    if not cheap:
        return first
    candidate = min(cheap, key=_fair_order)
    ratio = (now - candidate.arrived) / candidate.request.cost
    return candidate if ratio > (now - first.arrived) / first_cost else first


def _fair_order(item: Item) -> tuple[float, int]:
    return item.tag, item.seq


def _window(entries: list[tuple[int, int, Item]], anchor: int, max_tokens: int, max_size: int) -> tuple[int, int]:
    """The widest run of length-sorted entries around `anchor` that fits the budget,
    counted padded (inputs x longest), grown each step by the neighbour that adds the
    least padding (a shorter one: its distance to the longest; a longer one: its distance
    times the inputs it lengthens), the shorter on a tie. Inputs of the anchor's own
    length thus come before shorter ones: taken shorter first, a window around the one
    input of a length among many of the next shorter would hold those, and the cost
    split would leave the anchor a pass of its own."""
    lo = hi = anchor
    while hi - lo + 1 < max_size:
        count, longest = hi - lo + 2, entries[hi][0]
        shorter = longest - entries[lo - 1][0] if lo > 0 and count * longest <= max_tokens else None
        longer = ((entries[hi + 1][0] - longest) * (count - 1)
                  if hi + 1 < len(entries) and count * entries[hi + 1][0] <= max_tokens else None)
        if shorter is not None and (longer is None or shorter <= longer):
            lo -= 1
        elif longer is not None:
            hi += 1
        else:
            break
    return lo, hi


def split_by_cost(lengths: list[int], overhead_tokens: float, padding_weight: float = 1.0) -> list[tuple[int, int]]:
    """Split ascending `lengths` into contiguous groups (first, last) that minimise the
    total cost of running each group as one padded forward pass: `overhead_tokens` (the
    fixed cost of a pass, in token-equivalents) + its tokens + `padding_weight` x the
    padding that brings every input to the group's longest."""
    n = len(lengths)
    tokens = [0, *itertools.accumulate(lengths)]  # tokens[j]: tokens of the first j inputs
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j inputs
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            real = tokens[j] - tokens[i]
            cost = best[i] + overhead_tokens + real + padding_weight * (lengths[j - 1] * (j - i) - real)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = n
    while j > 0:
        groups.append((cut[j], j - 1))
        j = cut[j]
    return groups[::-1]


def _group_of(index: int, groups: list[tuple[int, int]]) -> tuple[int, int]:
    return next(group for group in groups if group[0] <= index <= group[1])


def media_queue(model: str) -> str:
    """The queue of a two-tower model's media (images, clips), beside the queue of its texts (`model`)."""
    return f"{model}{_MEDIA}"


def queue_model(queue: str) -> str:
    """The model a queue's batches run (`media_queue`'s inverse)."""
    return queue.removesuffix(_MEDIA)


_MEDIA = "#media"
