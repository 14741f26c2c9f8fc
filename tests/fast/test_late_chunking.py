"""Late chunking, the whole request path in one process on a tiny mean-pooling folder
(tests/fast/inprocess.py's `ModelLauncher`): each span's vector held to the mean of the
transformer's own hidden states over the tokens the span covers, normalised, by hand (with
and without a prompt); texts longer than the model read in windows, held to the transformer
run on each window by hand, states picked by the window centre rule; `usage` counting every
window; the cap on windows (422, the server serves on) and a queue without room for them
(429); sentence splitting; the refusals; the fields in the OpenAPI document."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from infinity.api.late_chunking import macro_windows, sentence_spans, state_sources
from infinity.config import ModelConfig
from tests.fast.inprocess import LoopedClient, ModelLauncher, serving_on_its_own_loop
from tests.support.tiny_models import WORDS, save_tiny_cross_encoder, save_tiny_prompted_encoder

pytestmark = pytest.mark.timeout(120)

MAX_LENGTH = 32
TEXT = "the quick brown fox. jumps over a lazy dog! while seven wizards"
# 70 words of the tiny vocabulary, one token each: with [CLS] and [SEP], 72 tokens, past MAX_LENGTH.
LONG_WORDS = (list(WORDS) * 3)[:70]
LONG = " ".join(LONG_WORDS)


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
            ModelConfig(name="capped", source=str(folders["embedder"]), engine="torch", max_length=MAX_LENGTH,
                        max_chunks_per_input=2),
            ModelConfig(name="cls", source=str(folders["cls"]), engine="torch", max_length=MAX_LENGTH),
            ModelConfig(name="reranker", source=str(folders["reranker"]), engine="torch")]) as client:
        yield client


def _by_hand(folder: Path, text: str, spans: list[tuple[int, int]], prompt: str = "") -> np.ndarray:
    """The span vectors by hand: the transformer's hidden states of the prompted text, the
    mean of the tokens overlapping each span (offsets shifted past the prompt), normalised."""
    ids, offsets, special = _tokens(folder, prompt + text)
    return _pooled(_hidden_states(folder, ids), offsets - len(prompt), special, spans)


def _tokens(folder: Path, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(ids, character offsets, whether each is a token the tokenizer adds) of `text`."""
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(str(folder))(text, return_offsets_mapping=True)
    offsets = np.array(encoded["offset_mapping"])
    return encoded["input_ids"], offsets, offsets[:, 0] == offsets[:, 1]  # added tokens: no characters


def _hidden_states(folder: Path, ids: list[int]) -> np.ndarray:
    """The transformer's last hidden states of one sequence of token ids."""
    import torch
    from transformers import AutoModel

    with torch.no_grad():
        return AutoModel.from_pretrained(str(folder)).eval()(torch.tensor([ids])).last_hidden_state[0].numpy()


def _pooled(states: np.ndarray, offsets: np.ndarray, special: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    vectors = []
    for start, end in spans:
        covered = ~special & (offsets[:, 0] < end) & (offsets[:, 1] > start)
        vector = states[covered].mean(axis=0)
        vectors.append(vector / np.linalg.norm(vector))
    return np.array(vectors)


def _windows_by_hand(folder: Path, text: str, prompt: str, head: int,
                     windows: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each token's state, offsets past the prompt, added-token flags) of the prompted
    `text` read in `windows` (ranges of its text tokens, after the `head` special and
    prompt tokens; [SEP] closes each): each window run alone, each text token's state from
    the window where its context on a cut side is largest, the first such on a tie."""
    ids, offsets, special = _tokens(folder, prompt + text)
    body = len(ids) - head - 1
    window_states = [_hidden_states(folder, ids[:head] + ids[head + start:head + stop] + ids[-1:])
                     for start, stop in windows]
    states = np.zeros((len(ids), window_states[0].shape[1]), dtype=np.float32)
    for token in range(body):
        best, best_context = None, -1.0
        for (start, stop), window in zip(windows, window_states):
            if start <= token < stop:
                before = token - start if start > 0 else float("inf")
                after = stop - 1 - token if stop < body else float("inf")
                if min(before, after) > best_context:
                    best, best_context = window[head + token - start], min(before, after)
        states[head + token] = best
    return states, offsets - len(prompt), special


def _word_span(first: int, last: int) -> tuple[int, int]:
    """The characters of LONG's words `first` to `last`, both included."""
    start = len(" ".join(LONG_WORDS[:first])) + (1 if first else 0)
    return start, len(" ".join(LONG_WORDS[:last + 1]))


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


@pytest.mark.parametrize("fields, prompt, head, windows", [
    # 70 text tokens; windows of 30 (32 less [CLS] and [SEP]) sharing 30 // 4 = 7 start every
    # 23 tokens, the third moved back from 46 to end at the last token.
    ({}, "", 1, [(0, 30), (23, 53), (40, 70)]),
    # A prompt of two words, two tokens, in every window: windows of 28 sharing 7, every 21.
    ({"prompt": "seven wizards "}, "seven wizards ", 3, [(0, 28), (21, 49), (42, 70)]),
    ({"chunk_overlap": 10}, "", 1, [(0, 30), (20, 50), (40, 70)]),
])
def test_a_text_longer_than_the_model_is_read_in_windows_each_token_from_its_most_central(
        served, folders, fields, prompt, head, windows):
    # Spans across window edges, the whole text, and a word at each end.
    spans = [_word_span(20, 35), _word_span(45, 55), _word_span(0, 69), _word_span(3, 3), _word_span(69, 69)]
    status, answer = served.ask("POST", "/v1/embeddings", {
        "model": "embedder", "input": [LONG, "seven wizards"], "late_chunking": True,
        "spans": [[list(span) for span in spans], [[0, 13]]], **fields})
    assert status == 200, answer
    items = answer["data"][0]["spans"]
    np.testing.assert_allclose([each["embedding"] for each in items],
                               _pooled(*_windows_by_hand(folders["embedder"], LONG, prompt, head, windows), spans),
                               atol=1e-5)
    assert [(each["token_start"], each["token_end"]) for each in items[:3]] == [
        (head + 20, head + 36), (head + 45, head + 56), (head, head + 70)]  # among the whole text's tokens
    np.testing.assert_allclose([answer["data"][1]["spans"][0]["embedding"]],
                               _by_hand(folders["embedder"], "seven wizards", [(0, 13)], prompt), atol=1e-5)
    short = len(_tokens(folders["embedder"], prompt + "seven wizards")[0])
    assert answer["usage"]["prompt_tokens"] == len(windows) * MAX_LENGTH + short  # every window's tokens


def test_a_text_is_tokenized_once_and_its_windows_given_to_the_pass_as_token_ids(served, folders, monkeypatch):
    from infinity.client.engine_client import EngineClient

    sent, run = [], EngineClient.run

    async def recording_run(self, model, inputs):  # noqa: ANN001, ANN202
        sent.append(inputs)
        return await run(self, model, inputs)

    monkeypatch.setattr(EngineClient, "run", recording_run)
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "embedder", "input": LONG, "late_chunking": True,
                                                           "split": "sentences"})
    assert status == 200, answer
    (inputs,) = sent  # one run, of every window
    ids = _tokens(folders["embedder"], LONG)[0]
    assert inputs.texts is None
    assert inputs.token_ids == [ids[:1] + ids[1 + start:1 + stop] + ids[-1:] for start, stop in [(0, 30), (23, 53),
                                                                                                    (40, 70)]]


