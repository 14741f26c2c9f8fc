"""Hybrid (BGE-M3) models end to end: a tiny random folder in FlagEmbedding's layout, found
to be `kind = "hybrid"` and served on torch, against FlagEmbedding's own computations on
the same folder (tests/support/bge_m3.py): the dense vector of `/v1/embeddings`, the
sparse weights of `/embed_sparse`, the vectors per token of `outputs: ["multivector"]`,
the hybrid rerank score; one request for two or three outputs answers what the requests
for each answer; and the 4xx answers to fields that do not apply. One server serves
every model. In process, the CTranslate2 engine's token states give the torch engine's
three outputs (ONNX Runtime's do too, but its export takes longer than this module)."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
from tokenizers import Tokenizer

from infinity.api.binary import read_embeddings
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from tests.support.answers import assert_error, decode_embedding
from tests.support.bge_m3 import FlagEmbeddingM3, assert_same_weights, save_tiny_bge_m3, sparse_as_dict
from tests.support.reference import SAME_SCORES_ATOL, SAME_TEXTS_ATOL, assert_same_vectors
from tests.support.server import running_server
from tests.support.tiny_models import save_tiny_bert
from workers.heads import load_model

pytestmark = pytest.mark.timeout(300)

M3 = "tiny-bge-m3"
DENSE = "tiny-dense"
OUTPUTS = ("dense", "sparse", "multivector")
TEXTS = ["the quick brown fox jumps over a lazy dog", "seven wizards", "quartz sphinx 0 1 2",
         "a lazy dog while the fox jumps over the boxing matches of jumbo sized vexing numbers"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hybrid")
    return {M3: save_tiny_bge_m3(root / "bge-m3"), DENSE: save_tiny_bert(root / "dense")}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("hybrid-server")
    config = "".join(f'[[models]]\nname = "{name}"\nsource = "{folders[name]}"\nengine = "torch"\n'
                     for name in (M3, DENSE))
    with running_server(config=config, log_dir=log_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(folders) -> FlagEmbeddingM3:
    return FlagEmbeddingM3(folders[M3])


def _embeddings(server, status: int = 200, **fields) -> dict:
    answer = server.post("/v1/embeddings", {"model": M3, "input": TEXTS, **fields})
    assert answer.status_code == status, answer.text
    return answer.json()


def test_the_folder_is_served_as_hybrid_with_the_first_token_pooled(folders):
    spec = resolve_model(ModelConfig(name=M3, source=str(folders[M3])))
    assert (spec.kind, spec.pooling, spec.normalize) == ("hybrid", "cls", True)


def test_the_dense_vectors_are_flagembeddings_and_the_binary_answer_holds_them(server, reference):
    served = np.array([item["embedding"] for item in _embeddings(server)["data"]], dtype=np.float32)
    for vector, expected in zip(served, reference.encode(TEXTS)["dense_vecs"], strict=True):
        assert float(vector @ expected) / float(np.linalg.norm(vector) * np.linalg.norm(expected)) >= 0.99999
    answer = server.post("/v1/embeddings", {"model": M3, "input": TEXTS, "encoding_format": "bytes"})
    assert answer.status_code == 200, answer.text
    assert_same_vectors(read_embeddings(answer.content)[0], served, "the binary answer, another request")


def test_the_sparse_weights_are_flagembeddings_per_token_id(server, reference):
    answer = server.post("/embed_sparse", {"model": M3, "inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    expected = reference.encode(TEXTS)["lexical_weights"]
    for served, weights in zip(answer.json(), expected, strict=True):
        assert_same_weights(sparse_as_dict(served), weights)
    assert any(expected)  # relu left some tokens weighted


def test_the_vectors_per_token_are_flagembeddings_colbert_vectors(server, reference):
    data = _embeddings(server, outputs=["multivector"])["data"]
    for item, expected in zip(data, reference.encode(TEXTS)["colbert_vecs"], strict=True):
        assert item["shape"] == list(expected.shape) and set(item) == {"object", "index", "multivector", "shape"}
        np.testing.assert_allclose(np.array(item["multivector"], dtype=np.float32), expected, atol=1e-5)


@pytest.mark.parametrize("outputs", [list(pair) for pair in itertools.combinations(OUTPUTS, 2)] + [list(OUTPUTS)],
                         ids="+".join)
def test_one_request_answers_what_a_request_for_each_output_answers(server, outputs):
    """Within float32's noise: the two requests may be cut into batches of other lengths."""
    hybrid = _embeddings(server, outputs=outputs)
    for output in outputs:
        alone = _embeddings(server, outputs=[output])
        for together, apart in zip(hybrid["data"], alone["data"], strict=True):
            if output == "sparse":
                assert together["sparse"]["indices"] == apart["sparse"]["indices"]
                np.testing.assert_allclose(together["sparse"]["values"], apart["sparse"]["values"],
                                           atol=SAME_SCORES_ATOL)
            else:
                np.testing.assert_allclose(together[output], apart[output], atol=SAME_TEXTS_ATOL)
        assert hybrid["usage"] == alone["usage"]
    assert all(set(item) - {"object", "index", "shape"} == set(outputs) for item in hybrid["data"])


