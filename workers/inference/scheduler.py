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
the parts take about as long and a lone large request still uses every core. A batch of
one input cut while every other lane waits idle runs as a wide pass, on every core, if the
model's engine can (`widens`); the other lanes take no work until it ends.

An engine may also run one pass beyond its lanes (`express`): the express lane, for a
small request while every lane of its model runs a pass made long by a long input.
Without it a request of one or two sentences arriving behind long inputs (one input of
256 tokens keeps a lane for tens of ms) waits for a lane to end before its own short pass
starts. The express lane takes one request at a time, and only when the longest input of
each running pass would alone make a long pass (at least `LONG_PASS_OVERHEADS` fixed
costs) costing `OVERTAKE_FACTOR` times the request's own pass or more, and when the small
requests waiting together cost no more than that. A pass long only by holding many short
inputs, or many small requests waiting, are a stream of small work that the lanes batch
better than one request at a time; so under loads of short inputs it stays idle.

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


@dataclass(eq=False)
class PendingRequest:
    request_id: int
    queue: str
    remaining: int
    cost: float = 0.0  # its inputs as one pass: fixed cost + padded tokens
    cancelled: bool = False
    error: str | None = None  # why it failed; it is reported once none of its inputs runs
    # The outputs of a model whose outputs vary in size, by slot, until all are computed.
    outputs: dict[int, np.ndarray] = field(default_factory=dict)


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


@dataclass
class Batch:
    queue: str
    items: list[Item]
    wide: bool = False  # run on every core: the other lanes are held idle for it
    express: bool = False  # run on the express lane, beside the queue's lanes


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


@dataclass
class _Queue:
    max_batch_tokens: int
    max_batch_size: int
    pass_overhead_tokens: float
    padding_weight: float
    lanes: int
    widens: bool
    express: bool
    running: int = 0  # batches cut for its lanes and not yet finished
    running_longest: list[float] = field(default_factory=list)  # theirs, as `_longest_cost`
    # Waiting items sorted by (cost, seq); `oldest` finds the fairness anchor.
    by_cost: list[tuple[int, int, Item]] = field(default_factory=list)


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


class Scheduler:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[str, _Queue] = {}
        self._requests: dict[int, PendingRequest] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._express_wakeup = threading.Condition(self._lock)
        self._idle = 0  # lanes waiting in `next_batch`
        self._wide = False  # a wide pass runs: no lane takes work
        self._shares: deque[tuple[str, list[Item]]] = deque()  # parts of a batch cut for idle lanes

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

    def submit(self, request_id: int, queue: str, slots: list[int], costs: list[int], payloads: list) -> None:
        """Queue a request's inputs on `queue`: each its arena slot, its cost and its payload."""
        arrived = self._clock()
        with self._lock:
            waiting = self._queues[queue]
            request = PendingRequest(request_id, queue, len(slots), waiting.pass_overhead_tokens
                                     + len(costs) * max(costs))
            self._requests[request_id] = request
            for slot, cost, payload in zip(slots, costs, payloads, strict=True):
                item = Item(request, slot, cost, payload, next(self._seq), arrived)
                bisect.insort(waiting.by_cost, (cost, item.seq, item), key=_sort_key)
            self._wakeup.notify()
            self._notify_express(waiting)

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
            queue, items, wide = self._take()
        return Batch(queue, items, wide)

    def next_express_batch(self) -> Batch:
        """Block until a small request waits behind long passes on every lane of an
        express model, then take its inputs (all of them, as one batch)."""
        with self._lock:
            while (found := self._express_request()) is None:
                self._express_wakeup.wait()
            model, request = found
            queue = self._queues[model]
            items = [entry[2] for entry in queue.by_cost if entry[2].request is request]
            queue.by_cost = [entry for entry in queue.by_cost if entry[2].request is not request]
        return Batch(model, items, express=True)

    def _express_request(self) -> tuple[str, PendingRequest] | None:
        """(model, request) the express lane should run now, the oldest eligible; lock held."""
        if self._wide:
            return None
        best, best_seq = None, None
        for name, queue in self._queues.items():
            if not (queue.express and queue.by_cost and queue.running >= queue.lanes):
                continue
            shortest = min(queue.running_longest)
            if shortest < LONG_PASS_OVERHEADS * queue.pass_overhead_tokens:
                continue
            most = shortest / OVERTAKE_FACTOR
            small: dict[PendingRequest, int] = {}  # the small requests waiting, by their first input
            # Sorted by length, and no request costs less than one of its inputs alone.
            for length, seq, item in queue.by_cost:
                if queue.pass_overhead_tokens + length > most:
                    break
                small[item.request] = min(seq, small.get(item.request, seq))
            # More small work than that is a stream of small requests: the lanes batch them.
            if sum(request.cost for request in small) > most:
                continue
            for request, seq in small.items():
                if request.cost <= most and (best_seq is None or seq < best_seq):
                    best, best_seq = (name, request), seq
        return best

    def _take(self) -> tuple[str, list[Item], bool]:
        """(model, items, wide) of the calling lane's next batch; lock held."""
        while not self._shares and (model := self._model_waiting_longest()) is None:
            self._idle += 1
            self._wakeup.wait()
            self._idle -= 1
        if self._shares:
            return *self._shares.popleft(), False
        queue = self._queues[model]
        items = _cut(queue, self._clock())
        idle = self._idle - len(self._shares)  # lanes waiting and not yet handed a share
        queue.running += 1
        if len(items) == 1 and queue.widens and idle == self.lanes - 1:
            self._wide = True
            queue.running_longest.append(_longest_cost(queue, items))
            return model, items, True
        parts = 1 + max(0, min(idle, queue.lanes - queue.running, len(items) - 1))
        for i in range(1, parts):
            self._shares.append((model, items[i::parts]))
        self._wakeup.notify(parts - 1)
        queue.running += parts - 1
        queue.running_longest.extend(_longest_cost(queue, items[i::parts]) for i in range(parts))
        self._notify_express(queue)  # every lane may now be busy with a long pass
        return model, items[::parts], False

    def _notify_express(self, queue: _Queue) -> None:
        """Wake the express lane if it may have work in `queue` (lock held): only while every
        lane of its model runs; waking it on every request costs a thread switch each."""
        if queue.express and queue.by_cost and queue.running >= queue.lanes:
            self._express_wakeup.notify()

    def finish(self, batch: Batch, error: str | None = None) -> list[PendingRequest]:
        """Account for a batch that ran (`error`: it failed, which fails its requests and
        drops their waiting inputs); return the requests now complete, failed ones with
        their `error`."""
        finished = []
        with self._lock:
            queue = self._queues[batch.queue]
            if not batch.express:
                queue.running -= 1
                queue.running_longest.remove(_longest_cost(queue, batch.items))
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
        kept = [entry for entry in queue.by_cost if entry[2].request is not request]
        dropped = len(queue.by_cost) - len(kept)
        request.remaining -= dropped
        queue.by_cost = kept
        return dropped

    def _model_waiting_longest(self) -> str | None:
        if self._wide:
            return None
        best, best_seq = None, None
        for name, queue in self._queues.items():
            if queue.by_cost and queue.running < queue.lanes:
                seq = min(entry[1] for entry in queue.by_cost)
                if best_seq is None or seq < best_seq:
                    best, best_seq = name, seq
        return best


