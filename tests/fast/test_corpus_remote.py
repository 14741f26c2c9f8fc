"""The corpus job through a running server (`embed --url`, infinity/corpus/remote.py): the
same parts as a local run, sent at priority 1 unless told; a row the server refuses fails
alone; a busy server is waited out and a wrong key stops the job; OpenAI batch files
answered by the server. And what the server gives the job: each input's tokens and cut
(`input_usage`) and the model folder's digest in `/v1/models`.

The server is the fast tier's in-process one (tests/fast/inprocess.py) on a loop of its
own thread, so that the job's own loop talks HTTP to it on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from infinity.api.binary import CONTENT_TYPE, encode_rows, read_embeddings
from infinity.client.engine_client import EngineClient, ServingError
from infinity.config import ApiKey, Config, ModelConfig, ServerConfig
from infinity.corpus import encoder, job, remote
from infinity.corpus.batch_file import run_on_server
from infinity.corpus.parts import ERRORS, MANIFEST
from infinity.corpus.sources import Columns
from infinity.folders.resolve import resolve_replicas
from infinity.shared.folders import folder_digest
from infinity.shared.protocol import ErrorKind
from tests.fast.inprocess import ThreadLauncher, serving

pytestmark = pytest.mark.timeout(120)

LONG = " ".join(["word"] * 400)  # beyond all-MiniLM-L6-v2's 256 tokens


@contextlib.contextmanager
def server_in_a_thread(model: ModelConfig | None = None, **settings: object) -> Iterator[str]:
    """The in-process server (its children in threads) on an event loop of its own thread;
    yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    context = serving(model=model, **settings)
    try:
        client = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(60)
        try:
            yield str(client.make_url("")).rstrip("/")
        finally:
            asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, read over HTTP."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()))


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    texts = {f"r{i}": f"row number {i} of the corpus" for i in range(17)}
    texts.update({"r3": "", "r7": None, "r9": LONG})
    pq.write_table(pa.table({"id": list(texts), "text": list(texts.values())}), folder / "a.parquet",
                   row_group_size=6)
    return folder


def _table(folder: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("part-*.parquet"))]).sort_by("id")


def _local(config: Config) -> encoder.LocalEncoder:
    return encoder.LocalEncoder(config, resolve_replicas(config.models[0]))


# --- the job through a server ------------------------------------------------------------------

def test_a_job_sent_to_a_server_writes_what_a_local_run_writes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts, errors and manifest of `--url` equal a local run's on the same model (the
    server's digest is the local folder's: one may resume the other); every request at
    priority 1; tokens and `truncated` per row from the server's `input_usage`."""
    source = _corpus(tmp_path / "in")
    monkeypatch.setattr(encoder, "EngineClient", functools.partial(EngineClient, launch=ThreadLauncher()))
    config = Config(server=ServerConfig(tokenizer_workers=1), models=[ModelConfig(name="m", engine="torch")])
    local_out, remote_out = tmp_path / "local", tmp_path / "remote"
    options = job.JobOptions(str(source), str(local_out), rows_per_part=5, batch_size=4, quiet=True)
    assert job.run(options, lambda: _local(config)).complete

    with server_in_a_thread() as url:
        remote_options = msgspec.structs.replace(options, output=str(remote_out))
        summary = job.run(remote_options, lambda: remote.ServerEncoder(url, None, None))
        assert summary.complete and (summary.rows, summary.errors) == (17, 2)
        sent = _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="1", status="200")
        assert sent >= 15 / 4  # batches of 4, and no request at another priority
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings") == sent
        # The same job: resumed against the local run's folder, nothing left to do (the URL
        # as an OpenAI client's base URL, ending in /v1).
        again = job.run(options, lambda: remote.ServerEncoder(f"{url}/v1/", "m", None))
        assert again.complete and again.parts == 0

    local, served = _table(local_out), _table(remote_out)
    assert local.equals(served)
    assert served.column("truncated").to_pylist() == [id == "r9" for id in served.column("id").to_pylist()]
    assert pq.read_table(local_out / ERRORS).equals(pq.read_table(remote_out / ERRORS))
    manifests = [json.loads((out / MANIFEST).read_text()) for out in (local_out, remote_out)]
    assert manifests[0]["job"]["model"] == manifests[1]["job"]["model"]
    assert manifests[1]["job"]["model"]["digest"] == folder_digest(resolve_replicas(config.models[0])[0].path)


