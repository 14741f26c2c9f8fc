"""End to end: `python -m infinity embed INPUT OUTPUT` as a subprocess. Parquet and JSONL in,
Parquet parts out with the vectors the server answers for the same texts; killed with
SIGKILL and run again, every row once and no finished part rewritten, no process, temporary
file or /dev/shm folder left; a changed option refused; sent to a running server with
--url at priority 1, the same parts; two shards into one OUTPUT giving
the rows of one run; an image-text model over an image column (bytes and paths, one that
does not decode); a sparse and a multi-vector model's column types."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.embed_job import EmbedRun, run_embed, start_embed
from tests.support.processes import descendant_pids, pid_alive, wait_until
from tests.support.reference import DIM, MODEL_NAME, SENTENCES
from tests.support.shm import SHM_DIR

pytestmark = pytest.mark.timeout(300)

ROWS_PER_PART = 64


def _embedded(*args: str) -> EmbedRun:
    run = run_embed(*args)
    assert run.code == 0, run.err
    assert "complete" in run.err.splitlines()[-1], run.err
    return run


def _assert_left_nothing(run: EmbedRun) -> None:
    """No child process of `run`, and no /dev/shm folder of it, is left."""
    assert wait_until(lambda: not any(pid_alive(pid) for pid in run.children), 15), "a child outlived the job"
    assert not list(SHM_DIR.glob(f"infinity-emb-{run.pid}-*"))


def _parts(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


def _files(out: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file under `out`."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def _by_id(table: pa.Table) -> dict[object, np.ndarray]:
    return {i: np.asarray(v, np.float32) for i, v in zip(table.column("id").to_pylist(),
                                                         table.column("embedding").to_pylist())}


# --- the packaged default model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None]]:
    """A folder of a Parquet file (row groups of 50) and a JSONL file, the ids' texts; three
    rows fail (a null, an empty text, a line that is not JSON)."""
    folder = tmp_path_factory.mktemp("corpus") / "in"
    folder.mkdir()
    half = len(SENTENCES) // 2
    parquet: dict[str, str | None] = {f"p{i}": text for i, text in enumerate(SENTENCES[:half])}
    parquet.update({"p3": None, "p77": ""})
    pq.write_table(pa.table({"id": list(parquet), "text": list(parquet.values())}), folder / "a.parquet",
                   row_group_size=50)
    jsonl = {f"j{i}": text for i, text in enumerate(SENTENCES[half:])}
    lines = [json.dumps({"id": key, "text": text}) for key, text in jsonl.items()]
    lines.insert(10, "{not json")
    (folder / "b.jsonl").write_text("\n".join(lines) + "\n")
    return folder, {**parquet, **jsonl}


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EmbedRun]:
    out = tmp_path_factory.mktemp("full") / "out"
    return out, _embedded(str(corpus[0]), str(out), "--rows-per-part", str(ROWS_PER_PART))


def test_parquet_and_jsonl_in_vectors_as_the_server_gives_them(server, corpus, full_run) -> None:
    folder, texts = corpus
    out, run = full_run
    _assert_left_nothing(run)
    table = _parts(out)
    errors = pq.read_table(out / "errors.parquet")
    ids = table.column("id").to_pylist() + errors.column("id").to_pylist()
    assert sorted(i for i in ids if i is not None) == sorted(texts)
    assert len(ids) == len(texts) + 1  # and the line that is not JSON, with no id
    assert sorted(zip(errors.column("file").to_pylist(), errors.column("row").to_pylist(),
                      errors.column("error").to_pylist())) == [
        ("a.parquet", 3, "missing_input"), ("a.parquet", 77, "empty_input"), ("b.jsonl", 10, "invalid_json")]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    assert any(table.column("truncated").to_pylist())  # the corpus has texts longer than 256 tokens
    assert all(n > 0 for n in table.column("tokens").to_pylist())

    card = next(card for card in server.get("/v1/models").json()["data"] if card["id"] == MODEL_NAME)
    manifest = json.loads((out / "manifest.json").read_text())
    model = manifest["job"]["model"]
    assert (model["name"], model["kind"], model["dim"]) == (MODEL_NAME, "embed", DIM)
    assert (model["engine"], model["dtype"]) == (card["backend"], card["dtype"])
    assert manifest["job"]["options"] == {"input_column": "text", "medium": "text", "id_column": "id",
                                          "embedding_type": "float", "dimensions": None,
                                          "rows_per_part": ROWS_PER_PART}
    assert manifest["job"]["files"] == ["a.parquet", "b.jsonl"]
    assert manifest["rows"] == len(texts) + 1
    units = manifest["job"]["units"]
    assert manifest["finished"] == list(range(len(units))) and manifest["complete"] is True
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [f"part-{i:06d}.parquet" for i in range(len(units))]
    assert not list(out.rglob("*.tmp"))

    vectors = _by_id(table)
    order = sorted(vectors)
    server.wait_idle()
    answer = server.embed([texts[i] for i in order])
    assert answer.status_code == 200, answer.text
    served = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    # Each within 1e-5 of sentence-transformers in float32 (tests/e2e/embed), so within 2e-5 of each other.
    tolerance = 2e-5 if card["dtype"] == "float32" else 2e-2
    np.testing.assert_allclose(np.stack([vectors[i] for i in order]), served, atol=tolerance)


def test_sent_to_the_running_server_at_priority_1(server, corpus, full_run, tmp_path: Path) -> None:
    """`--url`: the rows go through the running server's /v1/embeddings at priority 1, and
    the parts hold what the local run's do (tokens and truncation exactly; vectors within
    the engines' tolerance), the same model digest in the manifest."""
    from prometheus_client.parser import text_string_to_metric_families

    folder, texts = corpus
    local_out, _ = full_run

    def sent_at(priority: str) -> float:
        return sum(sample.value for family in text_string_to_metric_families(server.get("/metrics").text)
                   for sample in family.samples
                   if sample.name == "infinity_requests_total" and sample.labels.get("route") == "/v1/embeddings"
                   and sample.labels.get("priority") == priority)

    before = sent_at("1")
    out = tmp_path / "out"
    run = _embedded(str(folder), str(out), "--rows-per-part", str(ROWS_PER_PART), "--url", server.url(),
                    "--model", MODEL_NAME)
    assert run.children == set()  # no model loaded here
    assert sent_at("1") - before >= (len(texts) - 2) / 32
    local, served = (_parts(local_out).sort_by("id"), _parts(out).sort_by("id"))
    for column in ("id", "tokens", "truncated"):
        assert served.column(column).equals(local.column(column)), column
    assert pq.read_table(out / "errors.parquet").equals(pq.read_table(local_out / "errors.parquet"))
    card = next(card for card in server.get("/v1/models").json()["data"] if card["id"] == MODEL_NAME)
    tolerance = 2e-5 if card["dtype"] == "float32" else 2e-2
    np.testing.assert_allclose(np.array(served.column("embedding").to_pylist(), np.float32),
                               np.array(local.column("embedding").to_pylist(), np.float32), atol=tolerance)
    manifests = [json.loads((o / "manifest.json").read_text())["job"]["model"] for o in (local_out, out)]
    assert manifests[1]["digest"] == manifests[0]["digest"]
    assert (manifests[1]["engine"], manifests[1]["dtype"]) == (card["backend"], card["dtype"])