def test_the_dense_output_is_the_plain_answer_and_takes_dimensions_and_base64(server):
    plain = _embeddings(server, dimensions=8, encoding_format="base64")["data"]
    asked = _embeddings(server, outputs=["dense", "sparse"], dimensions=8, encoding_format="base64", top_k=2)["data"]
    assert_same_vectors([decode_embedding(item["dense"]) for item in asked],
                        [decode_embedding(item["embedding"]) for item in plain], "two requests' dense vectors")
    assert all(len(item["sparse"]["indices"]) <= 2 for item in asked)


def test_rerank_is_flagembeddings_hybrid_score(server, reference):
    query, documents = TEXTS[0], TEXTS[1:]
    answer = server.post("/v1/rerank", {"model": M3, "query": query, "documents": documents})
    assert answer.status_code == 200, answer.text
    served = {result["index"]: result["relevance_score"] for result in answer.json()["results"]}
    np.testing.assert_allclose([served[i] for i in range(len(documents))], reference.compute_score(query, documents),
                               atol=1e-5)


@pytest.mark.parametrize("model, fields, param", [
    (DENSE, {"outputs": ["dense"]}, "outputs"),
    (M3, {"outputs": ["sparse"], "dimensions": 8}, "dimensions"),
    (M3, {"outputs": ["dense"], "top_k": 3}, "top_k"),
    (M3, {"top_k": 3}, "top_k"),
    (M3, {"outputs": ["dense"], "embedding_types": ["float", "int8"]}, "embedding_types"),
    (M3, {"outputs": ["sparse", "dense"], "encoding_format": "bytes"}, "outputs"),
    (M3, {"outputs": ["sparse", "nonsense"]}, "outputs"),
])
def test_fields_that_do_not_apply_are_refused(server, model, fields, param):
    error = assert_error(server.post("/v1/embeddings", {"model": model, "input": TEXTS, **fields}), 422)
    assert error["param"] == param


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="ctranslate2 is not installed")
def test_ctranslate2_gives_the_torch_engines_outputs(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = Tokenizer.from_file(str(folders[M3] / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("<pad>"))
    encodings = tokenizer.encode_batch(TEXTS)
    ids, mask = (np.array([getattr(e, field) for e in encodings], dtype=np.int64) for field in ("ids", "attention_mask"))
    outputs = {engine: load_model(resolve_model(ModelConfig(name=M3, source=str(folders[M3]), engine=engine)),
                                  threads=1).forward(ids, mask, np.zeros_like(ids))
               for engine in ("torch", "ctranslate2")}
    for expected, tested in zip(outputs["torch"], outputs["ctranslate2"], strict=True):
        assert set(tested) == set(OUTPUTS)
        np.testing.assert_array_equal(tested["sparse"]["index"], expected["sparse"]["index"])
        for served, reference in ((tested["dense"], expected["dense"]), (tested["sparse"]["value"],
                                  expected["sparse"]["value"]), (tested["multivector"], expected["multivector"])):
            np.testing.assert_allclose(served, reference, atol=1e-5)
