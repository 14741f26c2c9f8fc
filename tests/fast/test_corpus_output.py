"""The corpus job's output (infinity/corpus/parts.py): the manifest and the resume rules
(another model, option or input refused with nothing written; leftovers of a killed run
removed; errors.parquet only once every unit is done, every failed row once), the part
columns' Arrow types; the command line's option errors; and the whole job in this
process on the fast tier's fake engine (tests/fast/inprocess.py)."""

from __future__ import annotations

import functools
import json
import os
import socket
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from infinity.corpus.parts import (ERRORS, MANIFEST, JobIdentity, Output, OutputError, dense_column, errors_schema,
                                   errors_table, id_fields, matrix_column, part_name, sparse_column)
from infinity.corpus.plan import InputFile, Unit, fingerprint, input_files, plan

pytestmark = pytest.mark.timeout(120)

MODEL = {"name": "m", "kind": "embed", "digest": "abc"}
OPTIONS = {"input_column": "text", "embedding_type": "float", "dimensions": None, "rows_per_part": 4}


def _input(tmp_path: Path, rows: int = 10) -> tuple[list[InputFile], list[Unit]]:
    path = tmp_path / "in" / "a.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": f"t{i}"}) + "\n" for i in range(rows)))
    files = input_files(str(path))
    return files, plan(files, 4)


def _identity(files: list[InputFile], units: list[Unit], /, **changes: object) -> JobIdentity:
    identity = JobIdentity(dict(MODEL), dict(OPTIONS), [f.name for f in files], fingerprint(files), units)
    return msgspec.structs.replace(identity, **changes)


FIELDS = id_fields(True, pa.string(), "id")


def _tables(files: list[InputFile], unit: Unit, failed_rows: list[int]) -> tuple[pa.Table, pa.Table]:
    """A unit's part (its rows but `failed_rows`, vectors of width 2) and its errors."""
    numbers = list(range(unit.first_row, unit.first_row + unit.rows))
    good = [n for n in numbers if n not in failed_rows]
    bad = [n for n in numbers if n in failed_rows]
    embedded = pa.table({"id": [f"r{n}" for n in good],
                         "embedding": dense_column(np.ones((len(good), 2), np.float32))})
    failed = errors_table(FIELDS, files[unit.file], [f"r{n}" for n in bad], bad, [("empty_input", "x")] * len(bad))
    return embedded, failed


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the manifest and the resume rules --------------------------------------------------------

def test_a_job_runs_to_errors_parquet(tmp_path: Path) -> None:
    files, units = _input(tmp_path)
    assert [u.rows for u in units] == [4, 4, 2]
    output = Output(str(tmp_path / "out"))
    identity = _identity(files, units)
    output.open(identity, 10, errors_schema(FIELDS))
    manifest = msgspec.json.decode((tmp_path / "out" / MANIFEST).read_bytes())
    assert manifest["rows"] == 10 and manifest["finished"] == [] and manifest["complete"] is False
    assert manifest["job"]["options"] == OPTIONS and manifest["job"]["files"] == ["a.jsonl"]
    assert len(manifest["job"]["units"]) == 3

    failed_rows = {0: [1, 3], 1: [], 2: [9]}
    for unit in (units[2], units[0]):
        output.write(unit, *_tables(files, unit, failed_rows[unit.index]))
        state = output.refresh()
        assert not state.complete
        assert not (tmp_path / "out" / ERRORS).exists()  # not before every unit is done
    assert output.done() == {0, 2}
    assert state.finished == [0, 2]

    output.write(units[1], *_tables(files, units[1], []))
    state = output.refresh()
    assert state.complete and state.finished == [0, 1, 2]
    errors = pq.read_table(tmp_path / "out" / ERRORS)
    assert errors.schema == errors_schema(FIELDS)
    assert errors.column("id").to_pylist() == ["r1", "r3", "r9"]  # each failed row once
    assert errors.column("row").to_pylist() == [1, 3, 9]
    assert errors.column("file").to_pylist() == ["a.jsonl"] * 3
    ids = [i for u in units for i in pq.read_table(tmp_path / "out" / part_name(u.index)).column("id").to_pylist()]
    assert sorted(ids + errors.column("id").to_pylist()) == sorted(f"r{i}" for i in range(10))
    on_disk = msgspec.json.decode((tmp_path / "out" / MANIFEST).read_bytes())
    assert on_disk["complete"] is True and on_disk["finished"] == [0, 1, 2]
    # A second refresh (another shard finishing, a run with nothing to do) changes nothing.
    before = (tmp_path / "out" / ERRORS).read_bytes()
    assert output.refresh().complete
    assert (tmp_path / "out" / ERRORS).read_bytes() == before
    assert not list((tmp_path / "out").rglob("*.tmp"))


