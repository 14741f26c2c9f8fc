"""One run of the corpus job: plan the input, check the output folder, start the model
(on children of this process, or a running server's: `infinity.corpus.encoder`), then
embed this shard's unfinished units: a unit read ahead while others embed, at most
`UNITS_IN_FLIGHT` units and `batches_in_flight` batches at once (memory stays bounded
whatever the input's size; the reader waits for the writers), each unit's part written as
soon as its rows are done. A progress bar on a terminal, and a summary at the end."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
from tqdm import tqdm

from infinity.corpus.encoder import Encoded, Encoder
from infinity.corpus.parts import (ERRORS, JobIdentity, Output, dense_column, errors_schema, errors_table,
                                   id_columns, id_fields, matrix_column, sparse_column)
from infinity.corpus.plan import InputFile, Shard, Unit, fingerprint, input_files, plan
from infinity.corpus.sources import Columns, Rows, check_columns, read_unit
from infinity.shared.kinds import KindSpec
from infinity.shared.vectors import QUANTIZERS, shorten

# What `--embedding-type` may ask: the server's types, float16, and sparse for sparse models.
OUTPUT_TYPES = ("float", "float16", "int8", "uint8", "binary", "ubinary", "sparse")
UNITS_IN_FLIGHT = 2  # units being embedded at once; one more is read ahead


class JobError(Exception):
    """The job cannot run as asked (a bad option for this model, say)."""


class JobOptions(msgspec.Struct, frozen=True):
    """The corpus job's options (the command line's, over `models.toml`'s `[embed]`)."""

    input: str
    output: str
    columns: Columns = Columns()
    embedding_type: str | None = None  # None: "sparse" for sparse models, else "float"
    dimensions: int | None = None
    rows_per_part: int = 4096
    batch_size: int = 32
    batches_in_flight: int = 16
    shard: Shard = Shard()
    quiet: bool = False


@dataclass
class Summary:
    """What one run did (this shard's units not done before it), as printed at the end."""

    rows: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    parts: int = 0
    complete: bool = False
    output: str = ""

    def __str__(self) -> str:
        rate = self.rows / self.seconds if self.seconds else 0.0
        tokens = self.tokens / self.seconds if self.seconds else 0.0
        state = "complete" if self.complete else "this shard's parts done; other shards' parts outstanding"
        return (f"embedded {self.rows - self.errors} of {self.rows} rows ({self.errors} failed, see {ERRORS}) and "
                f"{self.tokens} tokens in {self.seconds:.1f} s: {rate:.1f} rows/s, {tokens:.0f} tokens/s; "
                f"{self.parts} parts written to {self.output} ({state})")


def run(options: JobOptions, encoder: Callable[[], Encoder]) -> Summary:
    """Run the job to the end of this shard's units on the model `encoder` makes."""
    import uvloop

    return uvloop.run(_run(options, encoder))


async def _run(options: JobOptions, make_encoder: Callable[[], Encoder]) -> Summary:
    encoder = make_encoder()
    try:
        files = input_files(options.input)
        with_ids = [check_columns(file, options.columns) for file in files]
        units = plan(files, options.rows_per_part)
        model = await encoder.identity()
        kind = encoder.kind
        embedding_type = output_type(kind, options.columns.medium, options.embedding_type, options.dimensions)
        output = Output(options.output)
        identity = JobIdentity(model, _options_identity(options, embedding_type),
                               [file.name for file in files], fingerprint(files), units)
        output.check(identity)  # before the model loads: a wrong OUTPUT is refused at once
        await encoder.start()
        serving = encoder.serving
        identity = msgspec.structs.replace(identity, model={**identity.model, "engine": serving.engine,
                                                            "dtype": serving.dtype, "dim": serving.dim})
        fields = id_fields(all(with_ids), _id_type(files, options.columns, all(with_ids)), options.columns.id)
        output.open(identity, sum(unit.rows for unit in units), errors_schema(fields))
        todo = [u for u in units if options.shard.holds(u) and u.index not in output.done()]
        output.clear_leftovers(todo)
        writer = _PartWriter(files, fields, kind, serving.dim, embedding_type, options.dimensions)
        return await _embed_units(options, encoder, output, files, all(with_ids), todo, writer)
    finally:
        await encoder.stop()


def output_type(kind: KindSpec, medium: str, wanted: str | None, dimensions: int | None) -> str:
    """The embedding type to write for a model of `kind` reading `medium` (`wanted`, or
    the kind's default), or `JobError` if the model cannot give it."""
    if "embed" not in kind.capabilities and "sparse" not in kind.capabilities:
        raise JobError(f"the model is of kind '{kind.name}', which does not embed: give an embedding model")
    wanted = wanted or ("sparse" if kind.sparse else "float")
    if wanted not in OUTPUT_TYPES:
        raise JobError(f"embedding type {wanted!r}: choose one of {', '.join(OUTPUT_TYPES)}")
    if kind.sparse != (wanted == "sparse"):
        raise JobError("a sparse model's embeddings are of type sparse" if kind.sparse
                       else f"embedding type sparse is for sparse models; this one is of kind '{kind.name}'")
    if dimensions is not None and (kind.sparse or kind.late_interaction):
        raise JobError(f"dimensions does not apply to a model of kind '{kind.name}'")
    if medium != "text" and medium != kind.medium:
        raise JobError(f"the model is of kind '{kind.name}', which does not embed {medium}")
    return wanted


