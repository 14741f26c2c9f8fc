"""Late chunking, the whole request path in one process on a tiny mean-pooling folder
(tests/fast/inprocess.py's `ModelLauncher`): each span's vector held to the mean of the
transformer's own hidden states over the tokens the span covers, normalised, by hand (with
and without a prompt); sentence splitting; the refusals; the fields in the OpenAPI document."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from infinity.api.late_chunking import sentence_spans
from infinity.config import ModelConfig
from tests.fast.inprocess import LoopedClient, ModelLauncher, serving_on_its_own_loop
from tests.support.tiny_models import WORDS, save_tiny_cross_encoder, save_tiny_prompted_encoder

pytestmark = pytest.mark.timeout(120)

MAX_LENGTH = 32
TEXT = "the quick brown fox. jumps over a lazy dog! while seven wizards"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("late")
    return {"embedder": save_tiny_prompted_encoder(root / "embedder", {"query": "query: "}, seed=5),
            "cls": save_tiny_prompted_encoder(root / "cls", {}, pooling="cls", seed=6),
            "reranker": save_tiny_cross_encoder(root / "reranker", seed=7)}


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> Iterator[LoopedClient]:
    with serving_on_its_own_loop(ModelLauncher(), model=[
            ModelConfig(name="embedder", source=str(folders["embedder"]), engine="torch", max_length=MAX_LENGTH),
            ModelConfig(name="cls", source=str(folders["cls"]), engine="torch", max_length=MAX_LENGTH),
            ModelConfig(name="reranker", source=str(folders["reranker"]), engine="torch")]) as client:
        yield client


def _by_hand(folder: Path, text: str, spans: list[tuple[int, int]], prompt: str = "") -> np.ndarray:
    """The span vectors by hand: the transformer's hidden states of the prompted text, the
    mean of the tokens overlapping each span (offsets shifted past the prompt), normalised."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    encoded = model.tokenizer(prompt + text, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0].numpy()
    special = offsets[:, 0] == offsets[:, 1]  # those the tokenizer adds, of no characters ([UNK] stands for some)
    offsets = offsets - len(prompt)
    with torch.no_grad():
        states = model[0].auto_model(**encoded).last_hidden_state[0].numpy()
    vectors = []
    for start, end in spans:
        covered = ~special & (offsets[:, 0] < end) & (offsets[:, 1] > start)
        vector = states[covered].mean(axis=0)
        vectors.append(vector / np.linalg.norm(vector))
    return np.array(vectors)


@pytest.mark.parametrize("fields, prompt", [({}, ""), ({"prompt_name": "query"}, "query: ")])
def test_span_vectors_are_the_mean_of_the_token_states_they_cover(served, folders, fields, prompt):
    spans = [(0, 9), (4, 19), (21, 40), (10, 13)]
    status, answer = served.ask("POST", "/v1/embeddings", {
        "model": "embedder", "input": [TEXT, "seven wizards"], "late_chunking": True,
        "spans": [[list(span) for span in spans], [[0, 13]]], **fields})
    assert status == 200, answer
    first, second = answer["data"]
    assert "embedding" not in first
    assert [(each["start"], each["end"]) for each in first["spans"]] == spans
    np.testing.assert_allclose([each["embedding"] for each in first["spans"]],
                               _by_hand(folders["embedder"], TEXT, spans, prompt), atol=1e-5)
    np.testing.assert_allclose([second["spans"][0]["embedding"]],
                               _by_hand(folders["embedder"], "seven wizards", [(0, 13)], prompt), atol=1e-5)
    from transformers import AutoTokenizer

    prompt_tokens = len(AutoTokenizer.from_pretrained(str(folders["embedder"]))(prompt, add_special_tokens=False)[
        "input_ids"])
    assert (first["spans"][0]["token_start"], first["spans"][0]["token_end"]) == (1 + prompt_tokens, 3 + prompt_tokens)