def test_a_sparse_models_parts_through_a_server_are_a_local_runs(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse model's entries come back as JSON and are written as a local run writes
    them, both capped at the model's max_active_dims as /v1/embeddings caps them."""
    from tests.fast.test_sparse import sparse_folder

    source = _corpus(tmp_path / "in")
    model = ModelConfig(name="s", source=str(sparse_folder(tmp_path, max_active_dims=5)), engine="torch")
    monkeypatch.setattr(encoder, "EngineClient", functools.partial(EngineClient, launch=ThreadLauncher()))
    config = Config(server=ServerConfig(tokenizer_workers=1), models=[model])
    options = job.JobOptions(str(source), str(tmp_path / "local"), rows_per_part=50, batch_size=4, quiet=True)
    assert job.run(options, lambda: _local(config)).complete
    with server_in_a_thread(model) as url:
        served = msgspec.structs.replace(options, output=str(tmp_path / "remote"))
        assert job.run(served, lambda: remote.ServerEncoder(url, "s", None)).complete
    local, remote_table = _table(tmp_path / "local"), _table(tmp_path / "remote")
    assert local.equals(remote_table)
    lengths = [len(entries) for entries in local.column("embedding").to_pylist()]
    assert max(lengths) == 5 and min(lengths) >= 1


def _png(shade: int) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (shade, 255 - shade, 90)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["image_text", "multivector"])
def test_an_image_column_and_a_multivector_model_through_a_server_are_a_local_runs(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Images travel as data: URIs (one that does not decode fails alone, as locally); a
    multi-vector model's matrices come back as JSON with their shapes."""
    from tests.support.tiny_models import save_tiny_clip, save_tiny_pylate_colbert

    source = tmp_path / "in"
    source.mkdir()
    if kind == "image_text":
        folder, column = save_tiny_clip(tmp_path / "clip"), "image"
        values: list[object] = [_png(shade) for shade in range(0, 250, 25)] + [b"not an image"]
        columns = Columns(column, "image", "id")
    else:
        folder, column = save_tiny_pylate_colbert(tmp_path / "colbert"), "text"
        values = [f"text number {i}" for i in range(11)]
        columns = Columns(column, "text", "id")
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(len(values))], column: values}), source / "a.parquet")
    model = ModelConfig(name="k", source=str(folder), engine="torch")
    monkeypatch.setattr(encoder, "EngineClient", functools.partial(EngineClient, launch=ThreadLauncher()))
    config = Config(server=ServerConfig(tokenizer_workers=1), models=[model])
    options = job.JobOptions(str(source), str(tmp_path / "local"), columns, rows_per_part=50, batch_size=4,
                             quiet=True)
    assert job.run(options, lambda: _local(config)).complete
    with server_in_a_thread(model) as url:
        served = msgspec.structs.replace(options, output=str(tmp_path / "remote"))
        summary = job.run(served, lambda: remote.ServerEncoder(url, "k", None))
    assert summary.complete and summary.errors == (1 if kind == "image_text" else 0)
    assert _table(tmp_path / "local").equals(_table(tmp_path / "remote"))
    assert pq.read_table(tmp_path / "local" / ERRORS).equals(pq.read_table(tmp_path / "remote" / ERRORS))