def _sort_key(entry: tuple[int, int, Item]) -> tuple[int, int]:
    return entry[0], entry[1]


def _longest_cost(queue: _Queue, items: list[Item]) -> float:
    """A pass of the longest of `items` alone: its fixed cost and its tokens."""
    return queue.pass_overhead_tokens + max(item.cost for item in items)


def _cut(queue: _Queue, now: float) -> list[Item]:
    """Remove and return the next batch of `queue`: the cheapest group, per token, of
    inputs of similar length around the anchor."""
    entries = queue.by_cost
    anchor = _anchor(entries, queue.pass_overhead_tokens, now)
    lo, hi = _window(entries, anchor, queue.max_batch_tokens, queue.max_batch_size)
    lengths = [entry[0] for entry in entries[lo:hi + 1]]
    first, last = _group_of(anchor - lo, split_by_cost(lengths, queue.pass_overhead_tokens,
                                                                  queue.padding_weight))
    batch = [entry[2] for entry in entries[lo + first:lo + last + 1]]
    del entries[lo + first:lo + last + 1]
    return batch


def _anchor(entries: list[tuple[int, int, Item]], overhead_tokens: float, now: float) -> int:
    """Index of the input the next batch is built around: the oldest, or the oldest of the
    inputs at most 1 / OVERTAKE_FACTOR of its cost (a pass alone: overhead + length) if
    that one has waited longer in proportion to its cost."""
    oldest = min(range(len(entries)), key=lambda i: entries[i][1])
    oldest_cost = overhead_tokens + entries[oldest][0]
    cheap = bisect.bisect_right(entries, oldest_cost / OVERTAKE_FACTOR - overhead_tokens, key=lambda e: e[0])
    if cheap == 0:
        return oldest
    candidate = min(range(cheap), key=lambda i: entries[i][1])
    ratio = (now - entries[candidate][2].arrived) / (overhead_tokens + entries[candidate][0])
    return candidate if ratio > (now - entries[oldest][2].arrived) / oldest_cost else oldest


def _window(entries: list[tuple[int, int, Item]], anchor: int, max_tokens: int, max_size: int) -> tuple[int, int]:
    """The widest run of length-sorted entries around `anchor` that fits the budget,
    counted padded (inputs x longest); shorter neighbours are taken first."""
    lo = hi = anchor
    while hi - lo + 1 < max_size:
        count = hi - lo + 2
        if lo > 0 and count * entries[hi][0] <= max_tokens:
            lo -= 1
        elif hi + 1 < len(entries) and count * entries[hi + 1][0] <= max_tokens:
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
