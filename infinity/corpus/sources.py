"""Reading one unit of the corpus: each row's id and input, and the rows that cannot be
embedded as they arrive (no input, an empty one, not a string, a line that is not a JSON
object, a media file that cannot be read), each with an error kind and a message. Only a
unit's rows are held: a Parquet row group is read column by column and sliced, a JSONL
file is read from the unit's first line (by seeking where it is not compressed)."""

from __future__ import annotations

import io
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from infinity.corpus.plan import InputFile, PlanError, Unit

# Why a row failed on arrival (the model's own refusals come as ErrorKind values).
MISSING = "missing_input"
EMPTY = "empty_input"
WRONG_TYPE = "wrong_type"
BAD_LINE = "invalid_json"
UNREADABLE = "unreadable_media"


class Columns(msgspec.Struct, frozen=True):
    """What the job reads of each row: its input from column `input` (a text, or for
    `medium` "image"/"audio" a path, URL, data: URI or the bytes), its id from column `id`
    (None: rows are named by their file and row number)."""

    input: str = "text"
    medium: str = "text"
    id: str | None = "id"


@dataclass
class Rows:
    """One unit's rows: row numbers in the file, ids, inputs (None for a failed row), and
    the failed rows' (error kind, message) by position."""

    numbers: list[int] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    inputs: list[str | bytes | None] = field(default_factory=list)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)

    def add(self, number: int, row_id: Any, value: Any, columns: Columns, folder: str) -> None:
        position = len(self.numbers)
        self.numbers.append(number)
        self.ids.append(row_id)
        checked = _checked(value, columns, folder)
        if isinstance(checked, tuple):
            self.failed[position] = checked
            self.inputs.append(None)
        else:
            self.inputs.append(checked)

    def fail(self, position: int, kind: str, message: str) -> None:
        self.failed[position] = (kind, message)
        self.inputs[position] = None


def check_columns(file: InputFile, columns: Columns) -> bool:
    """Whether `file` has the id column (a Parquet file without the input column is an
    error; a JSONL file has it if its first record does: the others say for themselves)."""
    if columns.id is None:
        return False
    if file.format != "parquet":
        return _first_record_has(file, columns.id)
    names = pq.ParquetFile(file.path).schema_arrow.names
    if columns.input not in names:
        raise PlanError(f"{file.name} has no column '{columns.input}' (its columns: {', '.join(names)}); "
                        f"name the input column with --{columns.medium}-column")
    return columns.id in names


def _first_record_has(file: InputFile, key: str) -> bool:
    """Whether the first line of a JSONL file that is not blank is an object with `key`
    (one that is not JSON, or not an object, says nothing against it)."""
    with io.BufferedReader(pa.input_stream(file.path, compression=file.compression)) as stream:
        for line in stream:
            if line.strip():
                try:
                    record = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    return True
                return not isinstance(record, dict) or key in record
    return True


def read_unit(file: InputFile, unit: Unit, columns: Columns, with_ids: bool) -> Rows:
    """The rows of `unit`; `with_ids`: the file has the id column (else ids are row numbers)."""
    if file.format == "parquet":
        return _parquet_rows(file, unit, columns, with_ids)
    return _jsonl_rows(file, unit, columns, with_ids)


def _parquet_rows(file: InputFile, unit: Unit, columns: Columns, with_ids: bool) -> Rows:
    wanted = [columns.input] + ([columns.id] if with_ids and columns.id != columns.input else [])
    table = pq.ParquetFile(file.path).read_row_group(unit.row_group, columns=wanted)
    table = table.slice(unit.row_in_group, unit.rows)
    values = table.column(columns.input).to_pylist()
    ids = table.column(columns.id).to_pylist() if with_ids else None
    rows, folder = Rows(), os.path.dirname(file.path)
    for i, value in enumerate(values):
        number = unit.first_row + i
        rows.add(number, ids[i] if ids is not None else number, value, columns, folder)
    return rows


def _jsonl_rows(file: InputFile, unit: Unit, columns: Columns, with_ids: bool) -> Rows:
    rows, folder = Rows(), os.path.dirname(file.path)
    with _lines_from(file, unit) as stream:
        for i, line in enumerate(itertools.islice(stream, unit.rows)):
            number = unit.first_row + i
            if not line.strip():
                continue  # a blank line is no row
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                rows.add(number, None, None, columns, folder)
                rows.fail(len(rows.numbers) - 1, BAD_LINE, f"line {number + 1} is not JSON: {exc}")
                continue
            if not isinstance(record, dict):
                rows.add(number, None, None, columns, folder)
                rows.fail(len(rows.numbers) - 1, BAD_LINE, f"line {number + 1} is not a JSON object")
                continue
            row_id = _jsonl_id(record.get(columns.id)) if with_ids else number
            rows.add(number, row_id, record.get(columns.input), columns, folder)
    return rows


def _jsonl_id(value: Any) -> str | None:
    """A JSONL row's id as the output writes it: a string (a number as its digits)."""
    if value is None or isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode()


def _lines_from(file: InputFile, unit: Unit) -> io.BufferedIOBase:
    """`file`'s lines from the unit's first one."""
    if file.compression is None:
        stream = open(file.path, "rb")
        stream.seek(unit.offset or 0)
        return stream
    stream = io.BufferedReader(pa.input_stream(file.path, compression=file.compression))
    for _ in itertools.islice(stream, unit.first_row):
        pass
    return stream


def _checked(value: Any, columns: Columns, folder: str) -> str | bytes | tuple[str, str]:
    """The input `value` as the model takes it, or why it cannot be embedded."""
    if value is None:
        return MISSING, f"no {columns.input}"
    if columns.medium == "text":
        if not isinstance(value, str):
            return WRONG_TYPE, f"{columns.input} is a {type(value).__name__}, not a string"
        return value if value else (EMPTY, f"{columns.input} is empty")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value) if len(value) else (EMPTY, f"{columns.input} is empty")
    if not isinstance(value, str):
        return WRONG_TYPE, f"{columns.input} is a {type(value).__name__}, not a path, URL or bytes"
    if not value:
        return EMPTY, f"{columns.input} is empty"
    if value.startswith(("http://", "https://", "data:")):
        return value  # fetched (or decoded) on the way to the model
    path = value if os.path.isabs(value) else os.path.join(folder, value)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        return UNREADABLE, f"{value}: {exc.strerror or exc}"