def test_a_row_the_server_refuses_fails_alone_at_the_priority_asked(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "in")
    options = job.JobOptions(str(source), str(tmp_path / "out"), rows_per_part=50, batch_size=8, quiet=True)
    with server_in_a_thread(ModelConfig(name="m", engine="torch", long_inputs="error")) as url:
        summary = job.run(options, lambda: remote.ServerEncoder(url, "m", None, priority=3))
        assert _metric(url, "infinity_requests_total", priority="3", status="422") >= 2  # its batch, then itself
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="0") == 0
    assert (summary.rows, summary.errors) == (17, 3)
    errors = pq.read_table(tmp_path / "out" / ERRORS).sort_by("id")
    assert errors.column("id").to_pylist() == ["r3", "r7", "r9"]
    assert errors.column("error").to_pylist()[2] == "invalid_input"
    assert "256" in errors.column("message").to_pylist()[2]  # the server's own words: the model's length


def test_the_servers_key_is_sent_and_a_wrong_one_stops_the_job(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from infinity.cli import main

    source = _corpus(tmp_path / "in")
    with server_in_a_thread(api_keys=[ApiKey("ingest", priority=2)], api_key="queries") as url:
        with pytest.raises(SystemExit) as caught:
            main(["embed", str(source), str(tmp_path / "refused"), "--url", url, "--api-key", "wrong", "--quiet"])
        assert caught.value.code == 2 and "401" in capsys.readouterr().err
        assert not (tmp_path / "refused").exists()
        with pytest.raises(SystemExit) as caught:
            main(["embed", str(source), str(tmp_path / "out"), "--url", url, "--api-key", "ingest", "--quiet"])
        assert caught.value.code == 0, capsys.readouterr().err
        # The job's priority is its own (1), not the key's default.
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="1", status="200") > 0
    assert _table(tmp_path / "out").num_rows == 15


def test_the_server_and_priority_may_come_from_the_embed_table(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from infinity.cli import main

    source = _corpus(tmp_path / "in")
    config = tmp_path / "models.toml"
    with server_in_a_thread() as url:
        config.write_text(f'[embed]\nurl = "{url}"\npriority = 4\nbatch_size = 8\n')
        with pytest.raises(SystemExit) as caught:
            main(["embed", str(source), str(tmp_path / "out"), "--config", str(config), "--quiet"])
        assert caught.value.code == 0, capsys.readouterr().err
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="4", status="200") >= 2
    config.write_text("[embed]\npriority = 4\n")
    with pytest.raises(SystemExit) as caught:
        main(["embed", str(source), str(tmp_path / "again"), "--config", str(config)])
    assert caught.value.code == 2 and "embed.priority" in capsys.readouterr().err


def test_local_flags_and_server_flags_are_refused_where_they_do_not_apply(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infinity.cli import main

    source = _corpus(tmp_path / "in")
    for flags, said in ((["--priority", "2"], "--priority applies to a job sent to a server"),
                        (["--url", "http://127.0.0.1:9", "--tokenizer-workers", "1"], "--tokenizer-workers"),
                        (["--url", "http://127.0.0.1:9", "--priority", "101"], "--priority must be between")):
        with pytest.raises(SystemExit) as caught:
            main(["embed", str(source), str(tmp_path / "out"), *flags])
        assert caught.value.code == 2 and said in capsys.readouterr().err


# --- a server that is busy, away or wrong ------------------------------------------------------

class _StubServer:
    """A server that answers `/v1/models` with one model's card and `/v1/embeddings` with
    `refusals` (statuses, in turn) before it answers each text's length as its vector."""

    def __init__(self, refusals: list[int], answers: int | None = None) -> None:
        self.refusals = refusals
        self.answers = answers  # how many batches it answers before it answers only 503 (None: all)
        self.bodies: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/embeddings", self._embeddings)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{
            "id": "stub", "kind": "embed", "capabilities": ["embed"], "backend": "stub", "dtype": "float32",
            "ready": True, "dimensions": 2, "max_length": 8, "long_inputs": "truncate", "pooling": "mean",
            "normalize": True, "digest": "0" * 64}]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.answers is not None and self.answers <= 0:
            return web.json_response({"error": {"message": "stopping", "code": "shutting_down"}}, status=503)
        if self.refusals:
            status = self.refusals.pop(0)
            return web.json_response({"error": {"message": f"refused with {status}", "code": None}}, status=status)
        rows = np.array([[len(text), 1.0] for text in body["input"]], np.float32)
        usage = {"input_tokens": [len(text) for text in body["input"]], "truncated_indices": []}
        if self.answers is not None:
            self.answers -= 1
        return web.Response(body=encode_rows(rows, "float32", "little", {"model": "stub", "usage": usage}),
                            content_type=CONTENT_TYPE)