def _options_identity(options: JobOptions, embedding_type: str) -> dict[str, Any]:
    """The options that change what a row's output is (not where or how fast it is made)."""
    return {"input_column": options.columns.input, "medium": options.columns.medium, "id_column": options.columns.id,
            "embedding_type": embedding_type, "dimensions": options.dimensions,
            "rows_per_part": options.rows_per_part}


def _id_type(files: list[InputFile], columns: Columns, with_ids: bool) -> pa.DataType | None:
    """The id column's type: the Parquet files' where they all agree, else (JSONL ids
    among them, or types that differ) None: strings."""
    if not with_ids or any(file.format != "parquet" for file in files):
        return None
    import pyarrow.parquet as pq

    types = {pq.ParquetFile(file.path).schema_arrow.field(columns.id).type for file in files}
    return types.pop() if len(types) == 1 else None


class _PartWriter:
    """Turns one unit's rows and outputs into its part and its errors."""

    def __init__(self, files: list[InputFile], fields: list[pa.Field], kind: KindSpec, dim: int,
                 embedding_type: str, dimensions: int | None) -> None:
        self._files, self._fields, self._kind = files, fields, kind
        self._type, self._dimensions = embedding_type, dimensions
        self._empty = np.zeros((0, dim), np.float32)  # what a unit of no embedded rows converts
        if dimensions is not None and not 0 < dimensions <= dim:
            raise JobError(f"--dimensions must be between 1 and {dim} for this model")

    def tables(self, unit: Unit, rows: Rows, encoded: Encoded) -> tuple[pa.Table, pa.Table]:
        file = self._files[unit.file]
        good = [i for i in range(len(rows.numbers)) if i not in rows.failed and i not in encoded.failed]
        bad = sorted({*rows.failed, *encoded.failed})
        reasons = {**rows.failed, **encoded.failed}
        columns = id_columns(self._fields, file, [rows.ids[i] for i in good], [rows.numbers[i] for i in good])
        embedding = self._column([encoded.outputs[i] for i in good])  # type: ignore[misc]
        columns += [embedding, pa.array([encoded.costs[i] for i in good], pa.int32()),
                    pa.array([encoded.cut[i] for i in good], pa.bool_())]
        names = [f.name for f in self._fields] + ["embedding", "tokens", "truncated"]
        embedded = pa.Table.from_arrays(columns, names=names)
        failed = errors_table(self._fields, file, [rows.ids[i] for i in bad], [rows.numbers[i] for i in bad],
                              [reasons[i] for i in bad])
        return embedded, failed

    def _column(self, outputs: list[np.ndarray]) -> pa.Array:
        if self._kind.sparse:
            return sparse_column(outputs)
        convert = converter(self._type)
        if self._kind.late_interaction:
            return matrix_column([convert(matrix) for matrix in outputs], convert(self._empty))
        rows = np.stack(outputs) if outputs else self._empty
        return dense_column(convert(shorten(rows, self._dimensions)))


def converter(embedding_type: str) -> Callable[[np.ndarray], np.ndarray]:
    """What turns float32 outputs into `embedding_type`'s values (not for sparse)."""
    if embedding_type == "float16":
        return lambda rows: np.asarray(rows, dtype=np.float16)
    return QUANTIZERS[embedding_type]


async def _embed_units(options: JobOptions, encoder: Encoder, output: Output, files: list[InputFile],
                       with_ids: bool, todo: list[Unit], writer: _PartWriter) -> Summary:
    summary = Summary(output=str(output.folder))
    started = time.monotonic()
    progress = tqdm(total=sum(u.rows for u in todo), unit="rows", dynamic_ncols=True, smoothing=0.1,
                    disable=options.quiet or not sys.stderr.isatty(), file=sys.stderr)
    batches = asyncio.Semaphore(options.batches_in_flight)
    read: asyncio.Queue[tuple[Unit, Rows] | None] = asyncio.Queue(maxsize=1)

    async def reader() -> None:
        for unit in todo:
            rows = await asyncio.to_thread(read_unit, files[unit.file], unit, options.columns, with_ids)
            await read.put((unit, rows))
        for _ in range(UNITS_IN_FLIGHT):
            await read.put(None)

    async def embedder() -> None:
        while (item := await read.get()) is not None:
            unit, rows = item
            encoded = await encoder.encode_batches(rows.inputs, options.columns.medium, options.batch_size, batches)
            embedded, failed = writer.tables(unit, rows, encoded)
            await asyncio.to_thread(output.write, unit, embedded, failed)
            manifest = await asyncio.to_thread(output.refresh)
            summary.rows += len(rows.numbers)
            summary.errors += failed.num_rows
            summary.tokens += sum(encoded.costs)
            summary.parts += 1
            summary.complete = manifest.complete
            progress.update(unit.rows)
            progress.set_postfix(tokens_s=f"{summary.tokens / max(time.monotonic() - started, 1e-9):.0f}",
                                 failed=summary.errors, refresh=False)

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(reader())
            for _ in range(UNITS_IN_FLIGHT):
                group.create_task(embedder())
    except ExceptionGroup as failed:
        # The run stops for its first failure (the model away, the server refusing the job),
        # raised as itself so that the caller tells the user why.
        raise failed.exceptions[0] from None
    finally:
        progress.close()
    if not todo:
        summary.complete = (await asyncio.to_thread(output.refresh)).complete
    summary.seconds = time.monotonic() - started
    return summary