@pytest.mark.parametrize("change,said", [
    ({"options": {**OPTIONS, "dimensions": 128}}, "dimensions: None there, 128 now"),
    ({"options": {**OPTIONS, "embedding_type": "int8"}}, "embedding_type: 'float' there, 'int8' now"),
    ({"model": {**MODEL, "digest": "def"}}, "model digest: 'abc' there, 'def' now"),
    ({"model": {**MODEL, "name": "other"}}, "model name: 'm' there, 'other' now"),
    ({"fingerprint": "0" * 64}, "the input differs"),
    ({"files": ["b.jsonl"]}, "the input differs"),
    ({"units": []}, "the input is cut into other parts"),
])
def test_another_job_is_refused_and_nothing_is_written(tmp_path: Path, change: dict, said: str) -> None:
    files, units = _input(tmp_path)
    output = Output(str(tmp_path / "out"))
    output.open(_identity(files, units), 10, errors_schema(FIELDS))
    output.write(units[0], *_tables(files, units[0], [1]))
    output.refresh()
    before = _snapshot(tmp_path / "out")
    other = _identity(files, units, **change)
    for attempt in (Output(str(tmp_path / "out")).check, functools.partial(Output(str(tmp_path / "out")).open,
                                                                          rows=10, errors=errors_schema(FIELDS))):
        with pytest.raises(OutputError, match="holds another job") as caught:
            attempt(other)
        assert said in str(caught.value)
        assert "nothing was written" in str(caught.value)
    assert _snapshot(tmp_path / "out") == before


def test_the_same_job_resumes_and_model_keys_not_known_yet_are_not_compared(tmp_path: Path) -> None:
    files, units = _input(tmp_path)
    loaded = _identity(files, units, model={**MODEL, "engine": "torch", "dtype": "float32"})
    Output(str(tmp_path / "out")).open(loaded, 10, errors_schema(FIELDS))
    before = _snapshot(tmp_path / "out")
    Output(str(tmp_path / "out")).check(_identity(files, units))  # before the model loads
    Output(str(tmp_path / "out")).open(loaded, 10, errors_schema(FIELDS))
    assert _snapshot(tmp_path / "out") == before  # the manifest is not rewritten on open
    with pytest.raises(OutputError, match="model dtype: 'float32' there, 'bfloat16' now"):
        Output(str(tmp_path / "out")).check(_identity(files, units, model={**MODEL, "engine": "torch",
                                                                           "dtype": "bfloat16"}))


def test_a_folder_that_is_not_a_manifest_or_not_a_folder_is_refused(tmp_path: Path) -> None:
    files, units = _input(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / MANIFEST).write_text('{"something": "else"}')
    with pytest.raises(OutputError, match="not a manifest of this version"):
        Output(str(tmp_path / "out")).check(_identity(files, units))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        Output(str(tmp_path / "file"))