@contextlib.asynccontextmanager
async def _stub(refusals: list[int], answers: int | None = None):
    stub = _StubServer(refusals, answers)
    async with TestServer(stub.app()) as server:
        yield stub, str(server.make_url("")).rstrip("/")


def test_a_busy_server_is_waited_out_and_no_row_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_BUSY_S", 0.01)

    async def test() -> None:
        async with _stub([429, 503, 503]) as (stub, url):
            sent = remote.ServerEncoder(url, None, None)
            await sent.identity()
            await sent.start()
            encoded = await sent.encode(["a", "bbb"])
            await sent.stop()
        assert encoded.failed == {} and [row[0] for row in encoded.outputs] == [1, 3]
        assert encoded.costs == [1, 3] and len(stub.bodies) == 4
        assert all(body["priority"] == 1 and body["input_usage"] for body in stub.bodies)

    asyncio.run(test())


def test_a_server_that_stays_busy_stops_the_job_not_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_BUSY_S", 0.01)
    monkeypatch.setattr(encoder, "READY_TIMEOUT_S", 0.2)

    async def test() -> None:
        async with _stub([429] * 1000) as (_, url):
            sent = remote.ServerEncoder(url, None, None)
            await sent.identity()
            await sent.start()
            with pytest.raises(encoder.ModelUnavailable, match="resume"):
                await sent.encode(["a", "b"])
            await sent.stop()

    asyncio.run(test())


def test_a_job_whose_server_goes_away_stops_and_resumes_every_row_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The server stops answering mid-job: the job stops (exit 1, its finished parts kept,
    no row failed for it); run again against a server that answers, it ends with every
    row once and no finished part rewritten."""
    from infinity.cli import main
    from tests.fast.test_corpus_output import _snapshot

    monkeypatch.setattr(remote, "_BUSY_S", 0.01)
    monkeypatch.setattr(encoder, "READY_TIMEOUT_S", 0.3)
    source = tmp_path / "in"
    source.mkdir()
    ids = [f"r{i:02d}" for i in range(40)]
    pq.write_table(pa.table({"id": ids, "text": [f"text {i}" for i in range(40)]}), source / "a.parquet")
    out = tmp_path / "out"
    args = ["embed", str(source), str(out), "--rows-per-part", "8", "--batch-size", "4", "--quiet"]

    def run(answers: int | None) -> int:
        async def serve() -> None:
            async with _stub([], answers) as (_, url):
                await asyncio.to_thread(_main, [*args, "--url", url])

        codes: list[int] = []

        def _main(argv: list[str]) -> None:
            with pytest.raises(SystemExit) as caught:
                main(argv)
            codes.append(caught.value.code)

        asyncio.run(serve())
        return codes[0]

    assert run(answers=5) == 1
    assert "run the same command again to resume" in capsys.readouterr().err
    done = _snapshot(out)
    assert 0 < len([name for name in done if name.startswith("part-")]) < 5
    assert not (out / ERRORS).exists()
    assert run(answers=None) == 0
    after = _snapshot(out)
    assert all(after[name] == value for name, value in done.items() if name.startswith("part-"))
    assert sorted(_table(out).column("id").to_pylist()) == ids
    assert pq.read_table(out / ERRORS).num_rows == 0


def test_a_server_that_cannot_be_reached_is_waited_for_then_stops_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "READY_TIMEOUT_S", 0.3)
    monkeypatch.setattr(remote, "_POLL_S", 0.05)
    asked: list[str] = []
    get_json = remote.ServerClient.get_json

    async def counted(self: remote.ServerClient, path: str) -> object:
        asked.append(path)
        return await get_json(self, path)

    monkeypatch.setattr(remote.ServerClient, "get_json", counted)

    async def test() -> None:
        import socket

        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        sent = remote.ServerEncoder(f"http://127.0.0.1:{port}", None, None)
        with pytest.raises(encoder.ModelUnavailable, match="cannot reach"):
            await sent.identity()
        assert len(asked) > 1  # looked again while it waited
        await sent.stop()

    asyncio.run(test())


def test_a_server_of_another_kind_is_refused_before_any_row_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `/v1/models` without what the job reads (another server, an older one) stops the job."""
    async def older(self: _StubServer, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "object": "model", "owned_by": "someone"}]})

    monkeypatch.setattr(_StubServer, "_models", older)

    async def test() -> None:
        async with _stub([]) as (stub, url):
            sent = remote.ServerEncoder(url, None, None)
            with pytest.raises(remote.ServerRefused, match="lacks .*digest.*not an infinity server of this version"):
                await sent.identity()
            await sent.stop()
        assert stub.bodies == []

    asyncio.run(test())