@pytest.mark.parametrize("tokens, size, overlap, windows", [
    (10, 12, 3, [(0, 10)]),
    (10, 6, 2, [(0, 6), (4, 10)]),
    (11, 4, 1, [(0, 4), (3, 7), (6, 10), (7, 11)]),
])
def test_windows_start_every_size_less_overlap_and_the_last_ends_at_the_last_token(tokens, size, overlap, windows):
    assert macro_windows(tokens, size, overlap) == windows


def test_each_token_is_read_where_it_is_furthest_from_a_cut():
    # The overlap [4, 6) splits in its middle; an uncut side counts as unbounded.
    assert state_sources([(0, 6), (4, 10)], 0, 10).tolist() == [0] * 5 + [1] * 5
    # Token 6 has 1 token of context on its nearer cut side in windows 0 and 1, token 8 has 2
    # in windows 1 and 2: the earlier wins.
    assert state_sources([(2, 8), (5, 11), (6, 12)], 2, 12).tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]


def test_past_max_chunks_per_input_windows_is_a_422_and_the_server_serves_on(served):
    for _ in range(3):  # nothing is held by the refused requests
        status, answer = served.ask("POST", "/v1/embeddings", {"model": "capped", "input": LONG,
                                                               "late_chunking": True, "split": "sentences"})
        assert (status, answer["error"]["param"]) == (422, "input"), answer
        assert "3 windows" in answer["error"]["message"] and "max_chunks_per_input" in answer["error"]["message"]
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "capped", "input": " ".join(LONG_WORDS[:50]),
                                                           "late_chunking": True, "split": "sentences"})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 2 * MAX_LENGTH, answer


def test_windows_find_no_room_in_a_full_queue_and_are_answered_429(folders):
    """Each window takes a slot of the queue before anything runs: a queue of two has no
    room for three windows, and serves two."""
    model = ModelConfig(name="embedder", source=str(folders["embedder"]), engine="torch", max_length=MAX_LENGTH)
    with serving_on_its_own_loop(ModelLauncher(), model=model, max_queued_items=2) as client:
        body = {"input": LONG, "late_chunking": True, "split": "sentences"}
        status, answer = client.ask("POST", "/v1/embeddings", body)
        assert status == 429, answer
        assert client.ask("POST", "/v1/embeddings", {**body, "input": " ".join(LONG_WORDS[:50])})[0] == 200


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
    ({"model": "embedder", "input": LONG, "late_chunking": True, "split": "sentences", "chunk_overlap": 15},
     "chunk_overlap"),  # half of a window's 30 text tokens
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


@pytest.mark.parametrize("path", ["/v1/embed", "/v2/embed"])
@pytest.mark.parametrize("fields, param", [
    ({"late_chunking": True, "split": "sentences"}, "late_chunking"),
    ({"spans": [[[0, 3]]]}, "spans"),
    ({"split": "sentences"}, "split"),
])
def test_cohere_embed_refuses_late_chunking_rather_than_ignoring_it(served, path, fields, param):
    status, answer = served.ask("POST", path, {"model": "embedder", "texts": ["the fox"], **fields})
    assert (status, answer["error"]["param"]) == (422, param), answer
    assert "/v1/embeddings" in answer["error"]["message"]
    status, _ = served.ask("POST", path, {"model": "embedder", "texts": ["the fox"], "late_chunking": False})
    assert status == 200


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
    cohere = schemas["CohereEmbedRequest"]["properties"]
    assert all("Not taken here" in str(cohere[field]) for field in ("late_chunking", "spans", "split"))


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
