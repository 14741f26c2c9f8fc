"""The corpus job's units of work. The input (a file, a folder, or a glob) is a sorted list
of Parquet and JSONL files; each file is cut into units of at most `rows_per_part` rows
(slices of a Parquet row group; line ranges of a JSONL file, with the byte offset of the
first line where the file is not compressed). Units are numbered in file order, and unit i
belongs to shard `i % N`: the same input and `rows_per_part` give every run and every
shard the same plan."""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

# What a file's name ends with -> (its format, its compression as pyarrow names it).
SUFFIXES = {
    ".parquet": ("parquet", None),
    ".jsonl": ("jsonl", None), ".ndjson": ("jsonl", None), ".json": ("jsonl", None),
    ".jsonl.gz": ("jsonl", "gzip"), ".ndjson.gz": ("jsonl", "gzip"), ".json.gz": ("jsonl", "gzip"),
    ".jsonl.zst": ("jsonl", "zstd"), ".ndjson.zst": ("jsonl", "zstd"), ".json.zst": ("jsonl", "zstd"),
}
_SCAN_BYTES = 1 << 20
_FINGERPRINT_BYTES = 1 << 20


class PlanError(Exception):
    """The input cannot be read as a corpus (no such file, no supported file, a bad file)."""


class InputFile(msgspec.Struct, frozen=True):
    """One file of the input: `name` is its path relative to the input's folder (what
    output rows and the manifest call it), `path` where it is on this machine."""

    name: str
    path: str
    format: str  # "parquet" or "jsonl"
    compression: str | None = None  # "gzip", "zstd"


class Unit(msgspec.Struct, frozen=True):
    """Rows `first_row` to `first_row + rows` of file number `file` (its index in the
    plan's files), the source of output part `index`."""

    index: int
    file: int
    first_row: int
    rows: int
    row_group: int | None = None  # Parquet: the row group, and where in it the unit starts
    row_in_group: int = 0
    offset: int | None = None  # uncompressed JSONL: the byte offset of the unit's first line


class Shard(msgspec.Struct, frozen=True):
    """Shard `k` of `n` (0 <= k < n): the units whose index is `k` modulo `n`."""

    k: int = 0
    n: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`K/N` as the command line gives it."""
        try:
            k, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise PlanError(f"--shard takes K/N (e.g. 0/4), not {text!r}") from None
        if not 0 <= k < n:
            raise PlanError(f"--shard {text}: K must be at least 0 and less than N")
        return cls(k, n)

    def holds(self, unit: Unit) -> bool:
        return unit.index % self.n == self.k


def format_of(path: str) -> tuple[str, str | None] | None:
    """(format, compression) of a file by its name, or None for a file the job does not read."""
    name = path.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def input_files(source: str) -> list[InputFile]:
    """The files `source` names: one file, the supported files below a folder, or those a
    glob matches; sorted by name."""
    if os.path.isdir(source):
        root = Path(source)
        paths = [str(p) for p in root.rglob("*") if p.is_file() and format_of(str(p)) is not None]
    elif os.path.isfile(source):
        root, paths = Path(source).parent, [source]
    else:
        paths = [p for p in glob.glob(source, recursive=True) if os.path.isfile(p) and format_of(p) is not None]
        root = Path(os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])) if paths else Path()
    files = []
    for path in sorted(paths):
        found = format_of(path)
        if found is None:
            raise PlanError(f"{path}: not a Parquet or JSONL file (.parquet, .jsonl, .jsonl.gz, .jsonl.zst)")
        name = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
        files.append(InputFile(name, os.path.abspath(path), *found))
    if not files:
        raise PlanError(f"{source}: no Parquet or JSONL file there")
    return files


def plan(files: list[InputFile], rows_per_part: int) -> list[Unit]:
    """Every unit of `files`, numbered in order."""
    units: list[Unit] = []
    for number, file in enumerate(files):
        try:
            if file.format == "parquet":
                units += _parquet_units(file, number, rows_per_part, len(units))
            else:
                units += _jsonl_units(file, number, rows_per_part, len(units))
        except (OSError, pa.ArrowException) as exc:
            raise PlanError(f"{file.path}: cannot be read: {exc}") from None
    return units


def _parquet_units(file: InputFile, number: int, rows_per_part: int, first_index: int) -> list[Unit]:
    metadata = pq.ParquetFile(file.path).metadata
    units, first_row = [], 0
    for group in range(metadata.num_row_groups):
        size = metadata.row_group(group).num_rows
        for start in range(0, size, rows_per_part):
            rows = min(rows_per_part, size - start)
            units.append(Unit(first_index + len(units), number, first_row + start, rows, group, start))
        first_row += size
    return units


def _jsonl_units(file: InputFile, number: int, rows_per_part: int, first_index: int) -> list[Unit]:
    """Line ranges of `rows_per_part` lines (a blank line counts, and is skipped when read);
    for an uncompressed file, with the byte offset of each range's first line."""
    starts = [0]  # byte offset of every rows_per_part-th line
    lines, position, last = 0, 0, b"\n"
    with pa.input_stream(file.path, compression=file.compression) as stream:
        while chunk := stream.read(_SCAN_BYTES):
            at = 0
            while (found := chunk.find(b"\n", at)) != -1:
                lines += 1
                at = found + 1
                if lines % rows_per_part == 0:
                    starts.append(position + at)
            position += len(chunk)
            last = chunk[-1:]
    if last != b"\n":
        lines += 1  # a last line without its newline
    units = []
    for n, start in enumerate(range(0, lines, rows_per_part)):
        offset = starts[n] if file.compression is None else None
        units.append(Unit(first_index + n, number, start, min(rows_per_part, lines - start), offset=offset))
    return units


def fingerprint(files: list[InputFile]) -> str:
    """A digest of the input: each file's name, size, first and last MiB. Cheap on a large
    corpus, and it tells a changed or replaced file from the one a job started on."""
    digest = hashlib.sha256()
    for file in files:
        size = os.path.getsize(file.path)
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file.path, "rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            if size > _FINGERPRINT_BYTES:
                f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
                digest.update(f.read())
    return digest.hexdigest()
