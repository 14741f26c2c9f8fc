"""A model on its own children (tokenizer processes, an inference process per device),
for code that is not a server: the corpus job, Ray Data's actors. Inputs go in as a batch;
a batch the model refuses is tried again row by row, so that a bad row (too long with
truncation off, an image that does not decode, one that stops the inference process)
fails alone and the others are embedded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from infinity.api.long_inputs import chunk_means
from infinity.api.media_fetch import MediaFetcher
from infinity.client.engine_client import EngineClient, ModelInputs, ServingError
from infinity.client.topology import ServedModel
from infinity.config import Config
from infinity.shared.protocol import ErrorKind, ModelInfo, ModelSpec

# Kinds that say nothing of the inputs: wait for the model and try again.
TRANSIENT = {ErrorKind.OVERLOADED, ErrorKind.MODEL_NOT_READY, ErrorKind.NOT_READY}
_READY_TIMEOUT_S = 600.0
_TRANSIENT_TRIES = 20


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


class Encoder:
    """One model of `config` (`specs`: its replicas) served by children of this process."""

    def __init__(self, config: Config, specs: list[ModelSpec]) -> None:
        self._config = config
        self._client = EngineClient(config.server, specs, media=config.media)
        self._fetcher = MediaFetcher(config.media)
        self.model: ServedModel = self._client.models[specs[0].name]

    async def start(self) -> None:
        await self._client.start()

    async def stop(self) -> None:
        await self._fetcher.close()
        await self._client.stop()

    @property
    def info(self) -> ModelInfo:
        assert self.model.info is not None, "start() first"
        return self.model.info

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
        limit = self._config.media.max_bytes(self.model.kind.medium)
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
            result = await self._run(inputs, medium, retry_crash=len(inputs) == 1)
        except ServingError as exc:
            if len(inputs) == 1:
                encoded.failed[positions[0]] = (exc.kind.value, exc.message)
                return
            await asyncio.gather(*(self._encode_into(encoded, [p], [item], medium)
                                   for p, item in zip(positions, inputs)))
            return
        outputs, costs, cut = result
        encoded.take(positions, outputs, costs, [j in cut for j in range(len(positions))])

    async def _run(self, inputs: list[str | bytes], medium: str,
                   retry_crash: bool) -> tuple[list[np.ndarray], list[int], set[int]]:
        """Run `inputs` once; the model not ready or full, wait and run again; an inference
        process that died under them, once more if `retry_crash` (a lone input: was it the
        input, or the process?)."""
        model_inputs = ModelInputs(texts=inputs) if medium == "text" else ModelInputs(media=inputs)  # type: ignore[arg-type]
        crashes = 0
        for _ in range(_TRANSIENT_TRIES):
            try:
                result = await self._client.run(self.model, model_inputs)
            except ServingError as exc:
                if exc.kind in TRANSIENT or (exc.kind == ErrorKind.WORKER_DIED and retry_crash and crashes == 0):
                    crashes += exc.kind == ErrorKind.WORKER_DIED
                    await self._ready()
                    continue
                raise
            try:
                # A chunked input's vector is its chunks' mean, as /v1/embeddings answers it.
                outputs = [np.array(row) for row in (result.rows() if result.chunks is None
                                                     else chunk_means(result, self.model.spec.normalize))]
            finally:
                result.release()
            return outputs, result.input_costs, set(result.cut)
        raise ServingError(ErrorKind.NOT_READY, f"model '{self.model.spec.name}' stayed unavailable")

    async def _ready(self) -> None:
        """Wait until every replica of the model serves again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _READY_TIMEOUT_S
        await asyncio.sleep(0.05)
        while not (self.model.ready and self._client.ready):
            if loop.time() > deadline:
                raise ServingError(ErrorKind.NOT_READY, f"model '{self.model.spec.name}' did not come back "
                                                        f"within {_READY_TIMEOUT_S:g} s")
            await asyncio.sleep(0.1)
