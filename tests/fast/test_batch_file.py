"""OpenAI batch files (infinity/corpus/batch_file.py): telling one from a corpus, the lines
that are no request, and whole files answered in this process on the fast tier's fake
engine (tests/fast/inprocess.py), each response body byte for byte what the in-process
server's `/v1/embeddings` answers for the same body."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from infinity.corpus.batch_file import Answerer, is_batch_file, parse_line, write_output
from tests.support.answers import unstamped

pytestmark = pytest.mark.timeout(120)


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings", method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


# --- detection ---------------------------------------------------------------------------------

def test_a_jsonl_file_of_requests_is_a_batch_file(tmp_path: Path) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n  \n" + _line("a", {"input": "x"}) + "\n")
    assert is_batch_file(str(batch))

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "x", "custom_id": "a"}) + "\n")  # no body
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n" + _line("a", {"input": "x"}) + "\n")
    other_name = tmp_path / "batch.json"
    other_name.write_text(batch.read_text())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path in (corpus, broken, other_name, empty, tmp_path / "missing.jsonl", tmp_path):
        assert not is_batch_file(str(path)), path


# --- lines that are no request -----------------------------------------------------------------

@pytest.mark.parametrize("line,custom_id,code", [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_request"),
    (b'{"method": "POST", "url": "/v1/embeddings", "body": {}}', None, "invalid_request"),
    (b'{"custom_id": 7, "method": "POST", "url": "/v1/embeddings", "body": {}}', None, "invalid_request"),
    (b'{"custom_id": "seen", "method": "POST", "url": "/v1/embeddings", "body": {}}', "seen", "duplicate_custom_id"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/embeddings", "body": {}}', "a", "invalid_method"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "a", "invalid_url"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}', "a", "invalid_request"),
])
def test_a_line_that_is_no_request_gets_an_error(line: bytes, custom_id: str | None, code: str) -> None:
    got_id, parsed = parse_line(line, {"seen"})
    assert got_id == custom_id
    assert not isinstance(parsed, msgspec.Raw) and parsed.code == code and parsed.message


def test_a_request_line_gives_its_body_as_sent() -> None:
    seen: set[str] = set()
    custom_id, body = parse_line(b'{"custom_id": "a", "method": "POST", "url": "/embeddings", '
                                 b'"body": {"input": ["x"], "model": "m"}}\r\n', seen)
    assert custom_id == "a" and seen == {"a"}
    assert isinstance(body, msgspec.Raw) and json.loads(bytes(body)) == {"input": ["x"], "model": "m"}


# --- whole files on the fake engine ------------------------------------------------------------

BODIES = {
    "one text": {"input": "a single text", "model": "m"},
    "texts": {"input": ["first text", "the second text, longer than the first"]},
    "token ids": {"input": [[101, 7592, 102], [101, 2088, 2003, 102]]},
    "base64 and dimensions": {"input": ["cut me short"], "encoding_format": "base64", "dimensions": 64},
    "types": {"input": ["quantised"], "embedding_types": ["int8", "binary", "float"]},
    "empty text": {"input": ["fine", ""]},
    "another model": {"input": "x", "model": "text-embedding-3-small"},
    "bad field": {"input": "x", "encoding_format": "hex"},
    "too many dimensions": {"input": "x", "dimensions": 4096},
    "no input": {"model": "m"},
    "top_k": {"input": "x", "top_k": 3},
}


def test_a_batch_file_is_answered_as_the_server_answers_each_body(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from infinity.api.media_fetch import MediaFetcher
    from infinity.client.engine_client import EngineClient
    from infinity.config import Config, ModelConfig, ServerConfig
    from infinity.folders.resolve import resolve_replicas
    from tests.fast.inprocess import ThreadLauncher, serving

    lines = [_line(name, body, url="/embeddings" if name == "texts" else "/v1/embeddings")
             for name, body in BODIES.items()]
    lines.insert(3, "{not json")
    lines.insert(5, "")
    lines.append(_line("texts", {"input": "again"}))  # a repeated custom_id
    lines.append(_line("chat", {"messages": []}, url="/v1/chat/completions"))
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    target = tmp_path / "out" / "answers.jsonl"
    target.parent.mkdir()

    config = Config(server=ServerConfig(tokenizer_workers=1), models=[ModelConfig(name="m", engine="torch")])
    specs = resolve_replicas(config.models[0])

    async def answer_file_and_server() -> tuple[object, dict[str, tuple[int, bytes]]]:
        client = EngineClient(config.server, specs, launch=ThreadLauncher(), media=config.media)
        fetcher = MediaFetcher(config.media)
        await client.start()
        try:
            summary = await write_output(str(source), target, Answerer(client, client.models["m"], config, fetcher))
        finally:
            await fetcher.close()
            await client.stop()
        served = {}
        async with serving(tokenizer_workers=1) as http:
            for name, body in BODIES.items():
                answer = await http.post("/v1/embeddings", json=body)
                served[name] = answer.status, await answer.read()
        return summary, served

    summary, served = asyncio.run(answer_file_and_server())
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["custom_id"] for line in out] == [*list(BODIES)[:3], None, *list(BODIES)[3:], "texts", "chat"]
    assert len({line["id"] for line in out}) == len(out) and all(line["id"].startswith("batch_req_") for line in out)
    assert not list(target.parent.glob("*.tmp"))

    answered = [line for line in out if line["response"] is not None]
    for line in answered:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        response = line["response"]
        assert len(response["request_id"]) == 32 and set(response) == {"status_code", "request_id", "body"}
        status, body = served[line["custom_id"]]
        assert response["status_code"] == status, (line["custom_id"], response)
        assert msgspec.json.encode(unstamped(response["body"])) == msgspec.json.encode(
            unstamped(json.loads(body))), line["custom_id"]
    statuses = {line["custom_id"]: line["response"]["status_code"] for line in answered}
    assert statuses == {"one text": 200, "texts": 200, "token ids": 200, "base64 and dimensions": 200, "types": 200,
                        "empty text": 422, "another model": 404, "bad field": 422, "too many dimensions": 422,
                        "no input": 422, "top_k": 422}
    assert answered[0]["response"]["body"]["data"][0]["object"] == "embedding"
    assert next(line for line in answered if line["custom_id"] == "another model")["response"]["body"]["error"][
        "code"] == "model_not_found"

    errors = {line["custom_id"]: line["error"]["code"] for line in out if line["response"] is None}
    assert errors == {None: "invalid_json", "texts": "duplicate_custom_id", "chat": "invalid_url"}
    assert (summary.requests, summary.failed) == (len(out), 6 + 3)
    assert "answered 5 of 14 batch requests (9 failed)" in str(summary)


def test_the_command_takes_a_batch_file_and_refuses_a_folder_for_output(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from infinity.cli import main

    source = tmp_path / "batch.jsonl"
    source.write_text(_line("a", {"input": "x"}) + "\n")
    with pytest.raises(SystemExit) as caught:
        main(["embed", str(source), str(tmp_path)])
    assert caught.value.code == 2
    assert "is a folder; a batch file's output is a file" in capsys.readouterr().err


def test_a_lines_priority_is_the_priority_its_request_runs_at() -> None:
    from types import SimpleNamespace

    from infinity.client import engine_client
    from infinity.config import Config
    from infinity.shared.protocol import ErrorKind

    seen: list[int] = []

    class _Client:
        async def run(self, model, inputs):
            seen.append(engine_client._PRIORITY.get())
            raise engine_client.ServingError(ErrorKind.INVALID_INPUT, "recorded")

    model = SimpleNamespace(spec=SimpleNamespace(name="m"), info=None,
                            kind=SimpleNamespace(sparse=False, late_interaction=False))
    answerer = Answerer(_Client(), model, Config(), None)  # type: ignore[arg-type]
    for body in ({"input": "x", "priority": 3}, {"input": "x"}):
        status, _ = asyncio.run(answerer.answer(msgspec.Raw(json.dumps(body).encode())))
        assert status == 422
    assert seen == [3, 0]
