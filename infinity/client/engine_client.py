"""The engine client: the front end's side of the child processes. Admission, the ledger
of requests in flight, the messages to and from the children, which replica runs a
request, and what happens when a child answers or dies. Where the children run is
`infinity.client.topology`'s; what a route makes of a `Result` is the route's.

Every request is admitted (given arena slots, or refused with 429) before anything is
queued, then sent to a tokenizer, then to one replica of its model: the inference process
of one of the model's devices, the ready one with the fewest inputs outstanding.
The engine client always knows which child holds a request, so a child's death fails exactly
the requests it held (503), and a client that goes away has its request dropped from
the inference queue. Slots return to the pool only when no process can still write them.

A request whose long inputs are chunked (`ModelInputs.long_inputs`) is admitted for its
inputs, as any: how many chunks they make is known only once they are tokenized, and
counting tokens in the event loop to admit by chunks would cost every request what only
long ones need (an upper bound from characters would be far off, or refuse most long
inputs). The tokenizer reports each input's chunks (`Tokenized.chunks`); the slots the
chunks need beyond the request's are taken then, before anything is sent to run, as its
inputs were (`_admit`: a less urgent request within its share), and if there is not that
much room the request is answered 429 like any other that finds the queue full. Each
chunk is one input to the scheduler (chunks of one input may run in different batches);
the route combines them (`Result.chunks`).

A model placed on several devices keeps serving on its other replicas while one is
restarted; `/health` says ready only when every process is (a replica short, it is 503).
A model served unprepared is handed over to a successor process once it is prepared
(`infinity.client.handover`); meanwhile `/health` says ready.

A request runs at the priority of its context (`at_priority`; lower is served first):
the inference process serves more urgent requests first, and admission keeps room for
them, since less urgent requests (priority above 0) may hold only part of a model's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.format import descr_to_dtype

import msgspec

from infinity.client.handover import PREPARING_ENTRY_POINT, Handover, preparer_name, successor_name
from infinity.client.headroom import CoreHeadroom
from infinity.client.supervisor import Child, Launch, spawn_process
from infinity.client.topology import INFERENCE_ENTRY_POINT, Replica, ServedModel, place
from infinity.config import MediaConfig, ServerConfig
from infinity.shared import protocol, shm, tracing
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec

# The one path by which worker code runs in the front end: small requests are tokenized
# here, with the tokenizer processes' own code, rather than paying two messages
# (`EngineClient._inline_tokenizers`).
from workers.preprocess import reply
from workers.preprocess.text import ModelTokenizer, TaskTokenizer, model_tokenizer

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0
# A request of one text up to this long (or one token-id sequence) is tokenized in the
# front end: that costs it about what sending it to a tokenizer process and reading the
# answer back does, and saves the request two process hops.
INLINE_MAX_CHARS = 256
# A request that finds nothing else in flight is tokenized in the front end if its texts
# hold up to this many characters in all (at most ~1 ms of tokenizing): the event loop
# has nothing else to do meanwhile, and the two hops to a tokenizer process and back cost
# a lone request more than that (bench/results/lone-request.md#the-lone-request-hand-offs).
INLINE_IDLE_MAX_CHARS = 4096
# An input for an inference process that holds others already waits behind their pass:
# its message may wait this long for the next requests' to leave with it, one wake-up of
# that process's threads for several (bench/results/serving-path.md#inputs-held-while-the-inference-process-is-busy).
# An input more urgent than every other one held goes at once: the next cut is its own.
BUSY_SEND_HOLD_S = 0.0002


# The priority of the request being served, set where a request enters (the HTTP handler,
# from its body or its API key; a corpus job, from its options) and read by
# `EngineClient.run`, so that the code between needs not carry it.
_PRIORITY: ContextVar[int] = ContextVar("request_priority", default=0)


@contextlib.contextmanager
def at_priority(priority: int) -> Iterator[None]:
    """Run the requests made inside the block (and in tasks started there) at `priority`."""
    token = _PRIORITY.set(priority)
    try:
        yield
    finally:
        _PRIORITY.reset(token)


class StartupError(RuntimeError):
    """A child could not load what it serves; the server cannot start."""


class ServingError(Exception):
    """A request the server could not serve, for a reason of `kind` (raised below the
    routes, which know no HTTP; `infinity.api.errors` turns it into the client's answer)."""

    def __init__(self, kind: protocol.ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param


class ModelInputs(msgspec.Struct, frozen=True):
    """The inputs of one request as the engine client takes them: texts, token-id
    sequences or media, one of them; with `query`, the texts are the documents each paired
    with it; `task`: encode them as the model's "query" or "document" (models that tell
    the two apart); `prompt`: put before each text (None: the model's own for the task,
    `ModelSpec.prompt_for`)."""

    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    query: str | None = None
    task: str | None = None
    media: list[bytes] | None = None  # fetched bytes or data: URIs (see `protocol.Tokenize.media`)
    # The outputs asked of a hybrid model (`KindSpec.vector_types`; none: its first), or of
    # a model of one vector per input `protocol.TOKEN_STATES` (in `Result.ragged`) or
    # `protocol.UNNORMALIZED` (its vectors before their final Normalize).
    vector_types: tuple[str, ...] = ()
    prompt: str | None = None
    # Inputs longer than the model: "truncate", "chunk" or "error" (None: as the model says),
    # the tokens chunks overlap by (None: the model's) and the most chunks of one input
    # (None: the model's max_chunks_per_input; see `protocol.Tokenize`).
    long_inputs: str | None = None
    chunk_overlap: int | None = None
    max_chunks: int | None = None
    # The request field that forbids cutting inputs (TEI's `truncate: false`), where one
    # does: an input the tokenizer cut is refused, naming it, before the model runs.
    refuse_cut: str | None = None
    # Cut each input at its start to its last this many tokens (`protocol.Tokenize.keep_last`).
    keep_last: int | None = None
    special_tokens: bool = True  # texts get the model's special tokens (`protocol.Tokenize.special_tokens`)

    def __len__(self) -> int:
        inputs = next(i for i in (self.texts, self.token_ids, self.media) if i is not None)
        return len(inputs)

    def prompt_on(self, spec: ModelSpec) -> str:
        """The prompt put before each text on the model of `spec`."""
        return self.prompt if self.prompt is not None else spec.prompt_for(self.task)


@dataclass(eq=False)
class _Pending:
    request_id: int
    model: ServedModel
    slots: list[int]
    future: asyncio.Future[Result | protocol.LookedUp]  # an inference request's outputs, or a lookup's answer
    holder: Child | None  # None: tokenized in the front end, not yet sent anywhere
    priority: int = 0
    trace: str | None = None  # its traceparent, where it is traced
    replica: Replica | None = None  # where it was sent to run
    costs: list[int] = field(default_factory=list)  # each input's tokens (or a medium's cost)
    billed: int = 0
    truncated: list[int] = field(default_factory=list)  # positions of the inputs cut
    info: list[protocol.ImageInfo] | None = None  # what each input was as sent, where that says something
    abandoned: bool = False  # the client went away (or was answered with an error)
    sent: float = 0.0  # when it was sent to an inference process (monotonic seconds)
    vector_types: list[str] = field(default_factory=list)  # the outputs it asks of a hybrid model
    chunks: list[int] | None = None  # how many of its slots each input's chunks took (None: one each)
    refuse_cut: str | None = None  # as `ModelInputs.refuse_cut`


@dataclass
class Result:
    """Outputs of one request (vectors or scores), still in the arena: read them, then
    `release`."""

    model: ServedModel
    arena: shm.Arena
    slots: list[int]
    prompt_tokens: int
    costs: list[int]  # what each input cost the pass: its tokens, a medium's patches or frames
    cut: list[int]  # the positions of the inputs cut to the model's maximum length
    ragged: dict[int, np.ndarray] | None = None  # outputs that vary in size, by slot (not in the arena)
    # A hybrid model's outputs by type, by slot, where the request asked for several.
    by_type: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    info: list[protocol.ImageInfo] | None = None  # what each input was as sent (images: their size and format)
    # Where long inputs were chunked: how many consecutive rows each input's chunks are (None: one each).
    chunks: list[int] | None = None
    _released: bool = field(default=False, repr=False)

    @property
    def activation(self) -> str:
        assert self.model.info is not None
        return self.model.info.activation

    @property
    def truncated(self) -> int:
        """How many inputs were cut to the model's maximum length."""
        return len(self.cut)

    @property
    def labels(self) -> list[str]:
        assert self.model.info is not None
        return self.model.info.labels

    def rows(self) -> Iterator[np.ndarray]:
        """Each input's output, in input order: a vector as a view into shared memory, or
        the array of a model whose outputs vary in size."""
        for slot in self.slots:
            yield self.arena.rows[slot] if self.ragged is None else self.ragged[slot]

    def stacked(self) -> np.ndarray:
        """Every input's output as one (n, ...) array, a copy: the arena's rows taken at once
        where they are there (outputs of one size each)."""
        if self.ragged is None:
            return self.arena.rows.take(self.slots, axis=0)
        return np.stack([self.ragged[slot] for slot in self.slots])

    def rows_of(self, vector_type: str) -> list[np.ndarray]:
        """A hybrid model's `vector_type` outputs, in input order (those of a request that
        asked for that type alone are its `rows`)."""
        return [self.by_type[vector_type][slot] for slot in self.slots] if self.by_type else list(self.rows())

    @property
    def input_costs(self) -> list[int]:
        """What each input cost the pass: the sum of its chunks' costs where it was chunked."""
        if self.chunks is None:
            return self.costs
        return np.add.reduceat(self.costs, chunk_starts(self.chunks)).tolist()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.model.pool.give_back(self.slots)


class EngineClient:
    def __init__(self, server: ServerConfig, specs: list[ModelSpec], launch: Launch = spawn_process,
                 media: MediaConfig | None = None) -> None:
        self._server = server
        self._media = media or MediaConfig()
        self._folder = shm.ServerFolder()  # arenas and channels' ipc endpoints
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._outstanding: dict[str, int] = {}
        self._started: asyncio.Future[None] | None = None
        self._stopping = False
        self.draining = False  # stopping: new requests are refused while those held finish
        self._handlers = {
            protocol.Ready: self._on_ready,
            protocol.StartupFailed: self._on_startup_failed,
            protocol.Tokenized: self._on_tokenized,
            protocol.LookedUp: self._on_looked_up,
            protocol.Done: self._on_done,
            protocol.Failed: self._on_failed,
            protocol.BatchRan: self._on_batch_ran,
        }
        # Told of every batch an inference process ran (the metrics observe them).
        self.on_batch_ran: Callable[[protocol.BatchRan], None] = lambda message: None

        self._launch = launch
        self._handovers: list[Handover] = []
        self._handed_over: set[str] = set()  # inference processes whose handover began (once each)
        self._retiring: list[Child] = []  # handed over, finishing what they hold
        self._background: set[asyncio.Task[None]] = set()
        topology = place(server, specs, self._args, launch)
        self.models = topology.models
        self.tokenizers = topology.tokenizers
        self.inference = topology.inference
        self._inline = self._inline_tokenizers([model.spec for model in self.models.values()])
        self._headroom = (CoreHeadroom(topology.shared_cores, self._pids) if topology.shared_cores is not None
                          else None)

    @staticmethod
    def _inline_tokenizers(specs: list[ModelSpec]) -> dict[str, ModelTokenizer | TaskTokenizer]:
        """Front-end tokenizers for small requests; not for rerankers, whose pairs are never
        small, nor for models whose texts their processor encodes; a model whose tokenizer
        does not load here is left to the tokenizer processes (which report why at start)."""
        tokenizers = {}
        for spec in specs:
            if KINDS[spec.kind].pairs or KINDS[spec.kind].text_by_processor:
                continue
            try:
                tokenizers[spec.name] = model_tokenizer(spec)
            except Exception:
                log.warning("model %s: no front-end tokenizer, every request goes to a tokenizer process",
                            spec.name, exc_info=True)
        return tokenizers

    def _channel(self, name: str) -> str:
        """The base of a child's channel endpoints, in this server's folder."""
        return f"ipc://{self._folder.path}/{name.replace(':', '_')}"

    def _args(self, name: str, specs: list[ModelSpec], cpus: list[int] | None, threads: int) -> protocol.WorkerArgs:
        return protocol.WorkerArgs(
            name=name, channel=self._channel(name),
            models=specs, cpus=cpus, threads=threads, arena_prefix=self._folder.arena_prefix(),
            arena_slots=self._server.max_queued_items, log_level=self._server.log_level,
            max_image_bytes=self._media.max_image_bytes, max_image_pixels=self._media.max_image_pixels,
            max_audio_bytes=self._media.max_audio_bytes, max_audio_seconds=self._media.max_audio_seconds,
            traced=tracing.tracer() is not None,
            prepare_in_background=self._server.prepare == "in_background",
        )

    @property
    def children(self) -> list[Child]:
        """Every child process: those serving, and those preparing, taking over or retiring."""
        return [*self._serving, *(child for handover in self._handovers for child in handover.children),
                *self._retiring]

    @property
    def _serving(self) -> list[Child]:
        return [*self.tokenizers, *self.inference]

    def _pids(self) -> list[int]:
        """The front end's process id and its running children's (what `CoreHeadroom` counts)."""
        return [os.getpid(), *(child.process.pid for child in self.children
                               if child.process is not None and child.process.pid is not None)]

    @property
    def ready(self) -> bool:
        return (all(child.ready for child in self._serving)
                and all(replica.ready for model in self.models.values() for replica in model.replicas))

    async def start(self) -> None:
        """Start every child; return once all are ready, or raise `StartupError`."""
        loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        for child in self._serving:
            child.start(self._receive, self._child_exited)
        await self._started

    async def run(self, model: ServedModel, inputs: ModelInputs) -> Result:
        """Run one request through the children; the caller must `release` the result."""
        if self._stopping or self.draining:
            raise ServingError(protocol.ErrorKind.SHUTTING_DOWN, "the server is shutting down")
        if not model.ready:
            raise ServingError(protocol.ErrorKind.MODEL_NOT_READY,
                               f"model '{model.spec.name}' is not ready yet; retry shortly")
        inline, tokenizer = self._tokenizer_for(model, inputs)
        priority = _PRIORITY.get()
        slots = self._admit(model, len(inputs), priority)
        self._next_id += 1
        limit = model.spec.max_input_chars
        request = protocol.Tokenize(self._next_id, model.spec.name,
                                    _within(inputs.texts, limit, inputs.keep_last is not None), inputs.token_ids,
                                    _within([inputs.query], limit)[0] if inputs.query is not None else None,
                                    inputs.task, inputs.media, trace=tracing.traceparent(),
                                    prompt=inputs.prompt_on(model.spec), long_inputs=inputs.long_inputs,
                                    chunk_overlap=inputs.chunk_overlap, max_chunks=inputs.max_chunks,
                                    keep_last=inputs.keep_last, special_tokens=inputs.special_tokens)
        result = await self._submit(_Pending(self._next_id, model, slots, asyncio.get_running_loop().create_future(),
                                             tokenizer, priority, request.trace,
                                             vector_types=_vector_types(model, inputs), refuse_cut=inputs.refuse_cut),
                                    request, inline)
        tracing.outputs_arrived()
        return result

    async def look_up(self, model: ServedModel, inputs: ModelInputs, special_tokens: bool) -> protocol.LookedUp:
        """What `model`'s tokenizer makes of `inputs` (`protocol.Tokenize.lookup`): each
        text's tokens after its prompt (`ModelInputs.prompt_on`), whole, with
        (`special_tokens`) or without the special tokens the model adds; or each token-id
        sequence's text, with or without its special tokens. No model runs and no slot is
        taken.

        A lookup is answered where an embedding request of the same inputs would be
        tokenized (`_tokenized_here`): in the front end when it is small, or when nothing
        else is in flight, which spares a lone client two process hops; in a tokenizer
        process otherwise, so that thousands of long texts (each token's offsets cost more
        than its id) never hold the event loop that serves every other request."""
        if self._stopping or self.draining:
            raise ServingError(protocol.ErrorKind.SHUTTING_DOWN, "the server is shutting down")
        inline, tokenizer = self._tokenizer_for(model, inputs)
        self._next_id += 1
        request = protocol.Tokenize(self._next_id, model.spec.name, inputs.texts, inputs.token_ids,
                                    trace=tracing.traceparent(), prompt=inputs.prompt_on(model.spec), lookup=True,
                                    special_tokens=special_tokens)
        return await self._submit(_Pending(self._next_id, model, [], asyncio.get_running_loop().create_future(),
                                           tokenizer), request, inline)

    def _tokenizer_for(self, model: ServedModel,
                       inputs: ModelInputs) -> tuple[ModelTokenizer | TaskTokenizer | None, Child | None]:
        """Where `inputs` are tokenized: (the front end's tokenizer of `model`, None) where
        `_tokenized_here` says so and it has one, else (None, a tokenizer process)."""
        crowded = self._headroom is not None and self._headroom.crowded()
        here = _tokenized_here(inputs, idle=not self._pending, crowded=crowded)
        inline = self._inline.get(model.spec.name) if here else None
        return inline, None if inline is not None else self._pick_tokenizer()

    async def _submit(self, pending: _Pending, request: protocol.Tokenize,
                      inline: ModelTokenizer | TaskTokenizer | None) -> Result | protocol.LookedUp:
        """Send `request` to the tokenizer process `pending.holder` (or tokenize it here with
        `inline`), then wait for its request's answer."""
        if pending.holder is not None:
            try:
                pending.holder.send(request)
            except Exception:
                pending.model.pool.give_back(pending.slots)
                raise
            self._outstanding[pending.holder.name] += 1
        self._pending[pending.request_id] = pending
        if inline is not None:
            answer = reply(inline.tokenize, request)
            self._handlers[type(answer)](answer)
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._abandon(pending)
            raise

    def _admit(self, model: ServedModel, count: int, priority: int) -> list[int]:
        """Slots for a request of `count` inputs at `priority`, or `OVERLOADED`: the model's
        queue is full, or (priority above 0) its share for less urgent requests is."""
        pool = model.pool
        if priority > 0 and pool.held_from(1) + count > self._server.low_priority_items:
            raise ServingError(protocol.ErrorKind.OVERLOADED, f"model '{model.spec.name}' holds "
                               f"{pool.held_from(1)} inputs of priority above 0, their limit; retry later")
        slots = pool.take(count, priority)
        if slots is None:
            raise ServingError(protocol.ErrorKind.OVERLOADED, f"model '{model.spec.name}' has "
                               f"{pool.capacity - pool.free} inputs queued, its limit; retry later")
        return slots

    def _pick_tokenizer(self) -> Child:
        ready = [child for child in self.tokenizers if child.ready]
        if not ready:
            raise ServingError(protocol.ErrorKind.NOT_READY, "no tokenizer process is ready; retry shortly")
        return min(ready, key=lambda child: self._outstanding[child.name])

    def _abandon(self, pending: _Pending) -> None:
        """The client went away: stop the work if it is still queued somewhere."""
        if pending.future.done() and not pending.future.cancelled() and pending.future.exception() is None:
            answer = pending.future.result()
            if isinstance(answer, Result):
                answer.release()
            return
        pending.abandoned = True
        if (pending.holder in self.inference or pending.holder in self._retiring) and pending.holder.channel is not None:
            pending.holder.send(protocol.Cancel(pending.request_id))

    def _receive(self, message: protocol.Message) -> None:
        """Handle a message from a child."""
        try:
            self._handlers[type(message)](message)
        except Exception as exc:
            log.exception("handling %s failed", type(message).__name__)
            if self._started is not None and not self._started.done():
                self._started.set_exception(StartupError(f"handling {type(message).__name__} failed: {exc}"))

    def _child(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    def _on_ready(self, message: protocol.Ready) -> None:
        child = self._child(message.worker)
        handover = self._handover_of(child)
        if handover is not None and child is handover.preparer:
            self._start_successor(handover)
            return
        if handover is not None:
            self._switch(handover, message)
            return
        for info in message.models:
            self.models[info.name].replica_in(child).attach(info)
        child.ready = True
        child.failures = 0
        self._outstanding[child.name] = 0
        log.info("%s ready (pid %d)", child.name, message.pid)
        unprepared = [info.name for info in message.models if not info.prepared]
        if unprepared and child.name not in self._handed_over:
            self._prepare(child, unprepared)
        if self._started is not None and not self._started.done() and self.ready:
            self._started.set_result(None)

    # --- handing unprepared models over (`infinity.client.handover`) ---------------------

    def _handover_of(self, child: Child) -> Handover | None:
        """The handover `child` prepares for or takes over in, if any."""
        return next((handover for handover in self._handovers if child in handover.children), None)

    def _prepare(self, serving: Child, models: list[str]) -> None:
        """Start the preparing process of the models `serving` serves unprepared."""
        args = self._args(preparer_name(serving), serving.args.models, serving.args.cpus, serving.args.threads)
        handover = Handover(serving, Child(args, PREPARING_ENTRY_POINT, self._launch))
        self._handovers.append(handover)
        self._handed_over.add(serving.name)
        log.info("%s serves %s unprepared; %s prepares them", serving.name, ", ".join(models), args.name)
        handover.preparer.start(self._receive, self._child_exited)

    def _start_successor(self, handover: Handover) -> None:
        """The models are prepared: start the inference process that loads them so."""
        serving = handover.serving
        args = self._args(successor_name(serving), serving.args.models, serving.args.cpus, serving.args.threads)
        log.info("%s prepared its models; %s loads them to take over from %s", handover.preparer.name, args.name,
                 serving.name)
        handover.successor = Child(args, INFERENCE_ENTRY_POINT, self._launch)
        handover.successor.start(self._receive, self._child_exited)

    def _switch(self, handover: Handover, message: protocol.Ready) -> None:
        """The successor is ready: its replicas take the place of the serving process's,
        which finishes what it holds and stops (`_retire`)."""
        successor, serving = handover.successor, handover.serving
        assert successor is not None
        if not all(info.prepared for info in message.models):
            self._give_up(handover, f"{successor.name} found them unprepared still (is the cache directory "
                                    f"writable?)")
            return
        successor.ready = True
        self._outstanding[successor.name] = 0
        log.info("%s ready (pid %d)", successor.name, message.pid)
        for info in message.models:
            model = self.models[info.name]
            old = model.replica_in(serving)
            replica = Replica(old.device, successor)
            replica.attach(info)
            model.replicas = [replica if r is old else r for r in model.replicas]
            log.info("'%s' handed over from %s (%s %s) to %s (%s %s%s)", info.name, serving.name,
                     old.info.engine if old.info else "?", old.info.dtype if old.info else "?", successor.name,
                     info.engine, info.dtype, f", lone inputs on {info.lone_engine}" if info.lone_engine else "")
        self.inference[self.inference.index(serving)] = successor
        self._handovers.remove(handover)
        self._retire([serving, handover.preparer], "handed over")

    def _retire(self, children: list[Child], why: str) -> None:
        """Stop `children` once no request they hold is left; then remove their arenas."""
        self._retiring.extend(children)
        task = asyncio.get_running_loop().create_task(self._stop_retired(children, why))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stop_retired(self, children: list[Child], why: str) -> None:
        while any(pending.holder in children for pending in self._pending.values()):
            await asyncio.sleep(0.05)
        for child in children:
            child.terminate()
        await asyncio.to_thread(lambda: [child.reap(_STOP_TIMEOUT_S) for child in children])
        for child in children:
            child.close_channel()
            if child in self._retiring:
                self._retiring.remove(child)
            for spec in child.args.models:  # a preparing process made none: nothing to remove
                shm.remove(shm.arena_name(child.args.arena_prefix, child.name, spec.name))
        log.info("%s stopped, %s", " and ".join(child.name for child in children), why)

    def _give_up(self, handover: Handover, why: str) -> None:
        """The handover failed: its processes stop and the serving one keeps its models."""
        log.warning("%s keeps serving its models unprepared: %s", handover.serving.name, why)
        self._handovers.remove(handover)
        self._retire(handover.children, "the handover given up")

    def _on_startup_failed(self, message: protocol.StartupFailed) -> None:
        handover = self._handover_of(self._child(message.worker))
        if handover is not None:
            self._give_up(handover, f"{message.worker} failed: {message.message}")
            return
        log.error("%s could not start: %s", message.worker, message.message)
        if self._started is not None and not self._started.done():
            self._started.set_exception(StartupError(f"{message.worker}: {message.message}"))

    def _on_tokenized(self, message: protocol.Tokenized) -> None:
        pending = self._pending.get(message.request_id)
        if pending is None:
            return
        if pending.holder is not None:
            self._outstanding[pending.holder.name] -= 1
        model = pending.model
        if pending.abandoned:
            self._finish(pending, None)
            return
        if message.truncated and pending.refuse_cut is not None:
            self._finish(pending, ServingError(
                protocol.ErrorKind.INVALID_INPUT, f"input[{message.truncated[0]}] is longer than the "
                f"{model.spec.max_length} tokens of model '{model.spec.name}', and {pending.refuse_cut} is false",
                pending.refuse_cut))
            return
        replica = model.pick()
        if replica is None:
            self._finish(pending, ServingError(protocol.ErrorKind.MODEL_NOT_READY,
                                               f"model '{model.spec.name}' is restarting; retry shortly"))
            return
        if message.chunks is not None:
            try:  # admitted as the request's own inputs are, its priority's share held to
                pending.slots += self._admit(model, len(message.inputs.costs) - len(pending.slots), pending.priority)
            except ServingError as refused:
                self._finish(pending, ServingError(refused.kind,
                                                   f"no room for this request's chunks: {refused.message}"))
                return
            pending.chunks = message.chunks
        pending.billed = message.inputs.billed
        pending.costs = message.inputs.costs
        pending.truncated = message.truncated
        pending.info = message.inputs.info
        pending.holder = replica.child
        pending.replica = replica
        pending.sent = time.monotonic()
        model.served.queued_tokens += pending.billed
        replica.outstanding += len(pending.slots)
        own = len(pending.slots)
        busy = replica.outstanding > own and model.pool.held_up_to(pending.priority) > own
        replica.child.send(protocol.Infer(message.request_id, model.spec.name, pending.slots, message.inputs,
                                          pending.priority, pending.trace, pending.vector_types),
                           hold_s=BUSY_SEND_HOLD_S if busy else 0.0)

    def _on_looked_up(self, message: protocol.LookedUp) -> None:
        pending = self._take(message.request_id)
        if pending is None:
            return
        if pending.holder is not None:
            self._outstanding[pending.holder.name] -= 1
        if not pending.future.done():
            pending.future.set_result(message)

    def _on_done(self, message: protocol.Done) -> None:
        pending = self._take(message.request_id)
        if pending is None:
            return
        if pending.abandoned or message.cancelled:
            pending.model.pool.give_back(pending.slots)
            return
        replica = pending.replica
        assert replica is not None and replica.arena is not None
        replica.served += len(pending.slots)
        served = pending.model.served
        served.inputs += len(pending.slots)
        served.prompt_tokens += pending.billed
        served.truncated += len(pending.truncated)
        served.rate.completed(pending.billed, pending.sent, time.monotonic())
        ragged = None if message.outputs is None else _by_slot(message.outputs)
        by_type = {vector_type: _by_slot(outputs) for vector_type, outputs in message.outputs_by_type.items()}
        pending.future.set_result(Result(pending.model, replica.arena, pending.slots, pending.billed, pending.costs,
                                         pending.truncated, ragged, by_type, pending.info, pending.chunks))

    def _on_batch_ran(self, message: protocol.BatchRan) -> None:
        self.on_batch_ran(message)

    def _on_failed(self, message: protocol.Failed) -> None:
        pending = self._pending.get(message.request_id)
        if pending is None:
            return
        if pending.holder in self.tokenizers:
            self._outstanding[pending.holder.name] -= 1
        self._finish(pending, ServingError(message.kind, message.message, message.param))

    def _finish(self, pending: _Pending, error: ServingError | None) -> None:
        """End a request with an error (None: its client is gone); no process holds it,
        so its slots are free."""
        self._take(pending.request_id)
        pending.model.pool.give_back(pending.slots)
        if pending.future.done():
            return
        if error is None or pending.abandoned:
            pending.future.cancel()
        else:
            pending.future.set_exception(error)

    def _take(self, request_id: int) -> _Pending | None:
        """Remove a request that no process holds any more from the books."""
        pending = self._pending.pop(request_id, None)
        if pending is not None and pending.replica is not None:
            pending.replica.outstanding -= len(pending.slots)
            pending.model.served.queued_tokens -= pending.billed
        return pending

    def _child_exited(self, child: Child) -> None:
        code = child.process.exitcode if child.process is not None else None
        held = [p for p in self._pending.values() if p.holder is child]
        for pending in held:
            self._finish(pending, ServingError(protocol.ErrorKind.WORKER_DIED,
                                               f"the {child.name} process stopped while serving this request; retry"))
        if self._stopping or child in self._retiring:
            return  # a retiring process is reaped by `_stop_retired`
        handover = self._handover_of(child)
        if handover is not None:
            if not (child is handover.preparer and code == 0):  # a preparer exits once done
                self._give_up(handover, f"{child.name} exited with code {code}")
            return
        for model in self.models.values():
            for replica in model.replicas:
                if replica.child is child and replica.info is not None:
                    shm.remove(replica.info.arena)  # the restarted child creates it anew
        if self._started is not None and not self._started.done():
            self._started.set_exception(StartupError(f"{child.name} exited with code {code} while starting"))
            return
        delay = child.restart_delay()
        log.error("%s exited with code %s; %d requests failed; restarting in %.1fs",
                  child.name, code, len(held), delay)
        asyncio.get_running_loop().call_later(delay, self._restart, child)

    def _restart(self, child: Child) -> None:
        # A process handed over while its restart waited stays stopped.
        if not self._stopping and child in self._serving:
            child.reap(0)
            child.start(self._receive, self._child_exited)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and wait, at most `timeout` seconds, for those held to finish."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        log.info("stopping: %d requests held, waiting up to %.0f s for them", len(self._pending), timeout)
        while self._pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._pending:
            log.warning("%d requests still held after %.0f s: they fail", len(self._pending), timeout)

    async def stop(self) -> None:
        """Stop every child, fail what is still pending, remove arenas and channels."""
        self._stopping = True
        for task in self._background:  # the server's stop takes every child, retiring ones too
            task.cancel()
        for child in self.children:
            child.terminate()
        await asyncio.to_thread(self._reap_all)
        for child in self.children:
            child.close_channel()
        for pending in list(self._pending.values()):
            self._finish(pending, ServingError(protocol.ErrorKind.SHUTTING_DOWN, "the server is shutting down"))
        self._folder.remove()

    def _reap_all(self) -> None:
        for child in self.children:
            child.reap(_STOP_TIMEOUT_S)


def chunk_starts(chunks: list[int]) -> np.ndarray:
    """Where each input's chunks start among a request's outputs, given how many each made."""
    return np.cumsum([0, *chunks[:-1]])


def _tokenized_here(inputs: ModelInputs, idle: bool, crowded: bool = False) -> bool:
    """Whether the front end tokenizes `inputs` itself: one token-id sequence, one text of
    at most `INLINE_MAX_CHARS` (of at most `INLINE_IDLE_MAX_CHARS` where the tokenizer
    processes share cores that are `crowded`: `CoreHeadroom`), or, with nothing else in
    flight (`idle`), texts of at most `INLINE_IDLE_MAX_CHARS` in all; never pairs or media."""
    if inputs.query is not None or inputs.media is not None:
        return False
    if inputs.texts is None:
        return len(inputs) == 1
    chars = sum(len(text) for text in inputs.texts)
    one_text_max = INLINE_IDLE_MAX_CHARS if crowded else INLINE_MAX_CHARS
    return (len(inputs) == 1 and chars <= one_text_max) or (idle and chars <= INLINE_IDLE_MAX_CHARS)


def _vector_types(model: ServedModel, inputs: ModelInputs) -> list[str]:
    """The outputs a request asks of `model`: for a hybrid model, those `inputs` name, else
    its first (a dense vector, as routes that know no types answer); for queries of a
    model with a static query side, that side's weights (`protocol.QUERY_ROUTE`); for
    other kinds, the token states or the vectors before the final Normalize where `inputs`
    name them (`protocol.TOKEN_STATES`, `protocol.UNNORMALIZED`), else nothing (a type
    that names their one output, as "sparse" of a sparse model, asks nothing more)."""
    if model.kind.vector_types:
        return list(inputs.vector_types or model.kind.vector_types[:1])
    if model.spec.query_weights is not None and inputs.task == "query":
        return [protocol.QUERY_ROUTE]
    return [t for t in (protocol.TOKEN_STATES, protocol.UNNORMALIZED) if t in inputs.vector_types]


def _within(texts: list[str] | None, limit: int, from_end: bool = False) -> list[str] | None:
    """`texts`, each cut one character past the `limit` the tokenizer reads of an input (so
    it still sees that the text was longer), keeping its start (or its end, `from_end`, for
    inputs cut at their start): nothing it would not read is sent to it."""
    if texts is None or all(len(text) <= limit for text in texts):
        return texts
    return [text[-(limit + 1):] if from_end else text[:limit + 1] for text in texts]


def _by_slot(outputs: protocol.Ragged) -> dict[int, np.ndarray]:
    """The arrays of a `Ragged` message part, by slot."""
    dtype = descr_to_dtype(outputs.dtype)
    data = np.frombuffer(outputs.data, dtype=dtype)
    arrays, start = {}, 0
    for slot, shape in zip(outputs.slots, outputs.shapes):
        size = int(np.prod(shape))
        arrays[slot] = data[start:start + size].reshape(shape)
        start += size
    return arrays
