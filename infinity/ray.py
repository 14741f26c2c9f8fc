"""Ray Data's side of the engine: `Embed`, the callable class that `Dataset.map_batches`
runs in each actor. An actor starts the model once, on its own children (tokenizer
processes, an inference process per GPU Ray gives it, or the CPU), through `LocalEncoder` on a
private event loop in a background thread; each batch adds an `embedding` column and an
`error` column (None where the row embedded), so a bad row never stops the job.

    ds.map_batches(Embed, fn_constructor_kwargs={"model": "BAAI/bge-small-en-v1.5"},
                   compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1, batch_size=1024)
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import socket
import threading
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
import numpy as np
import pyarrow as pa
import uvloop

from infinity.config import load_one_model
from infinity.corpus.encoder import Encoded, LocalEncoder
from infinity.corpus.job import converter, output_type
from infinity.corpus.sources import Columns, Rows
from infinity.shared.kinds import KINDS
from infinity.shared.vectors import shorten

T = TypeVar("T")
BATCH = 32  # inputs per request to the model, as the corpus job sends them
BATCHES_IN_FLIGHT = 16  # within the children's queue (max_queued_items), so none is refused as full


class Embed:
    """Embeds column `column` of each batch with one model, started once per actor.

    `model`: a model folder, a hub id, or a model of `config` (models.toml) by name;
    default: the config's one model, or the packaged all-MiniLM-L6-v2. `medium` "image" or
    "audio": the column holds bytes, paths (absolute, or relative to the actor's working
    directory) or URLs. `embedding_type` (float, float16, int8, uint8, binary, ubinary;
    sparse for sparse models) and `dimensions` as the corpus job takes them.

    The model goes on the GPUs Ray assigned the actor (`num_gpus`), else on the CPU; a CPU
    actor given `num_cpus` cores takes that many cores of the node no other actor holds.
    """

    def __init__(self, model: str | None = None, config: str | None = None, column: str = "text",
                 medium: str = "text", embedding_type: str | None = None, dimensions: int | None = None,
                 log_level: str = "warning") -> None:
        from infinity.folders.resolve import resolve_replicas
        from infinity.shared import shm
        from infinity.shared.devices import cpu_computes_bfloat16

        self._column, self._medium, self._dimensions = column, medium, dimensions
        loaded, model_config = load_one_model(config, model, {"log_level": log_level})
        gpus = _assigned_gpus()
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs: they are cuda:0, cuda:1, ... here.
        model_config = msgspec.structs.replace(model_config, device=[f"cuda:{i}" for i in range(gpus)] or "cpu")
        specs = resolve_replicas(model_config, loaded.server.auto_bfloat16 and cpu_computes_bfloat16())
        self._kind = KINDS[specs[0].kind]
        self._type = output_type(self._kind, medium, embedding_type, dimensions)
        shm.remove_stale()  # what actors killed on this node (ray.kill, a crash) left under /dev/shm

        self._encoder: LocalEncoder | None = None
        self._stopped = False
        self._cores = [] if gpus else _claim_cores(_assigned_cpus())
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="infinity-embed", daemon=True)
        self._thread.start()
        # Stopped at exit too: an actor torn down without collecting this object still stops its children.
        self._at_exit = functools.partial(_stop_if_alive, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            self._encoder = self._call(_started(loaded, specs))
        except BaseException:
            self.stop()
            raise
        info = self._encoder.serving
        if dimensions is not None and not 0 < dimensions <= info.dim:
            self.stop()
            raise ValueError(f"dimensions must be between 1 and {info.dim} for this model")
        self.dim: int = info.dim

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """`batch` with `embedding` (an (n, dim) array; per row an array or None for
        multi-vector and sparse models) and `error` (a string column: null, or why the row
        failed)."""
        if self._column not in batch:
            raise KeyError(f"no column {self._column!r} in the batch (columns: {', '.join(batch)})")
        rows, columns, folder = Rows(), Columns(self._column, self._medium, None), os.getcwd()
        for i, value in enumerate(batch[self._column]):
            rows.add(i, None, value, columns, folder)
        encoded = self._call(self._encode(rows))
        failed = {**rows.failed, **encoded.failed}
        # Typed string: a numpy object column of None alone would become Arrow's `null` type,
        # so files of batches without a failed row would not share one schema with the rest.
        errors = pa.array([f"{failed[i][0]}: {failed[i][1]}" if i in failed else None
                           for i in range(len(rows.inputs))], pa.string())
        return {**batch, "embedding": self._column_of(encoded, failed), "error": errors}

    def stop(self) -> None:
        """Stop the model's children and the loop; remove its /dev/shm folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self._at_exit)
        try:
            if self._encoder is not None:
                self._call(self._encoder.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            if not self._thread.is_alive():
                self._loop.close()
            for claim in self._cores:
                claim.close()

    def __del__(self) -> None:
        if hasattr(self, "_at_exit"):  # not when __init__ failed before the loop existed
            self.stop()

    def _call(self, work: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()  # type: ignore[arg-type]

    async def _encode(self, rows: Rows) -> Encoded:
        """The rows' outputs, in batches of `BATCH` inputs, `BATCHES_IN_FLIGHT` at a time."""
        assert self._encoder is not None
        return await self._encoder.encode_batches(rows.inputs, self._medium, BATCH, asyncio.Semaphore(BATCHES_IN_FLIGHT))

    def _column_of(self, encoded: Encoded, failed: dict[int, tuple[str, str]]) -> np.ndarray:
        count = len(encoded.outputs)
        good = [i for i in range(count) if i not in failed]
        if self._kind.sparse or self._kind.late_interaction:
            column = np.empty(count, dtype=object)  # rows of different sizes
            for i in good:
                column[i] = _sparse_records(encoded.outputs[i]) if self._kind.sparse \
                    else converter(self._type)(encoded.outputs[i])  # type: ignore[arg-type]
            return column
        converted = converter(self._type)(shorten(np.stack([encoded.outputs[i] for i in good])
                                                   if good else np.zeros((0, self.dim), np.float32),
                                                   self._dimensions))
        # A failed row's vector: NaN where the type has it, else zeros; its `error` says why.
        column = np.full((count, *converted.shape[1:]), np.nan if converted.dtype.kind == "f" else 0,
                         dtype=converted.dtype)
        column[good] = converted
        return column


def _sparse_records(entries: np.ndarray) -> list[dict[str, Any]]:
    """A sparse vector as records, which Arrow stores as list<struct<index, value>>, the
    corpus job's sparse column."""
    return [{"index": int(index), "value": float(value)} for index, value in zip(entries["index"], entries["value"])]


async def _started(config: Any, specs: list[Any]) -> LocalEncoder:
    # Made on the loop's thread: the children it spawns die with the thread that started them
    # (PR_SET_PDEATHSIG), and that thread lives as long as the encoder.
    encoder = LocalEncoder(config, specs)
    try:
        await encoder.start()
    except BaseException:
        await encoder.stop()
        raise
    return encoder


def _stop_if_alive(ref: weakref.ref[Embed]) -> None:
    embed = ref()
    if embed is not None:
        embed.stop()


def _assigned_gpus() -> int:
    import ray

    return len(ray.get_gpu_ids()) if ray.is_initialized() else 0


def _assigned_cpus() -> int:
    import ray

    if not ray.is_initialized():
        return 0
    return int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))


def _claim_cores(count: int) -> list[socket.socket]:
    """Pin this process (and the children it starts) to `count` cores of the node that no
    other actor has claimed, so actors on one node do not pin their children to the same
    cores. A claim is an abstract Unix socket per core: the kernel frees it when the actor
    dies, however it dies, and it leaves no file behind. Nothing is pinned when `count`
    is all the cores or more, or when too few are free."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < count < len(cpus):
        return []
    claims, cores = [], []
    for core in cpus:
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0infinity-ray-core-{core}")
        except OSError:
            claim.close()
            continue
        claims.append(claim)
        cores.append(core)
        if len(cores) == count:
            os.sched_setaffinity(0, cores)
            return claims
    for claim in claims:
        claim.close()
    return []