@pytest.mark.parametrize("flags,said", [
    (["--dimensions", "128"], "dimensions: None there, 128 now"),
    (["--embedding-type", "int8"], "embedding_type: 'float' there, 'int8' now"),
    (["--rows-per-part", "100"], "rows_per_part: 64 there, 100 now"),
])
def test_a_changed_option_is_refused_and_nothing_changes(corpus, full_run, flags: list[str], said: str) -> None:
    out, _ = full_run
    before = {name: (stamp, (out / name).read_bytes()) for name, stamp in _files(out).items()}
    args = ["--rows-per-part", str(ROWS_PER_PART), *flags] if "--rows-per-part" not in flags else flags
    run = run_embed(str(corpus[0]), str(out), *args)
    assert run.code == 2, run.err
    assert "holds another job" in run.err and said in run.err, run.err
    assert {name: (stamp, (out / name).read_bytes()) for name, stamp in _files(out).items()} == before


def test_two_shards_write_the_rows_of_one_run(corpus, full_run, tmp_path: Path) -> None:
    folder, _ = corpus
    whole, _ = full_run
    out = tmp_path / "out"
    first = run_embed(str(folder), str(out), "--rows-per-part", str(ROWS_PER_PART), "--shard", "0/2")
    assert first.code == 0, first.err
    assert "other shards' parts outstanding" in first.err
    units = len(json.loads((out / "manifest.json").read_text())["job"]["units"])
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [f"part-{i:06d}.parquet" for i in range(0, units, 2)]
    assert not (out / "errors.parquet").exists()
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    _embedded(str(folder), str(out), "--rows-per-part", str(ROWS_PER_PART), "--shard", "1/2")

    sharded, expected = _parts(out), _parts(whole)
    assert sharded.column("id").to_pylist() == expected.column("id").to_pylist()  # the same rows, in order
    assert sharded.column("tokens").to_pylist() == expected.column("tokens").to_pylist()
    np.testing.assert_allclose(np.array(sharded.column("embedding").to_pylist()),
                               np.array(expected.column("embedding").to_pylist()), atol=2e-5)
    assert pq.read_table(out / "errors.parquet").equals(pq.read_table(whole / "errors.parquet"))
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


