"""Vectors before the model's final Normalize (`protocol.UNNORMALIZED`), as TEI's
`normalize: false` and vLLM's `use_activation: false` ask them, in process against the fake
engine: each row of a batch gets what its own request asked (a mixed batch too), the
routes answer what a model configured without Normalize answers, `dimensions` cuts them
without re-normalising, and kinds whose head cannot give them refuse naming the field."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_replicas
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import TOKEN_STATES, UNNORMALIZED
from tests.fast.inprocess import FakeEngine, serving_on_its_own_loop, token_states
from tests.support.tiny_models import save_tiny_clip
from workers.heads import LoadedModel, load_head

pytestmark = pytest.mark.timeout(120)

TEXTS = ["a short sentence", "another sentence about servers and their answers", "x"]


def test_each_row_of_a_batch_gets_what_its_request_asked():
    (spec,) = resolve_replicas(ModelConfig(name="m", engine="torch"))
    engine = FakeEngine(spec, KINDS["embed"].outputs, threading.Event())
    engine._gate.set()
    model = LoadedModel(engine, load_head(spec), "float32")
    ids = np.array([[101, 2023, 2003, 102, 0], [101, 7592, 102, 0, 0], [101, 2045, 2003, 1037, 102]])
    mask = (ids != 0).astype(np.int64)
    means = np.stack([token_states(row[row != 0], model.head.dim).mean(axis=0) for row in ids])
    normalised = means / np.linalg.norm(means, axis=1, keepdims=True)
    asked = [(UNNORMALIZED,), (), (UNNORMALIZED,)]
    mixed = model.forward(ids, mask, np.zeros_like(ids), vector_types=asked)
    np.testing.assert_allclose(mixed, [means[0], normalised[1], means[2]], rtol=1e-5, atol=1e-7)
    every = model.forward(ids, mask, np.zeros_like(ids), vector_types=[(UNNORMALIZED,)] * 3)
    np.testing.assert_allclose(every, means, rtol=1e-5, atol=1e-7)
    with_states = model.forward(ids, mask, np.zeros_like(ids), vector_types=[(UNNORMALIZED,), (TOKEN_STATES,), ()])
    np.testing.assert_allclose(with_states[0], means[0], rtol=1e-5, atol=1e-7)
    assert with_states[1][TOKEN_STATES].shape == (3, model.head.dim)
    np.testing.assert_allclose(with_states[2], normalised[2], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    clip = save_tiny_clip(tmp_path_factory.mktemp("clip") / "clip")
    models = [ModelConfig(name="m", engine="torch", default=True),
              ModelConfig(name="raw", engine="torch", normalize=False),
              ModelConfig(name="clip", source=str(clip), engine="torch")]
    with serving_on_its_own_loop(model=models) as client:
        yield client


def _vectors(answer: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in answer["data"]])


def test_every_route_answers_what_a_model_without_normalize_gives(server):
    _, raw = server.ask("POST", "/v1/embeddings", {"model": "raw", "input": TEXTS})
    expected = _vectors(raw)
    assert not np.allclose(np.linalg.norm(expected, axis=1), 1.0)
    status, tei = server.ask("POST", "/embed", {"inputs": TEXTS, "normalize": False})
    assert status == 200, tei
    np.testing.assert_allclose(tei, expected, atol=1e-6)
    status, vllm = server.ask("POST", "/v1/embeddings", {"model": "m", "input": TEXTS, "use_activation": False})
    assert status == 200, vllm
    np.testing.assert_allclose(_vectors(vllm), expected, atol=1e-6)
    status, pooled = server.ask("POST", "/pooling", {"model": "m", "input": TEXTS, "use_activation": False})
    assert status == 200, pooled
    np.testing.assert_allclose([item["data"] for item in pooled["data"]], expected, atol=1e-6)
    _, normalised = server.ask("POST", "/v1/embeddings", {"model": "m", "input": TEXTS})
    np.testing.assert_allclose(_vectors(normalised), expected / np.linalg.norm(expected, axis=1, keepdims=True),
                               atol=1e-6)


def test_dimensions_cut_them_without_re_normalising(server):
    _, raw = server.ask("POST", "/v1/embeddings", {"model": "raw", "input": TEXTS})
    for route, body in (("/embed", {"inputs": TEXTS, "normalize": False, "dimensions": 8}),
                        ("/v1/embeddings", {"model": "m", "input": TEXTS, "use_activation": False, "dimensions": 8})):
        status, answer = server.ask("POST", route, body)
        assert status == 200, answer
        np.testing.assert_allclose(answer if route == "/embed" else _vectors(answer), _vectors(raw)[:, :8],
                                   atol=1e-6)


def test_a_kind_whose_head_cannot_give_them_refuses_naming_the_field(server):
    status, error = server.ask("POST", "/v1/embeddings", {"model": "clip", "input": TEXTS, "use_activation": False})
    assert status == 422 and error["error"]["param"] == "use_activation", error
    assert "embed" in error["error"]["message"]
    status, error = server.ask("POST", "/v1/embeddings", {"model": "m", "input": TEXTS, "use_activation": False,
                                                          "late_chunking": True, "split": "sentences"})
    assert status == 422 and error["error"]["param"] == "use_activation", error
