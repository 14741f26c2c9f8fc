"""The model zoo (tests/support/zoo.py) served by one server and held to the reference
library on the same weights: every embedder's vectors to sentence-transformers' (cosine
>= 0.99999, alone and in a mixed-length batch, with its prompt where it has one), every
cross-encoder's scores to CrossEncoder.predict and the classifier's to transformers'
softmax (within 1e-5); /v1/models shows each embedder's module chain."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.server import running_server
from tests.support.zoo import EMBEDDER_PROMPTS, EMBEDDERS, ENGINES, SCORERS

TEXTS = ["the quick brown fox", "a lazy dog jumps over seven wizards while the sphinx judges quartz numbers",
         "boxing", "jumbo sized vexing quartz 7 8 9 and the quick fox again"]
QUERY = "the quick fox"
DOCUMENTS = ["a lazy dog", "quick brown fox jumps", "seven wizards judge boxing matches of jumbo sized quartz"]
COSINE = 0.99999


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    folders = {name: build(root / name) for name, build in {**EMBEDDERS, **SCORERS}.items()}
    config = root / "models.toml"
    # torch (a static model's own engine aside): the chain after the encoder is the same code
    # on every engine (test_a_chain_on_every_engine), and converting every model would take minutes.
    config.write_text("".join(f'[[models]]\nname = "{name}"\nsource = "{folder}"\n'
                              f'engine = "{ENGINES.get(name, "torch")}"\nlone_engine = "none"\n'
                              for name, folder in folders.items()))
    with running_server("--config", str(config), log_dir=root) as server:
        yield server, folders


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)


@pytest.mark.parametrize("name", EMBEDDERS)
def test_an_embedder_gives_sentence_transformers_vectors(zoo, name):
    from sentence_transformers import SentenceTransformer

    server, folders = zoo
    prompt_name = EMBEDDER_PROMPTS.get(name)
    reference = SentenceTransformer(str(folders[name]), device="cpu")
    expected = reference.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
    fields = {"prompt_name": prompt_name} if prompt_name else {}
    batch = server.embed(TEXTS, model=name, **fields)
    assert batch.status_code == 200, batch.text
    got = np.array([row["embedding"] for row in batch.json()["data"]], dtype=np.float32)
    assert got.shape == expected.shape
    assert (_cosines(got, expected) >= COSINE).all(), _cosines(got, expected)
    # The vectors' lengths too: a model without Normalize is not normalised, one with it is.
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)
    alone = server.embed(TEXTS[1], model=name, **fields).json()["data"][0]["embedding"]
    assert _cosines(np.array([alone]), expected[1:2])[0] >= COSINE


@pytest.mark.parametrize("name", ["bert-cls", "sentence-t5", "embeddinggemma", "model2vec"])
def test_vectors_before_the_final_normalize_are_sentence_transformers_without_it(zoo, name):
    """vLLM's `use_activation: false` (on `/v1/embeddings` and `/pooling`; TEI's `normalize:
    false` is the same request inside) on a model whose chain ends with Normalize: its
    vector from every module before that one (a plain mean, Dense layers, a static model),
    held to sentence-transformers run without its last module; `dimensions` cuts it
    without re-normalising."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize

    server, folders = zoo
    reference = SentenceTransformer(str(folders[name]), device="cpu")
    modules = list(reference)
    assert isinstance(modules[-1], Normalize)
    expected = SentenceTransformer(modules=modules[:-1], device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert not np.allclose(np.linalg.norm(expected, axis=1), 1.0)
    vllm = server.embed(TEXTS, model=name, use_activation=False)
    pooled = server.post("/pooling", {"model": name, "input": TEXTS, "use_activation": False})
    for answer in (vllm, pooled):
        assert answer.status_code == 200, answer.text
    rows = {"use_activation": np.array([item["embedding"] for item in vllm.json()["data"]], dtype=np.float32),
            "pooling": np.array([item["data"] for item in pooled.json()["data"]], dtype=np.float32)}
    for route, got in rows.items():
        assert (_cosines(got, expected) >= COSINE).all(), (route, _cosines(got, expected))
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)
    short = server.embed(TEXTS, model=name, use_activation=False, dimensions=8).json()["data"]
    # Two requests' vectors (other batches): their sums may round apart, as SAME_TEXTS_ATOL says of unit vectors.
    np.testing.assert_allclose([item["embedding"] for item in short], rows["use_activation"][:, :8], rtol=1e-5,
                               atol=1e-6)
    normalised = np.array([item["embedding"] for item in server.embed(TEXTS, model=name).json()["data"]])
    np.testing.assert_allclose(normalised, rows["use_activation"] / np.linalg.norm(
        rows["use_activation"], axis=1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("name", [name for name in SCORERS if "cross-encoder" in name])
def test_a_cross_encoder_scores_as_sentence_transformers(zoo, name):
    from sentence_transformers import CrossEncoder

    server, folders = zoo
    answer = server.post("/v1/rerank", {"model": name, "query": QUERY, "documents": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    served = {result["index"]: result["relevance_score"] for result in answer.json()["results"]}
    expected = CrossEncoder(str(folders[name]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose([served[i] for i in range(len(DOCUMENTS))], expected, atol=1e-5)


def test_a_distilbert_classifier_scores_as_transformers(zoo):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, folders = zoo
    folder = folders["distilbert-classifier"]
    answer = server.post("/v1/classify", {"model": "distilbert-classifier", "input": TEXTS})
    assert answer.status_code == 200, answer.text
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        expected = torch.softmax(model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    labels = model.config.id2label
    for row, probabilities in zip(answer.json()["data"], expected, strict=True):
        served = {item["label"]: item["score"] for item in row}
        np.testing.assert_allclose([served[labels[i]] for i in range(len(labels))], probabilities, atol=1e-5)


def test_models_show_each_embedders_module_chain(zoo):
    server, _ = zoo
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert cards["embeddinggemma"]["modules"] == ["Pooling(mean)", "Dense(32->128, Identity, no bias)",
                                                  "Dense(128->32, Identity, no bias)", "Normalize"]
    assert cards["bert-cls-mean-sqrt"]["modules"] == ["Pooling(cls+mean_sqrt_len_tokens)"]
    assert cards["bert-cls-mean-sqrt"]["dimensions"] == 64
    assert cards["bert-dense-residual"]["modules"] == ["Pooling(mean)", "Dense(32->16, Identity, residual)"]
    assert cards["bert-cross-encoder"]["modules"] == []
    assert (cards["model2vec"]["backend"], cards["model2vec"]["modules"]) == ("static", ["Pooling(mean)", "Normalize"])


@pytest.mark.parametrize("name, engine", [
    ("bert-dense-gelu-layernorm", "torch"), ("bert-dense-gelu-layernorm", "ctranslate2"),
    ("bert-dense-gelu-layernorm", "onnx"), ("bert-dense-gelu-layernorm", "openvino"),
    ("embeddinggemma", "onnx"), ("sentence-t5", "onnx"), ("distilbert-mean", "onnx"),
])
def test_a_chain_on_every_engine(tmp_path, monkeypatch, name, engine):
    """The modules after the encoder run after every engine's pass, and the families new to
    the zoo export to ONNX Runtime and OpenVINO (which `engine = "auto"` picks on CPUs)."""
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from infinity.config import ModelConfig
    from infinity.folders.resolve import resolve_model
    from workers.heads import load_model

    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    folder = EMBEDDERS[name](tmp_path / name)
    spec = resolve_model(ModelConfig(name=name, source=str(folder), engine=engine, lone_engine="none"))
    model = load_model(spec, 2)
    assert model.engine.name == engine
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    encoded = [tokenizer.encode(text).ids for text in TEXTS]
    ids = np.zeros((len(TEXTS), max(map(len, encoded))), dtype=np.int64)
    for row, tokens in enumerate(encoded):
        ids[row, :len(tokens)] = tokens
    mask = (np.arange(ids.shape[1]) < np.array([[len(tokens)] for tokens in encoded])).astype(np.int64)
    got = model.forward(ids, mask, np.zeros_like(ids))
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert (_cosines(got, expected) >= COSINE).all(), _cosines(got, expected)
