"""End to end: `python -m infinity embed batch.jsonl out.jsonl` as a subprocess on the
packaged default model: an OpenAI batch input file in, its batch output file out, a line
per request in input order; each answer's vectors those the server's `/v1/embeddings`
gives for the same body, a failed body's status and error body the server's own, a line
that is no request an `error`; no process, temporary file or /dev/shm folder left."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.answers import decode_embedding, unstamped
from tests.support.embed_job import run_embed
from tests.support.processes import pid_alive, wait_until
from tests.support.reference import DIM, MODEL_NAME, SENTENCES
from tests.support.shm import SHM_DIR

pytestmark = pytest.mark.timeout(300)


BODIES = {
    "texts": {"model": MODEL_NAME, "input": SENTENCES[:8]},
    "one text, base64, 128 dimensions": {"input": SENTENCES[8], "encoding_format": "base64", "dimensions": 128},
    "empty text": {"model": MODEL_NAME, "input": ["fine", ""]},
}


def _embed(source: Path, target: Path) -> tuple[int, str]:
    """Run the job to its end; check it left no child process and no /dev/shm folder."""
    run = run_embed(str(source), str(target))
    assert wait_until(lambda: not any(pid_alive(pid) for pid in run.children), 15), "a child outlived the job"
    assert not list(SHM_DIR.glob(f"infinity-emb-{run.pid}-*"))
    return run.code, run.err


def test_a_batch_file_answered_as_the_server_answers(server, tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": name, "method": "POST", "url": "/v1/embeddings", "body": body})
             for name, body in BODIES.items()]
    lines.insert(1, json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}))
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    target = tmp_path / "out.jsonl"

    code, err = _embed(source, target)
    assert code == 0, err
    assert "answered 2 of 4 batch requests (2 failed)" in err.splitlines()[-1], err
    assert [p.name for p in tmp_path.iterdir() if p.name != source.name] == [target.name]  # no temporary file

    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["custom_id"] for line in out] == ["texts", "chat", *list(BODIES)[1:]]
    assert out[1]["response"] is None and out[1]["error"]["code"] == "invalid_url"
    card = next(card for card in server.get("/v1/models").json()["data"] if card["id"] == MODEL_NAME)
    # Each within 1e-5 of sentence-transformers in float32 (tests/e2e/embed), so within 2e-5 of each other.
    tolerance = 2e-5 if card["dtype"] == "float32" else 2e-2
    server.wait_idle()
    for line in (out[0], *out[2:]):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        served = server.post("/v1/embeddings", BODIES[line["custom_id"]])
        assert response["status_code"] == served.status_code, (line["custom_id"], response)
        if served.status_code != 200:
            assert response["body"] == served.json()
            continue
        body, expected = response["body"], served.json()
        assert {k: v for k, v in unstamped(body).items() if k != "data"} == {
            k: v for k, v in unstamped(expected).items() if k != "data"}
        got = np.stack([decode_embedding(item["embedding"]) for item in body["data"]])
        want = np.stack([decode_embedding(item["embedding"]) for item in expected["data"]])
        assert got.shape == want.shape and got.shape[1] in (DIM, 128)
        np.testing.assert_allclose(got, want, atol=tolerance)
    assert out[3]["response"]["body"]["error"]["param"] == "input"