def test_leftovers_of_a_killed_run_are_removed_and_finished_parts_kept(tmp_path: Path) -> None:
    files, units = _input(tmp_path)
    out = tmp_path / "out"
    output = Output(str(out))
    output.open(_identity(files, units), 10, errors_schema(FIELDS))
    output.write(units[0], *_tables(files, units[0], []))
    host = socket.gethostname()
    dead = 2**22 + 12345  # above the default pid_max: no such process
    leftovers = [out / f".{part_name(1)}.{host}-{dead}.tmp", out / "errors" / f".{part_name(1)}.{host}-{dead}.tmp",
                 out / f".{MANIFEST}.{host}-{dead}.tmp", out / f".{ERRORS}.{host}-{dead}.tmp"]
    alive = [out / f".{MANIFEST}.{host}-{os.getpid()}.tmp",  # a live process's, another machine's
             out / f".{MANIFEST}.elsewhere-{dead}.tmp"]
    for path in leftovers + alive:
        path.write_bytes(b"half written")
    finished = _snapshot(out)[part_name(0)]
    todo = [u for u in units if u.index not in output.done()]
    assert [u.index for u in todo] == [1, 2]
    output.clear_leftovers(todo)
    assert [p for p in leftovers if p.exists()] == []
    assert all(p.exists() for p in alive)
    assert _snapshot(out)[part_name(0)] == finished


# --- the part columns --------------------------------------------------------------------------

def test_dense_column_is_a_fixed_size_list() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    column = dense_column(rows)
    assert column.type == pa.list_(pa.float32(), 2)
    assert column.to_pylist() == [[0, 1], [2, 3], [4, 5]]
    assert dense_column(np.zeros((0, 5), np.float32)).type == pa.list_(pa.float32(), 5)
    assert dense_column(rows.astype(np.int8)).type == pa.list_(pa.int8(), 2)
    assert dense_column(rows.astype(np.float16)).type == pa.list_(pa.float16(), 2)


def test_matrix_column_is_a_list_of_fixed_size_lists() -> None:
    matrices = [np.ones((3, 4), np.float32), np.zeros((1, 4), np.float32), np.full((2, 4), 2, np.float32)]
    column = matrix_column(matrices, np.zeros((0, 4), np.float32))
    assert column.type == pa.list_(pa.list_(pa.float32(), 4))
    assert [len(row) for row in column.to_pylist()] == [3, 1, 2]
    for row, matrix in zip(column.to_pylist(), matrices):
        np.testing.assert_array_equal(np.array(row), matrix)
    empty = matrix_column([], np.zeros((0, 4), np.float32))
    assert empty.type == pa.list_(pa.list_(pa.float32(), 4)) and len(empty) == 0


def test_sparse_column_is_a_list_of_index_value_records() -> None:
    entry = [("index", "<i4"), ("value", "<f4")]
    vectors = [np.array([(3, 0.5), (17, 1.25)], entry), np.zeros(0, entry), np.array([(0, 2.0)], entry)]
    column = sparse_column(vectors)
    assert column.type == pa.list_(pa.struct([pa.field("index", pa.int32()), pa.field("value", pa.float32())]))
    assert column.to_pylist() == [[{"index": 3, "value": 0.5}, {"index": 17, "value": 1.25}], [],
                                  [{"index": 0, "value": 2.0}]]
    assert sparse_column([]).type == column.type


def test_id_fields_and_errors_schema() -> None:
    assert [f.name for f in id_fields(False, None, "id")] == ["file", "row"]
    assert errors_schema(id_fields(False, None, "id")).names == ["file", "row", "error", "message"]
    assert errors_schema(id_fields(True, pa.int64(), "key")).names == ["key", "file", "row", "error", "message"]
    assert id_fields(True, None, "id")[0].type == pa.string()