def test_killed_and_run_again_every_row_once_no_part_rewritten(tmp_path: Path) -> None:
    count = 4000
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(count)), "text": [f"row {i} of a corpus" for i in range(count)]}),
                   source)
    out = tmp_path / "out"
    args = (str(source), str(out), "--rows-per-part", str(ROWS_PER_PART))
    proc = start_embed(*args)
    children: set[int] = set()

    def first_part() -> bool:
        children.update(descendant_pids(proc.pid))
        assert proc.poll() is None, proc.communicate()[0]
        return any(out.glob("part-*.parquet"))

    assert wait_until(first_part, 180, 0.01), "no part within 180 s"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    killed = EmbedRun(proc.returncode, "", proc.pid, children)
    assert wait_until(lambda: not any(pid_alive(pid) for pid in children), 15), "a child outlived SIGKILL"
    finished = {name: stamp for name, stamp in _files(out).items() if name.startswith("part-")}
    units = (count + ROWS_PER_PART - 1) // ROWS_PER_PART
    assert 0 < len(finished) < units, "the job was not killed mid-way"

    run = _embedded(*args)
    _assert_left_nothing(run)
    _assert_left_nothing(killed)  # the second run removed what the killed one left in /dev/shm
    after = _files(out)
    assert {name: after[name] for name in finished} == finished  # not one finished part rewritten
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [f"part-{i:06d}.parquet" for i in range(units)]
    assert not list(out.rglob("*.tmp"))
    ids = _parts(out).column("id").to_pylist() + pq.read_table(out / "errors.parquet").column("id").to_pylist()
    assert sorted(ids) == list(range(count))


# --- other kinds of model ----------------------------------------------------------------------

