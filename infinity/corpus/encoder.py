"""Embedding inputs in batches for code that is not a server: the corpus job, Ray Data's
actors. A batch the model refuses is tried again row by row, so that a bad row (too long
with truncation off, an image that does not decode, one that stops the inference process)
fails alone and the others are embedded. A model that is loading, full or restarting is
waited for; one that stays away stops the caller (`ModelUnavailable`), never fails rows.

`Encoder` owns that; what runs one batch is its subclass's: `LocalEncoder` here (the model
on children of this process, as `serve` runs them), `ServerEncoder` in
`infinity.corpus.remote` (a running server's `/v1/embeddings`)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infinity.api.long_inputs import chunk_means
from infinity.api.media_fetch import MediaFetcher
from infinity.client.engine_client import EngineClient, ModelInputs, ServingError
from infinity.client.topology import ServedModel
from infinity.config import Config, MediaConfig
from infinity.shared.folders import folder_digest
from infinity.shared.kinds import KINDS, KindSpec
from infinity.shared.protocol import ErrorKind, ModelSpec
from infinity.shared.vectors import largest

# Kinds that say nothing of the inputs: wait for the model and try again.
TRANSIENT = {ErrorKind.OVERLOADED, ErrorKind.MODEL_NOT_READY, ErrorKind.NOT_READY}
READY_TIMEOUT_S = 600.0  # how long a model (or its server) may stay away before the caller stops
# A model's settings that change its vectors, in the corpus job's manifest beside its name,
# kind and content hash: `ModelSpec`'s fields and a server's model card's keys alike.
VECTOR_SETTINGS = ("max_length", "long_inputs", "pooling", "normalize")


class ModelUnavailable(Exception):
    """The model stayed unavailable (loading, full, its server down) for `READY_TIMEOUT_S`:
    the job stops with its finished parts kept, to be resumed by running it again."""


@dataclass(frozen=True)
class Serving:
    """What serves the model, as the corpus job's manifest records it."""

    engine: str
    dtype: str
    dim: int


@dataclass(frozen=True)
class Batch:
    """One batch's answer, by input: its output, what it cost (tokens), and the positions cut."""

    outputs: list[np.ndarray]
    costs: list[int]
    cut: set[int]


@dataclass
class Encoded:
    """Per input, in order: its output (a vector, a matrix, sparse entries; None if it
    failed), what it cost (tokens), whether it was cut to the model's maximum length; and
    the failed ones' (error kind, message) by position."""

    outputs: list[np.ndarray | None] = field(default_factory=list)
    costs: list[int] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, count: int) -> Encoded:
        """`count` inputs, none encoded yet."""
        return cls([None] * count, [0] * count, [False] * count)

    def take(self, positions: list[int], outputs: list[np.ndarray | None], costs: list[int],
             cut: list[bool]) -> None:
        """Record the outputs of the inputs at `positions`, in that order."""
        for j, position in enumerate(positions):
            self.outputs[position], self.costs[position], self.cut[position] = outputs[j], costs[j], cut[j]


