"""The corpus job's output folder, and the rules that make a job resumable and shardable:

    OUTPUT/manifest.json              the job: model, options, input fingerprint, plan, parts done
    OUTPUT/part-000042.parquet        unit 42's embedded rows, in input order
    OUTPUT/errors/part-000042.parquet unit 42's failed rows (id, error kind, message)
    OUTPUT/errors.parquet             every failed row, once every unit is done

A unit's files are written under a temporary name and renamed into place, the errors
first: a part that exists is finished, and is never written again. Its rows are in the
part or in its errors, each once. The manifest is written once, when the job starts, and
refreshed as parts finish; a run against an OUTPUT whose manifest names another model,
other options or another input is refused before anything is written."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from infinity.corpus.plan import InputFile, Unit

MANIFEST = "manifest.json"
ERRORS = "errors.parquet"
MANIFEST_VERSION = 1


class OutputError(Exception):
    """OUTPUT holds another job, or cannot hold this one."""


class JobIdentity(msgspec.Struct, frozen=True):
    """What makes two runs the same job: the model (name, folder digest, engine, dtype),
    every option that changes a row's output, and the input (its files, fingerprint and
    plan)."""

    model: dict[str, Any]
    options: dict[str, Any]
    files: list[str]
    fingerprint: str
    units: list[Unit]


class Manifest(msgspec.Struct):
    version: int
    job: JobIdentity
    rows: int  # rows in the input (blank JSONL lines included)
    finished: list[int]  # units whose part exists (as this process last saw the folder)
    complete: bool = False


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class Output:
    """The output folder of one job."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise OutputError(f"{folder} exists and is not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "errors").mkdir(exist_ok=True)
        # Temporary names are this process's own: shards on other machines share the folder.
        self._stamp = f"{socket.gethostname()}-{os.getpid()}"
        self._refreshing = threading.Lock()  # units finishing at once refresh one after the other

    def check(self, identity: JobIdentity) -> None:
        """Refuse if the folder holds a job other than `identity` (of whose model only the
        keys `identity` has are compared: before the model loads, its engine and dtype are
        not known)."""
        path = self.folder / MANIFEST
        if not path.exists():
            return
        try:
            found = msgspec.json.decode(path.read_bytes(), type=Manifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise OutputError(f"{path} cannot be read ({exc}); it is not a manifest of this version") from None
        found_job = msgspec.structs.replace(found.job, model={k: found.job.model.get(k) for k in identity.model})
        differences = _differences(found_job, identity)
        if differences:
            raise OutputError(f"{self.folder} holds another job ({'; '.join(differences)}); nothing was "
                              "written. Give another OUTPUT, or remove this one to start over")

    def open(self, identity: JobIdentity, rows: int, errors: pa.Schema) -> None:
        """Start or resume the job `identity` here (its failed rows have the columns of
        `errors`); refuse if the folder holds another."""
        self.check(identity)
        if not (self.folder / MANIFEST).exists():
            self._write_manifest(Manifest(MANIFEST_VERSION, identity, rows, []))
        self._identity, self._rows, self._errors = identity, rows, errors

    def done(self) -> set[int]:
        """The units whose part exists."""
        return {int(p.name[5:11]) for p in self.folder.glob("part-??????.parquet")}

    def clear_leftovers(self, units: list[Unit]) -> None:
        """Remove what a killed run left of `units` (temporary files, errors of an
        unfinished part): they are this process's to write now. And any temporary file
        (the manifest's, errors.parquet's) of a process of this machine that has ended."""
        for unit in units:
            name = part_name(unit.index)
            for leftover in (*glob.glob(str(self.folder / f".{name}.*.tmp")),
                             *glob.glob(str(self.folder / "errors" / f".{name}.*.tmp"))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        host = socket.gethostname()
        for leftover in (*self.folder.glob(".*.tmp"), *(self.folder / "errors").glob(".*.tmp")):
            found = re.fullmatch(rf"\..+\.{re.escape(host)}-(\d+)\.tmp", leftover.name)
            if found and not _alive(int(found[1])):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)

    def write(self, unit: Unit, embedded: pa.Table, failed: pa.Table) -> None:
        """Write unit's parts: its errors, then its embedded rows (the part that marks it done)."""
        name = part_name(unit.index)
        self._write_table(failed, self.folder / "errors" / name)
        self._write_table(embedded, self.folder / name)

    def refresh(self) -> Manifest:
        """Record the finished parts in the manifest; once every unit is done, gather the
        errors into `errors.parquet` and mark the job complete (any process may: the
        result is the same)."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> Manifest:
        done = self.done()
        units = self._identity.units
        complete = all(unit.index in done for unit in units)
        if complete and not (self.folder / ERRORS).exists():
            tables = [pq.read_table(self.folder / "errors" / part_name(u.index)) for u in units]
            self._write_table(pa.concat_tables(tables) if tables else self._errors.empty_table(),
                              self.folder / ERRORS)
        manifest = Manifest(MANIFEST_VERSION, self._identity, self._rows, sorted(done), complete)
        self._write_manifest(manifest)
        return manifest

    def _write_manifest(self, manifest: Manifest) -> None:
        temporary = self.folder / f".{MANIFEST}.{self._stamp}.tmp"
        temporary.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        os.replace(temporary, self.folder / MANIFEST)

    def _write_table(self, table: pa.Table, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.{self._stamp}.tmp")
        pq.write_table(table, temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _differences(found: JobIdentity, wanted: JobIdentity) -> list[str]:
    """What differs between the job in a folder and the one asked for, in words."""
    said = []
    for key in sorted(set(found.model) | set(wanted.model)):
        if found.model.get(key) != wanted.model.get(key):
            said.append(f"model {key}: {found.model.get(key)!r} there, {wanted.model.get(key)!r} now")
    for key in sorted(set(found.options) | set(wanted.options)):
        if found.options.get(key) != wanted.options.get(key):
            said.append(f"{key}: {found.options.get(key)!r} there, {wanted.options.get(key)!r} now")
    if found.files != wanted.files or found.fingerprint != wanted.fingerprint:
        said.append("the input differs (its files or their contents)")
    elif found.units != wanted.units:
        said.append("the input is cut into other parts")
    return said


def id_fields(with_ids: bool, id_type: pa.DataType | None, id_column: str | None) -> list[pa.Field]:
    """The columns that name a row: the input's id column, or its file and row number."""
    if with_ids:
        return [pa.field(id_column, id_type or pa.string())]
    return [pa.field("file", pa.string()), pa.field("row", pa.int64())]


def id_columns(fields: list[pa.Field], file: InputFile, ids: list[Any], numbers: list[int]) -> list[pa.Array]:
    """The id columns' values for rows `numbers` of `file` with `ids`."""
    if fields[0].name == "file" and len(fields) == 2:
        return [pa.array([file.name] * len(numbers), pa.string()), pa.array(numbers, pa.int64())]
    if pa.types.is_string(fields[0].type):  # ids of several types (JSONL's and Parquet's): as text
        ids = [i if i is None or isinstance(i, str) else msgspec.json.encode(i).decode() for i in ids]
    return [pa.array(ids, fields[0].type)]


def errors_schema(fields: list[pa.Field]) -> pa.Schema:
    """Failed rows' columns: their id columns, their file and row number, the error kind
    and message."""
    place = [] if [f.name for f in fields] == ["file", "row"] else [pa.field("file", pa.string()),
                                                                     pa.field("row", pa.int64())]
    return pa.schema([*fields, *place, pa.field("error", pa.string()), pa.field("message", pa.string())])


def errors_table(fields: list[pa.Field], file: InputFile, ids: list[Any], numbers: list[int],
                 failures: list[tuple[str, str]]) -> pa.Table:
    """The failed rows `numbers` of `file` with `ids`, and why each failed."""
    schema = errors_schema(fields)
    columns = id_columns(fields, file, ids, numbers)
    if len(schema) > len(fields) + 2:
        columns += [pa.array([file.name] * len(numbers), pa.string()), pa.array(numbers, pa.int64())]
    columns += [pa.array([kind for kind, _ in failures], pa.string()),
                pa.array([message for _, message in failures], pa.string())]
    return pa.Table.from_arrays(columns, schema=schema)


def dense_column(rows: np.ndarray) -> pa.Array:
    """(n, width) values as `fixed_size_list<type>[width]`."""
    width = rows.shape[1] if rows.ndim == 2 else 0
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(rows).reshape(-1)), width)


def matrix_column(matrices: list[np.ndarray], empty: np.ndarray) -> pa.Array:
    """Per row a (tokens, width) matrix, as `list<fixed_size_list<type>[width]>`; `empty`:
    a (0, width) array of the type, what no rows give."""
    lengths = np.fromiter((len(m) for m in matrices), dtype=np.int32, count=len(matrices))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    stacked = np.concatenate(matrices) if matrices else empty
    return pa.ListArray.from_arrays(pa.array(offsets), dense_column(stacked))


SPARSE_TYPE = pa.list_(pa.struct([pa.field("index", pa.int32()), pa.field("value", pa.float32())]))


def sparse_column(vectors: list[np.ndarray]) -> pa.Array:
    """Per row its nonzero entries (records of `index`, `value`), as
    `list<struct<index: int32, value: float32>>`."""
    lengths = np.fromiter((len(v) for v in vectors), dtype=np.int32, count=len(vectors))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    entries = np.concatenate(vectors) if vectors else np.zeros(0, [("index", "<i4"), ("value", "<f4")])
    values = pa.StructArray.from_arrays([pa.array(entries["index"].astype(np.int32)),
                                         pa.array(entries["value"].astype(np.float32))], ["index", "value"])
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=SPARSE_TYPE)