def test_the_servers_only_model_is_taken_unless_another_is_named() -> None:
    async def test() -> None:
        async with _stub([]) as (_, url):
            for wanted, said in ((None, None), ("other", "does not serve a model 'other'")):
                sent = remote.ServerEncoder(url, wanted, None)
                if said is None:
                    assert (await sent.identity())["name"] == "stub"
                else:
                    with pytest.raises(remote.ServerRefused, match=said):
                        await sent.identity()
                await sent.stop()

    asyncio.run(test())


def test_the_window_grows_while_answers_are_quick_and_halves_when_one_waits() -> None:
    """`InFlight`: more batches while answers come within TARGET_WAIT_S of the fastest,
    half as many after one that waited or was refused as busy; a bad input changes nothing;
    never more batches at once than its size."""
    now = [0.0]  # the window's clock: an answer takes what the test says, not real time

    async def answered(window: remote.InFlight, seconds: float, error: ServingError | None = None) -> None:
        with contextlib.suppress(ServingError):
            async with window.slot():
                now[0] += seconds
                if error is not None:
                    raise error

    async def test() -> None:
        window = remote.InFlight(first=2.0, most=4, clock=lambda: now[0])
        for _ in range(12):
            await answered(window, 1.0)
        assert window.size == 4.0  # grown to its cap
        await answered(window, 1.0 + remote.TARGET_WAIT_S * 1.5)  # waited beyond the fastest answer
        assert window.size == 2.0
        await answered(window, 0.0, ServingError(ErrorKind.INVALID_INPUT, "a bad row"))
        assert window.size == 2.0
        await answered(window, 0.0, ServingError(ErrorKind.OVERLOADED, "429"))
        assert window.size == 1.0

        window = remote.InFlight(first=3.0)
        running, most = 0, 0

        async def one() -> None:
            nonlocal running, most
            async with window.slot():
                running += 1
                assert running <= int(window.size)
                most = max(most, running)
                await asyncio.sleep(0.01)
                running -= 1

        await asyncio.gather(*(one() for _ in range(10)))
        assert most >= 3

    asyncio.run(test())


# --- OpenAI batch files ------------------------------------------------------------------------