def test_split_sentences_embeds_each_sentence(served, folders):
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "embedder", "input": TEXT,
                                                           "late_chunking": True, "split": "sentences"})
    assert status == 200, answer
    spans = [(0, 20), (21, 43), (44, 63)]
    assert [TEXT[start:end] for start, end in spans] == ["the quick brown fox.", "jumps over a lazy dog!",
                                                         "while seven wizards"]
    items = answer["data"][0]["spans"]
    assert [(each["start"], each["end"]) for each in items] == spans
    np.testing.assert_allclose([each["embedding"] for each in items], _by_hand(folders["embedder"], TEXT, spans),
                               atol=1e-5)


@pytest.mark.parametrize("text, spans", [
    ("One. Two!  Three?\nfour\n\n five", [(0, 4), (5, 9), (11, 17), (18, 22), (25, 29)]),
    ("3.14 is pi", [(0, 10)]),
    ("  \n ", []),
])
def test_sentences_end_at_punctuation_before_whitespace_or_at_newlines(text, spans):
    assert sentence_spans(text) == spans


@pytest.mark.parametrize("body, param", [
    ({"model": "cls", "input": "the fox", "late_chunking": True, "split": "sentences"}, "late_chunking"),
    ({"model": "embedder", "input": "the fox", "split": "sentences"}, "late_chunking"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True}, "spans"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True, "spans": [[[0, 3]]], "split": "sentences"},
     "spans"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True, "spans": [[[0, 8]]]}, "spans"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True, "spans": [[[0, 3]], [[0, 3]]]}, "spans"),
    ({"model": "embedder", "input": "the   fox", "late_chunking": True, "spans": [[[3, 6]]]}, "spans"),
    ({"model": "embedder", "input": " ".join(WORDS * 2), "late_chunking": True, "split": "sentences"}, "input"),
    ({"model": "embedder", "input": [[1, 2]], "late_chunking": True, "spans": [[[0, 1]]]}, "input"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True, "split": "sentences", "long_inputs": "chunk"},
     "long_inputs"),
    ({"model": "embedder", "input": "the fox", "late_chunking": True, "split": "sentences",
      "encoding_format": "bytes"}, "encoding_format"),
])
def test_what_late_chunking_cannot_honour_is_refused(served, body, param):
    status, answer = served.ask("POST", "/v1/embeddings", body)
    assert status == 422, answer
    assert answer["error"]["param"] == param, answer


def test_a_reranker_is_refused(served):
    status, _ = served.ask("POST", "/v1/embeddings", {"model": "reranker", "input": "the fox", "late_chunking": True,
                                                      "split": "sentences"})
    assert status == 400, "a model of kind rerank is not served on /v1/embeddings"


def test_the_openapi_document_has_the_late_chunking_fields(served):
    _, document = served.ask("GET", "/openapi.json")
    schemas = document["components"]["schemas"]
    assert {"late_chunking", "spans", "split"} <= set(schemas["EmbeddingRequest"]["properties"])
    assert "spans" in schemas["EmbeddingData"]["properties"]
    assert {"start", "end", "token_start", "token_end", "embedding"} <= set(schemas["SpanEmbedding"]["properties"])


def test_a_batch_gives_token_states_to_the_inputs_that_ask_and_vectors_to_the_others():
    import torch

    from infinity.shared.protocol import TOKEN_STATES
    from workers.heads import LoadedModel

    states = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    mask = np.array([[1, 1, 1], [1, 1, 0]])

    class Engine:
        def forward(self, *arrays: np.ndarray, wide: bool, express: bool) -> torch.Tensor:
            return states

    def head(raw: torch.Tensor, read: torch.Tensor) -> np.ndarray:
        return raw.sum(dim=1).numpy()

    vector, token_states = LoadedModel(Engine(), head, "float32").forward(  # type: ignore[arg-type]
        np.zeros((2, 3), np.int64), mask, np.zeros((2, 3), np.int64), vector_types=[(), (TOKEN_STATES,)])
    np.testing.assert_array_equal(vector, states[0].sum(dim=0).numpy())
    np.testing.assert_array_equal(token_states[TOKEN_STATES], states[1, :2].numpy())
