"""Inputs cut at their start (vLLM's `truncate_prompt_tokens` k, TEI's `truncation_direction`
Left) in process, against the fake engine: a long text's vector is that of the ids a
tokenizer cutting on the left gives (its last k tokens, special tokens counted), on every
route that takes the fields; what cannot be cut so (pairs, a prompt, chunks, beyond the
model's length) is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_replicas
from tests.fast.inprocess import serving_on_its_own_loop
from tests.support.tiny_models import save_tiny_cross_encoder

pytestmark = pytest.mark.timeout(120)

LONG = " ".join(f"word{i % 50} of a long text" for i in range(200))  # far beyond 256 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reranker = save_tiny_cross_encoder(tmp_path_factory.mktemp("kept") / "rerank")
    models = [ModelConfig(name="m", engine="torch", prompts={"query": "query: "}),
              ModelConfig(name="rerank", source=str(reranker), engine="torch")]
    with serving_on_its_own_loop(model=models) as client:
        yield client


def _last_ids(text: str, keep: int) -> list[int]:
    (spec,) = resolve_replicas(ModelConfig(name="m"))
    tokenizer = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(keep, direction="left")
    return tokenizer.encode(text).ids


def _vector(server, body: dict) -> np.ndarray:
    status, answer = server.ask("POST", "/v1/embeddings", {"model": "m", **body})
    assert status == 200, answer
    return np.array(answer["data"][0]["embedding"])


def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens(server):
    for keep in (9, 256):
        ids = _last_ids(LONG, keep)
        assert len(ids) == keep
        status, answer = server.ask("POST", "/v1/embeddings", {"model": "m", "input": LONG,
                                                               "truncate_prompt_tokens": keep})
        assert status == 200, answer
        assert (answer["usage"]["prompt_tokens"], answer["usage"]["truncated_inputs"]) == (keep, 1)
        np.testing.assert_allclose(answer["data"][0]["embedding"], _vector(server, {"input": [ids]}), atol=1e-6)
    tokens = list(range(1000, 1300))
    np.testing.assert_allclose(_vector(server, {"input": [tokens], "truncate_prompt_tokens": 5}),
                               _vector(server, {"input": [tokens[-5:]]}), atol=1e-6)
    status, pooled = server.ask("POST", "/pooling", {"model": "m", "input": LONG, "truncate_prompt_tokens": 9})
    assert status == 200
    np.testing.assert_allclose(pooled["data"][0]["data"], _vector(server, {"input": [_last_ids(LONG, 9)]}), atol=1e-6)


def test_teis_left_direction_keeps_the_models_length_of_last_tokens(server):
    expected = _vector(server, {"input": [_last_ids(LONG, 256)]})
    for truncate in (True, None):  # none: as the model is set, which truncates
        body = {"inputs": LONG, "truncation_direction": "Left", **({"truncate": truncate} if truncate else {})}
        status, vectors = server.ask("POST", "/embed", body)
        assert status == 200, vectors
        np.testing.assert_allclose(vectors[0], expected, atol=1e-6)
    status, right = server.ask("POST", "/embed", {"inputs": LONG, "truncation_direction": "right"})
    assert status == 200 and not np.allclose(right[0], expected)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "m", "input": LONG, "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "m", "input": LONG, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "m", "input": LONG, "truncate_prompt_tokens": 9, "input_type": "query"},
     "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "m", "input": LONG, "truncate_prompt_tokens": 9, "long_inputs": "chunk"},
     "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "m", "input": LONG, "truncate_prompt_tokens": 9, "late_chunking": True,
                        "split": "sentences"}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"model": "rerank", "query": "a", "documents": [LONG], "truncate_prompt_tokens": 9},
     "truncate_prompt_tokens"),
    ("/score", {"model": "rerank", "text_1": "a", "text_2": LONG, "truncate_prompt_tokens": 9},
     "truncate_prompt_tokens"),
])
def test_what_cannot_be_cut_at_its_start_is_refused_naming_the_field(server, path, body, param):
    status, error = server.ask("POST", path, body)
    assert status == 422 and error["error"]["param"] == param, error


def test_tei_refuses_left_on_rerank_and_after_a_prompt_in_its_shape(server):
    status, error = server.ask("POST", "/rerank", {"query": "a", "texts": [LONG], "truncation_direction": "Left"})
    assert status == 422 and "truncation_direction" in error["error"] and "error_type" in error, error
    status, error = server.ask("POST", "/embed", {"inputs": LONG, "truncation_direction": "Left",
                                                  "prompt_name": "query"})
    assert status == 422 and "truncation_direction" in error["error"], error


def test_add_special_tokens_false_reads_texts_without_the_models_special_tokens(server):
    (spec,) = resolve_replicas(ModelConfig(name="m"))
    tokenizer = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    for text in ("a short text", LONG):
        bare = tokenizer.encode(text, add_special_tokens=False).ids
        assert bare != tokenizer.encode(text).ids
        expected = _vector(server, {"input": [bare]})
        for path, body, read in (("/v1/embeddings", {"model": "m"}, lambda answer: answer["data"][0]["embedding"]),
                                 ("/pooling", {"model": "m"}, lambda answer: answer["data"][0]["data"])):
            status, answer = server.ask("POST", path, {**body, "input": text, "add_special_tokens": False})
            assert status == 200, answer
            np.testing.assert_allclose(read(answer), expected, atol=1e-6)
    tokenizer.no_truncation()
    kept = tokenizer.encode(LONG, add_special_tokens=False).ids[-9:]
    np.testing.assert_allclose(_vector(server, {"input": LONG, "add_special_tokens": False, "truncate_prompt_tokens": 9}),
                               _vector(server, {"input": [kept]}), atol=1e-6)
    for fields in ({"input_type": "query"}, {"long_inputs": "chunk"}):
        status, error = server.ask("POST", "/v1/embeddings", {"model": "m", "input": LONG, "add_special_tokens": False,
                                                              **fields})
        assert status == 422 and error["error"]["param"] == "add_special_tokens", error