class Encoder(ABC):
    """One embedding model, however it is served: inputs in batches, a refused batch
    retried row by row, a model away waited for."""

    def __init__(self, media: MediaConfig) -> None:
        self._media = media
        self._fetcher = MediaFetcher(media)

    @property
    @abstractmethod
    def kind(self) -> KindSpec:
        """The model's kind (`infinity.shared.kinds`)."""

    @abstractmethod
    async def identity(self) -> dict[str, Any]:
        """What ties an output to this model (its name, kind, content hash and the settings
        that change its vectors), for the corpus job's manifest; asked before `start`."""

    @property
    @abstractmethod
    def serving(self) -> Serving:
        """The engine, precision and width the model is served with (after `start`)."""

    @abstractmethod
    async def start(self) -> None:
        """Return once the model serves."""

    async def stop(self) -> None:
        await self._fetcher.close()

    @abstractmethod
    async def _once(self, inputs: list[str | bytes], medium: str) -> Batch:
        """Run `inputs` once, or raise the `ServingError` of why not."""

    @abstractmethod
    async def _ready(self) -> None:
        """Return once the model may take inputs again (or soon may: the caller tries
        again until `READY_TIMEOUT_S` has passed)."""

    async def encode(self, inputs: list[str | bytes], medium: str = "text") -> Encoded:
        """The outputs of `inputs`: texts, or for `medium` "image"/"audio" the bytes of each
        (or an http(s) URL or data: URI)."""
        encoded = Encoded.of(len(inputs))
        if medium != "text":
            inputs = await self._fetched(inputs, encoded)
        positions = [i for i in range(len(inputs)) if i not in encoded.failed]
        await self._encode_into(encoded, positions, [inputs[i] for i in positions], medium)
        return encoded

    async def encode_batches(self, inputs: list[str | bytes | None], medium: str, batch_size: int,
                             slots: asyncio.Semaphore) -> Encoded:
        """`encode` over `inputs` (None: a row that failed before, skipped) in batches of
        `batch_size`, each run while it holds one of `slots` (shared by the caller's other
        work, so that what is in flight stays bounded)."""
        positions = [i for i, value in enumerate(inputs) if value is not None]
        if medium == "text":
            # Texts of like length batched together: an engine that pads a batch to its
            # longest input then computes little padding.
            positions.sort(key=lambda i: len(inputs[i]))  # type: ignore[arg-type]
        chunks = [positions[i:i + batch_size] for i in range(0, len(positions), batch_size)]

        async def batch(chunk: list[int]) -> Encoded:
            async with slots:
                return await self.encode([inputs[i] for i in chunk], medium)  # type: ignore[misc]

        merged = Encoded.of(len(inputs))
        for chunk, result in zip(chunks, await asyncio.gather(*(batch(chunk) for chunk in chunks))):
            merged.take(chunk, result.outputs, result.costs, result.cut)
            merged.failed.update({chunk[j]: reason for j, reason in result.failed.items()})
        return merged

    async def _fetched(self, inputs: list[str | bytes], encoded: Encoded) -> list[str | bytes]:
        """Media inputs as bytes: URLs fetched (a failure fails that row), data: URIs as sent."""
        fetched = list(inputs)
        limit = self._media.max_bytes(self.kind.medium)
        for i, item in enumerate(inputs):
            if isinstance(item, str) and item.startswith("data:"):
                fetched[i] = item.encode("ascii", "replace")
            elif isinstance(item, str):
                try:
                    fetched[i] = await self._fetcher.fetch(item, item, limit)
                except ServingError as exc:
                    encoded.failed[i] = (exc.kind.value, exc.message)
        return fetched

    async def _encode_into(self, encoded: Encoded, positions: list[int], inputs: list[str | bytes],
                           medium: str) -> None:
        if not inputs:
            return
        try:
            batch = await self._run(inputs, medium, retry_crash=len(inputs) == 1)
        except ServingError as exc:
            if len(inputs) == 1:
                encoded.failed[positions[0]] = (exc.kind.value, exc.message)
                return
            await asyncio.gather(*(self._encode_into(encoded, [p], [item], medium)
                                   for p, item in zip(positions, inputs)))
            return
        encoded.take(positions, batch.outputs, batch.costs, [j in batch.cut for j in range(len(positions))])

    async def _run(self, inputs: list[str | bytes], medium: str, retry_crash: bool) -> Batch:
        """Run `inputs`; the model not ready or full, wait and run again; an inference
        process that died under them, once more if `retry_crash` (a lone input: was it the
        input, or the process?)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        crashed = False
        while True:
            try:
                return await self._once(inputs, medium)
            except ServingError as exc:
                retry_crashed = exc.kind == ErrorKind.WORKER_DIED and retry_crash and not crashed
                if exc.kind not in TRANSIENT and not retry_crashed:
                    raise
                crashed |= retry_crashed
                if loop.time() > deadline:
                    raise ModelUnavailable(f"the model stayed unavailable for {READY_TIMEOUT_S:g} s: {exc.message}; "
                                           "run the same command again to resume") from None
                await self._ready()


class LocalEncoder(Encoder):
    """One model of `config` (`specs`: its replicas) served by children of this process."""

    def __init__(self, config: Config, specs: list[ModelSpec]) -> None:
        super().__init__(config.media)
        self._client = EngineClient(config.server, specs, media=config.media)
        self.model: ServedModel = self._client.models[specs[0].name]

    @property
    def kind(self) -> KindSpec:
        return KINDS[self.model.spec.kind]

    async def identity(self) -> dict[str, Any]:
        spec = self.model.spec
        return {"name": spec.name, "kind": spec.kind, "digest": await asyncio.to_thread(folder_digest, spec.path),
                **{setting: getattr(spec, setting) for setting in VECTOR_SETTINGS}}

    @property
    def serving(self) -> Serving:
        info = self.model.info
        assert info is not None, "start() first"
        return Serving(info.engine, info.dtype, info.dim)

    async def start(self) -> None:
        await self._client.start()

    async def stop(self) -> None:
        await super().stop()
        await self._client.stop()

    async def _once(self, inputs: list[str | bytes], medium: str) -> Batch:
        model_inputs = ModelInputs(texts=inputs) if medium == "text" else ModelInputs(media=inputs)  # type: ignore[arg-type]
        result = await self._client.run(self.model, model_inputs)
        try:
            # A chunked input's vector is its chunks' mean, as /v1/embeddings answers it.
            outputs = [np.array(row) for row in (result.rows() if result.chunks is None
                                                 else chunk_means(result, self.model.spec.normalize))]
        finally:
            result.release()
        if self.kind.sparse and self.model.spec.max_active_dims is not None:
            outputs = [largest(entries, self.model.spec.max_active_dims) for entries in outputs]
        return Batch(outputs, result.input_costs, set(result.cut))

    async def _ready(self) -> None:
        await asyncio.sleep(0.05)
        for _ in range(10):
            if self.model.ready and self._client.ready:
                return
            await asyncio.sleep(0.1)