def _png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _image_reference(folder: Path, images: list[bytes]) -> np.ndarray:
    """transformers' image vectors of `images`, normalised."""
    import torch
    from PIL import Image
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))
    loaded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    with torch.inference_mode():
        vectors = model.get_image_features(**processor(images=loaded, return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(vectors, dim=-1).numpy()


def test_an_image_column_with_an_image_text_model(tmp_path: Path) -> None:
    from tests.support.tiny_models import save_tiny_clip

    clip = save_tiny_clip(tmp_path / "clip", seed=1)
    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nname = "tiny-clip"\nsource = "{clip}"\nengine = "torch"\n')
    images = {i: _png(i, (30 + 7 * i, 40)) for i in range(6)}
    source = tmp_path / "in"
    (source / "pictures").mkdir(parents=True)
    for i in (3, 4, 5):
        (source / "pictures" / f"{i}.png").write_bytes(images[i])
    # One file of image bytes (one of them no image), one of paths (one of them missing).
    pq.write_table(pa.table({"id": ["b0", "b1", "b2", "bad"], "image": [images[0], images[1], images[2],
                                                                        b"not an image"]}), source / "bytes.parquet")
    pq.write_table(pa.table({"id": ["f3", "f4", "f5", "gone"], "image": [
        "pictures/3.png", str(source / "pictures" / "4.png"), "pictures/5.png", "pictures/none.png"]}),
        source / "paths.parquet")
    out = tmp_path / "out"
    _embedded(str(source), str(out), "--config", str(config), "--image-column", "image", "--rows-per-part", "3")

    table = _parts(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 16)
    errors = pq.read_table(out / "errors.parquet")
    assert sorted(zip(errors.column("id").to_pylist(), errors.column("file").to_pylist(),
                      errors.column("row").to_pylist(), errors.column("error").to_pylist())) == [
        ("bad", "bytes.parquet", 3, "invalid_input"), ("gone", "paths.parquet", 3, "unreadable_media")]
    vectors = _by_id(table)
    assert sorted(vectors) == ["b0", "b1", "b2", "f3", "f4", "f5"]
    expected = _image_reference(clip, [images[i] for i in range(6)])
    np.testing.assert_allclose(np.stack([vectors[i] for i in ["b0", "b1", "b2", "f3", "f4", "f5"]]), expected,
                               atol=1e-5)


def test_sparse_and_multivector_column_types(tmp_path: Path) -> None:
    from sentence_transformers import MultiVectorEncoder, SparseEncoder

    from tests.support.tiny_models import save_tiny_multivector, save_tiny_sparse

    splade, colbert = save_tiny_sparse(tmp_path / "splade"), save_tiny_multivector(tmp_path / "colbert")
    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nname = "splade"\nsource = "{splade}"\nengine = "torch"\n'
                      f'[[models]]\nname = "colbert"\nsource = "{colbert}"\nengine = "torch"\n')
    texts = ["the quick brown fox", "a lazy dog", "seven wizards quietly judge boxing matches", "quartz sphinx"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))

    _embedded(str(source), str(tmp_path / "sparse"), "--config", str(config), "--model", "splade")
    sparse = _parts(tmp_path / "sparse")
    assert sparse.schema.field("embedding").type == pa.list_(
        pa.struct([pa.field("index", pa.int32()), pa.field("value", pa.float32())]))
    dense = SparseEncoder(str(splade), device="cpu").encode_document(texts, convert_to_sparse_tensor=False).numpy()
    for row, expected in zip(sparse.column("embedding").to_pylist(), dense):
        got = np.zeros_like(expected)
        got[[e["index"] for e in row]] = [e["value"] for e in row]
        assert sorted(e["index"] for e in row) == sorted(np.flatnonzero(expected).tolist())
        np.testing.assert_allclose(got, expected, atol=1e-5)

    _embedded(str(source), str(tmp_path / "multi"), "--config", str(config), "--model", "colbert")
    multi = _parts(tmp_path / "multi")
    assert multi.schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), 128))
    reference = [row.float().numpy() for row in MultiVectorEncoder(str(colbert), device="cpu").encode_document(texts)]
    for row, expected in zip(multi.column("embedding").to_pylist(), reference):
        np.testing.assert_allclose(np.array(row, np.float32), expected, atol=1e-5)