# --- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--shard", "2/2"], "--shard 2/2: K must be at least 0 and less than N"),
    (["--shard", "x"], "--shard takes K/N"),
    (["--dimensions", "0"], "--dimensions must be positive"),
    (["--rows-per-part", "0"], "--rows-per-part must be positive"),
    (["--batch-size", "-1"], "--batch-size must be positive"),
    (["--image-column", "a", "--audio-column", "b"], "not both"),
])
def test_cli_option_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 flags: list[str], message: str) -> None:
    from infinity.cli import main

    files, _ = _input(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["embed", files[0].path, str(tmp_path / "out"), *flags])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_input_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infinity.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["embed", str(tmp_path / "nothing-*.parquet"), str(tmp_path / "out")])
    assert caught.value.code == 2
    assert "no Parquet or JSONL file" in capsys.readouterr().err


# --- the whole job, in this process ------------------------------------------------------------

def test_the_whole_job_on_the_fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parquet and a JSONL file in, parts out: every id exactly once across the parts and
    errors.parquet, each vector the fake engine's for its text; a second run writes nothing."""
    from tokenizers import Tokenizer

    from infinity.client.engine_client import EngineClient
    from infinity.config import Config, ModelConfig, ServerConfig
    from infinity.corpus import encoder, job
    from infinity.folders.resolve import resolve_replicas
    from tests.fast.inprocess import ThreadLauncher, expected_embedding

    source = tmp_path / "in"
    source.mkdir()
    # The Parquet file's ids are numbers, the JSONL file's strings: the output's are strings.
    texts = {str(i): f"parquet row number {i}" for i in range(23)}
    texts.update({"5": "", "11": None})
    pq.write_table(pa.table({"id": [int(i) for i in texts], "text": list(texts.values())}), source / "a.parquet",
                   row_group_size=9)
    jsonl = {f"j{i}": f"a json line {i}" for i in range(14)}
    lines = [json.dumps({"id": key, "text": text}) for key, text in jsonl.items()]
    lines.insert(4, "{broken")
    lines.insert(8, "")
    (source / "b.jsonl").write_text("\n".join(lines))

    monkeypatch.setattr(encoder, "EngineClient", functools.partial(EngineClient, launch=ThreadLauncher()))
    config = Config(server=ServerConfig(tokenizer_workers=1), models=[ModelConfig(name="m", engine="torch")])
    specs = resolve_replicas(config.models[0])
    options = job.JobOptions(str(source), str(tmp_path / "out"), rows_per_part=5, batch_size=3, quiet=True)
    summary = job.run(options, lambda: encoder.LocalEncoder(config, specs))
    assert summary.complete
    assert (summary.rows, summary.errors) == (23 + 15, 3)

    out = tmp_path / "out"
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == len(plan(input_files(str(source)), 5)) == 5 + 4
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    errors = pq.read_table(out / ERRORS)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert table.schema.field("id").type == errors.schema.field("id").type == pa.string()
    ids = table.column("id").to_pylist() + errors.column("id").to_pylist()
    assert sorted(i for i in ids if i is not None) == sorted([*texts, *jsonl])
    assert len(ids) == len(texts) + len(jsonl) + 1  # the broken line has no id
    assert sorted(zip(errors.column("file").to_pylist(), errors.column("row").to_pylist(),
                      errors.column("error").to_pylist())) == [
        ("a.parquet", 5, "empty_input"), ("a.parquet", 11, "missing_input"), ("b.jsonl", 4, "invalid_json")]

    tokenizer = Tokenizer.from_file(f"{specs[0].path}/tokenizer.json")
    tokenizer.no_padding()
    every = {**texts, **jsonl}
    vectors = np.array(table.column("embedding").to_pylist(), np.float32)
    expected = np.stack([expected_embedding(tokenizer.encode(every[i]).ids, 384) for i in table.column("id").to_pylist()])
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    assert table.column("tokens").to_pylist() == [len(tokenizer.encode(every[i]).ids)
                                                  for i in table.column("id").to_pylist()]

    # Run again: nothing to do, nothing rewritten.
    before = _snapshot(out)
    again = job.run(options, lambda: encoder.LocalEncoder(config, specs))
    assert again.complete and again.parts == 0
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k != MANIFEST} == {k: v for k, v in before.items() if k != MANIFEST}