def test_a_batch_file_is_answered_by_the_server_at_priority_1(tmp_path: Path) -> None:
    batch = tmp_path / "batch.jsonl"
    bodies = [{"input": ["one text", "two texts"]}, {"input": []}, {"input": "three", "priority": 0},
              {"input": "four", "encoding_format": "bytes"}]
    batch.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                                         "body": body}) + "\n" for i, body in enumerate(bodies)))
    with server_in_a_thread() as url:
        summary = run_on_server(str(batch), str(tmp_path / "out.jsonl"), url, None, None, 1, quiet=True)
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="1") == 3
        assert _metric(url, "infinity_requests_total", route="/v1/embeddings", priority="0") == 1
        import urllib.request

        direct = json.load(urllib.request.urlopen(urllib.request.Request(
            f"{url}/v1/embeddings", data=json.dumps(bodies[0]).encode(), headers={"Content-Type": "application/json"})))
    assert (summary.requests, summary.failed) == (4, 2)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["c0", "c1", "c2", "c3"]
    assert [line["response"]["status_code"] for line in lines] == [200, 422, 200, 422]
    assert lines[0]["response"]["body"]["data"] == direct["data"]
    assert lines[3]["response"]["body"]["error"]["param"] == "encoding_format"  # raw bytes have no line to go in


# --- what the server gives the job -------------------------------------------------------------

def test_input_usage_answers_each_inputs_tokens_and_the_inputs_cut() -> None:
    texts = ["a short one", LONG, "x"]

    async def test() -> None:
        async with serving() as client:
            plain = await (await client.post("/v1/embeddings", json={"input": texts})).json()
            assert set(plain["usage"]) == {"prompt_tokens", "total_tokens", "truncated_inputs"}
            answer = await (await client.post("/v1/embeddings", json={"input": texts, "input_usage": True})).json()
            usage = answer["usage"]
            assert usage["truncated_indices"] == [1] and usage["truncated_inputs"] == 1
            assert usage["input_tokens"][1] == 256 and sum(usage["input_tokens"]) == usage["prompt_tokens"]
            assert usage["input_tokens"][0] < usage["input_tokens"][1] and usage["input_tokens"][2] == 3
            raw = await client.post("/v1/embeddings", json={"input": texts, "input_usage": True,
                                                            "encoding_format": "bytes"})
            assert read_embeddings(await raw.read())[1]["usage"] == usage
            refused = await client.post("/v1/embeddings", json={"input": texts, "input_usage": True,
                                                                "late_chunking": True, "split": "sentences"})
            assert refused.status == 422 and (await refused.json())["error"]["param"] == "input_usage"

    asyncio.run(test())


def test_the_model_list_gives_the_folders_digest_once_hashed() -> None:
    spec = resolve_replicas(ModelConfig(name="m", engine="torch"))[0]

    async def test() -> None:
        async with serving() as client:
            first = (await (await client.get("/v1/models")).json())["data"][0]
            assert first["digest"] is None  # the first ask starts it
            assert (first["long_inputs"], first["pooling"], first["normalize"]) == ("truncate", "mean", True)
            for _ in range(500):
                card = (await (await client.get("/v1/models")).json())["data"][0]
                if card["digest"] is not None:
                    break
                await asyncio.sleep(0.01)
            assert card["digest"] == folder_digest(spec.path)

    asyncio.run(test())


def test_a_stopping_server_does_not_wait_for_a_folder_being_hashed(tmp_path: Path) -> None:
    from infinity.api.routes.status import FolderDigests

    folder = tmp_path / "large"
    folder.mkdir()
    with open(folder / "weights.bin", "wb") as f:
        f.truncate(1 << 30)  # a GiB (sparse): seconds to hash

    async def test() -> None:
        digests = FolderDigests()
        assert digests.get(str(folder)) is None  # started
        await digests.close()
        # Stopped before its end (had close waited for it, the digest would be there now),
        # and not started again.
        assert digests.get(str(folder)) is None

    asyncio.run(test())
