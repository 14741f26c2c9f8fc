"""The corpus job's plan and readers (infinity/corpus/plan.py, sources.py): which files an
INPUT names, how each file is cut into units and units into shards (every row in exactly
one shard, whatever the format, compression, trailing newline or blank lines), the JSONL
byte offsets, and what `read_unit` makes of each row (ids, row numbers, failed rows)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from infinity.corpus import sources
from infinity.corpus.plan import InputFile, PlanError, Shard, Unit, fingerprint, input_files, plan
from infinity.corpus.sources import Columns, check_columns, read_unit

ROWS = 53  # not a multiple of any rows_per_part below


def _write_parquet(path: Path, count: int = ROWS, row_group_size: int = 10) -> Path:
    table = pa.table({"id": [f"p{i}" for i in range(count)], "text": [f"text {i}" for i in range(count)]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _jsonl_bytes(count: int, blank_every: int = 0, trailing_newline: bool = True) -> bytes:
    """`count` records (ids j0, j1, ...), a blank line after every `blank_every`-th."""
    lines = []
    for i in range(count):
        lines.append(json.dumps({"id": f"j{i}", "text": f"text {i}"}))
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("   " if i % 2 else "")
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    return text.encode()


def _write_jsonl(path: Path, data: bytes) -> Path:
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        with pa.output_stream(str(path), compression="zstd") as stream:
            stream.write(data)
    else:
        path.write_bytes(data)
    return path


def _ids_of(files: list[InputFile], units: list[Unit], columns: Columns = Columns()) -> list[object]:
    ids = []
    for unit in units:
        file = files[unit.file]
        rows = read_unit(file, unit, columns, check_columns(file, columns))
        assert not rows.failed, rows.failed
        ids += rows.ids
    return ids


CASES = {
    "parquet, row groups of 10": ("corpus.parquet", None),
    "jsonl": ("corpus.jsonl", dict(trailing_newline=True)),
    "jsonl, no trailing newline": ("corpus.jsonl", dict(trailing_newline=False)),
    "jsonl, blank lines": ("corpus.jsonl", dict(blank_every=4)),
    "jsonl.gz, blank lines, no trailing newline": ("corpus.jsonl.gz", dict(blank_every=5, trailing_newline=False)),
    "jsonl.gz": ("corpus.jsonl.gz", dict()),
    "jsonl.zst, blank lines": ("corpus.jsonl.zst", dict(blank_every=3)),
    "ndjson.zst, no trailing newline": ("corpus.ndjson.zst", dict(trailing_newline=False)),
}


def _corpus(tmp_path: Path, case: str) -> tuple[list[InputFile], list[str]]:
    name, jsonl = CASES[case]
    if jsonl is None:
        _write_parquet(tmp_path / name)
        expected = [f"p{i}" for i in range(ROWS)]
    else:
        _write_jsonl(tmp_path / name, _jsonl_bytes(ROWS, **jsonl))
        expected = [f"j{i}" for i in range(ROWS)]
    return input_files(str(tmp_path / name)), expected


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows_per_part", [1, 7, 10, 64])
def test_every_row_is_in_exactly_one_shard(tmp_path: Path, case: str, rows_per_part: int) -> None:
    files, expected = _corpus(tmp_path, case)
    units = plan(files, rows_per_part)
    assert [u.index for u in units] == list(range(len(units)))
    assert all(0 < u.rows <= rows_per_part for u in units)
    assert _ids_of(files, units) == expected  # the whole plan, in input order
    for n in range(1, 6):
        seen: list[object] = []
        for k in range(n):
            shard = Shard(k, n)
            mine = [u for u in units if shard.holds(u)]
            assert [u.index for u in mine] == list(range(k, len(units), n))
            seen += _ids_of(files, mine)
        assert sorted(seen) == sorted(expected), f"{n} shards"
        assert len(seen) == len(set(seen))


def test_parquet_units_stay_inside_row_groups(tmp_path: Path) -> None:
    files = input_files(str(_write_parquet(tmp_path / "a.parquet", count=25, row_group_size=10)))
    units = plan(files, 4)
    assert [(u.row_group, u.row_in_group, u.first_row, u.rows) for u in units] == [
        (0, 0, 0, 4), (0, 4, 4, 4), (0, 8, 8, 2),
        (1, 0, 10, 4), (1, 4, 14, 4), (1, 8, 18, 2),
        (2, 0, 20, 4), (2, 4, 24, 1)]


def test_the_plan_is_the_same_every_time(tmp_path: Path) -> None:
    _write_parquet(tmp_path / "a.parquet")
    _write_jsonl(tmp_path / "b.jsonl", _jsonl_bytes(20, blank_every=3))
    files = input_files(str(tmp_path))
    assert plan(files, 8) == plan(input_files(str(tmp_path)), 8)
    assert fingerprint(files) == fingerprint(input_files(str(tmp_path)))
    # Units are numbered across files, in file order.
    units = plan(files, 8)
    assert [u.file for u in units] == [0] * 11 + [1] * 4  # 5 groups of 10 and one of 3; 26 lines
    assert [u.index for u in units] == list(range(15))


def test_the_fingerprint_tells_a_changed_file(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", _jsonl_bytes(20))
    before = fingerprint(input_files(str(path)))
    path.write_bytes(path.read_bytes().replace(b"text 3", b"text X"))
    assert fingerprint(input_files(str(path))) != before


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_jsonl_offsets_point_at_each_units_first_line(tmp_path: Path, trailing_newline: bool) -> None:
    data = _jsonl_bytes(40, blank_every=6, trailing_newline=trailing_newline)
    path = _write_jsonl(tmp_path / "a.jsonl", data)
    lines = data.split(b"\n")
    units = plan(input_files(str(path)), 5)
    assert sum(u.rows for u in units) == len(data.rstrip(b"\n").split(b"\n")) == len(lines) - trailing_newline
    with open(path, "rb") as f:
        for unit in units:
            assert unit.offset is not None
            f.seek(unit.offset)
            assert f.readline().rstrip(b"\n") == lines[unit.first_row], unit


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_compressed_jsonl_has_no_offsets(tmp_path: Path, name: str) -> None:
    path = _write_jsonl(tmp_path / name, _jsonl_bytes(12))
    (file,) = input_files(str(path))
    assert file.compression == ("gzip" if name.endswith(".gz") else "zstd")
    units = plan([file], 5)
    assert [(u.first_row, u.rows, u.offset) for u in units] == [(0, 5, None), (5, 5, None), (10, 2, None)]


def test_an_empty_jsonl_file_has_no_units(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    assert plan(input_files(str(path)), 5) == []


# --- which files an INPUT names ------------------------------------------------------------------

def test_input_files_of_a_file_a_folder_and_a_glob(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _write_parquet(tmp_path / "b.parquet", 3)
    _write_jsonl(tmp_path / "a.jsonl", _jsonl_bytes(3))
    _write_jsonl(tmp_path / "sub" / "c.jsonl.gz", _jsonl_bytes(3))
    (tmp_path / "notes.txt").write_text("not a corpus")

    (one,) = input_files(str(tmp_path / "b.parquet"))
    assert (one.name, one.path, one.format, one.compression) == \
        ("b.parquet", str(tmp_path / "b.parquet"), "parquet", None)

    folder = input_files(str(tmp_path))
    assert [(f.name, f.format, f.compression) for f in folder] == [
        ("a.jsonl", "jsonl", None), ("b.parquet", "parquet", None), ("sub/c.jsonl.gz", "jsonl", "gzip")]
    assert all(Path(f.path).is_absolute() for f in folder)

    globbed = input_files(str(tmp_path / "**" / "*.jsonl*"))
    assert [f.name for f in globbed] == ["a.jsonl", "sub/c.jsonl.gz"]
    assert [f.name for f in input_files(str(tmp_path / "sub" / "*"))] == ["c.jsonl.gz"]


def test_input_files_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(PlanError, match="not a Parquet or JSONL file"):
        input_files(str(tmp_path / "notes.txt"))
    with pytest.raises(PlanError, match="no Parquet or JSONL file"):
        input_files(str(tmp_path))
    with pytest.raises(PlanError, match="no Parquet or JSONL file"):
        input_files(str(tmp_path / "missing-*.parquet"))


def test_a_broken_parquet_file_is_a_plan_error(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PlanError, match="bad.parquet: cannot be read"):
        plan(input_files(str(tmp_path / "bad.parquet")), 10)


# --- --shard ---------------------------------------------------------------------------------

def test_shard_parse() -> None:
    assert Shard.parse("0/1") == Shard(0, 1)
    assert Shard.parse("3/4") == Shard(3, 4)
    for text, message in [("4/4", "less than N"), ("-1/4", "at least 0"), ("1/0", "less than N"),
                          ("1", "K/N"), ("a/b", "K/N"), ("1/2/3", "K/N"), ("", "K/N")]:
        with pytest.raises(PlanError, match=message):
            Shard.parse(text)


# --- reading a unit --------------------------------------------------------------------------

def _read_all(path: Path, columns: Columns = Columns()) -> sources.Rows:
    files = input_files(str(path))
    (unit,) = plan(files, 1000)
    return read_unit(files[0], unit, columns, check_columns(files[0], columns))


def test_parquet_rows_ids_numbers_and_failed_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [10, 11, 12, 13], "text": ["one", None, "", "four"]}), path)
    rows = _read_all(path)
    assert rows.numbers == [0, 1, 2, 3]
    assert rows.ids == [10, 11, 12, 13]
    assert rows.inputs == ["one", None, None, "four"]
    assert {i: kind for i, (kind, _) in rows.failed.items()} == {1: sources.MISSING, 2: sources.EMPTY}


def test_a_parquet_column_of_numbers_is_the_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1, 2]}), path)
    rows = _read_all(path)
    assert [kind for kind, _ in rows.failed.values()] == [sources.WRONG_TYPE] * 2
    assert "not a string" in rows.failed[0][1]


def test_a_parquet_file_without_the_id_column_names_rows_by_number(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["x", "y", "z"]}), path, row_group_size=2)
    files = input_files(str(path))
    assert check_columns(files[0], Columns()) is False
    units = plan(files, 1000)
    assert [read_unit(files[0], u, Columns(), False).ids for u in units] == [[0, 1], [2]]


def test_a_parquet_file_without_the_input_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), path)
    with pytest.raises(PlanError, match=r"no column 'text' \(its columns: id, body\).*--text-column"):
        check_columns(input_files(str(path))[0], Columns())


def test_jsonl_rows_and_the_ways_a_line_fails(tmp_path: Path) -> None:
    lines = [
        '{"id": "a", "text": "fine"}',
        '{"id": "b", "text": 5}',
        '{"id": "c", "text": null}',
        '{"id": "d"}',
        '{"id": "e", "text": ""}',
        "{not json",
        "",
        '["an", "array"]',
        '{"id": 7, "text": "a numeric id"}',
    ]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines))
    rows = _read_all(path)
    assert rows.numbers == [0, 1, 2, 3, 4, 5, 7, 8]  # the blank line is no row
    assert rows.ids == ["a", "b", "c", "d", "e", None, None, "7"]
    assert rows.inputs == ["fine", None, None, None, None, None, None, "a numeric id"]
    kinds = {rows.numbers[i]: kind for i, (kind, _) in rows.failed.items()}
    assert kinds == {1: sources.WRONG_TYPE, 2: sources.MISSING, 3: sources.MISSING, 4: sources.EMPTY,
                     5: sources.BAD_LINE, 7: sources.BAD_LINE}
    messages = {rows.numbers[i]: message for i, (_, message) in rows.failed.items()}
    assert messages[5].startswith("line 6 is not JSON")
    assert messages[7] == "line 8 is not a JSON object"


def test_a_jsonl_file_without_ids_names_rows_by_number(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('\n{"text": "x"}\n{"text": "y"}\n')
    files = input_files(str(path))
    assert check_columns(files[0], Columns()) is False
    assert _read_all(path).ids == [1, 2]
    assert check_columns(files[0], Columns(id=None)) is False


def test_other_columns_by_name(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"key": "k1", "body": "hello"}\n')
    rows = _read_all(path, Columns(input="body", id="key"))
    assert (rows.ids, rows.inputs, rows.failed) == (["k1"], ["hello"], {})


def test_image_rows_paths_bytes_urls_and_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "one.png").write_bytes(b"\x89PNG one")
    columns = Columns(input="image", medium="image")
    as_bytes = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"id": [0, 1], "image": [b"\x89PNG two", b""]}), as_bytes)
    rows = _read_all(as_bytes, columns)
    assert rows.inputs == [b"\x89PNG two", None]
    assert {i: kind for i, (kind, _) in rows.failed.items()} == {1: sources.EMPTY}
    # Paths relative to the file's folder, or absolute; URLs as they are, fetched later.
    as_paths = tmp_path / "paths.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2, 3, 4], "image": [
        "images/one.png", str(tmp_path / "images" / "one.png"), "https://example.com/x.png",
        "images/missing.png", None]}), as_paths)
    rows = _read_all(as_paths, columns)
    assert rows.inputs == [b"\x89PNG one", b"\x89PNG one", "https://example.com/x.png", None, None]
    assert {i: kind for i, (kind, _) in rows.failed.items()} == {3: sources.UNREADABLE, 4: sources.MISSING}
    assert "images/missing.png" in rows.failed[3][1]
    # A number is no image.
    as_numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"id": [0], "image": [3]}), as_numbers)
    assert _read_all(as_numbers, columns).failed[0][0] == sources.WRONG_TYPE
