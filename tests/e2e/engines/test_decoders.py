"""Decoder embedders served as their users run them (Qwen3-Embedding; gte-Qwen2: Qwen2 with
last-token pooling, normalised), in process on the torch engine's padding-free pass
(`workers.engines.packed_decoder`): parity with sentence-transformers on tiny random
folders built at test time, each input alone and in a batch of mixed lengths, with and
without the instruction prompt (a batch of queries behind it computes it once), in
float32 and (on CPUs that compute it) bfloat16 within the trial's bar; through
flash-attn's variable-length attention (a reference of it); `dimensions` (Matryoshka)
through the whole request path. The pass's token states against transformers' own
padded forward: tests/e2e/engines/test_engines.py; which engine `auto` picks:
tests/fast/test_engine_choice.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16
from infinity.shared.protocol import ModelSpec
from tests.e2e.engines.test_engines import _reference_varlen as reference_varlen
from tests.fast.inprocess import LoopedClient, ModelLauncher, serving_on_its_own_loop
from tests.support.tiny_models import QWEN3_TINY_PROMPTS, WORDS, save_tiny_decoder_embedder
from workers.engines.packed_decoder import PackedDecoder
from workers.engines.packing import shared_prefix
from workers.heads import LoadedModel, load_model
from workers.inference.precision import MEAN_COSINE, MIN_COSINE, run_trial
from workers.preprocess.text import TokenItem, collate_tokens, load_tokenizer

pytestmark = pytest.mark.timeout(300)

FAMILIES = ("qwen3", "qwen2")
FLOAT32_COSINE = 0.99999
QUERY = QWEN3_TINY_PROMPTS["query"]
# Words per text: from one token to most of the tiny models' 64 positions (the prompt takes many).
_WORDS_PER_TEXT = (1, 3, 20, 1, 9, 4, 2)


def _queries() -> list[str]:
    """Queries of mixed lengths behind the instruction prompt."""
    rng = np.random.default_rng(1)
    return [QUERY + " ".join(rng.choice(WORDS, count)) for count in (1, 4, 2, 5, 1, 3)]


def _texts() -> list[str]:
    """Texts of mixed lengths, every other one behind the instruction prompt (as a query)."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, count)) for count in _WORDS_PER_TEXT]
    return [QUERY + text if i % 2 else text for i, text in enumerate(texts)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    return {family: save_tiny_decoder_embedder(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


def _load(folder: Path, dtype: str = "float32") -> tuple[ModelSpec, LoadedModel]:
    """The folder's spec on the torch engine, and its model, padding-free."""
    spec = resolve_model(ModelConfig(name="decoder", source=str(folder), engine="torch", dtype=dtype))
    model = load_model(spec, threads=2)
    assert isinstance(model.engine._packed, PackedDecoder)
    return spec, model


def _batch(spec: ModelSpec, model: LoadedModel, texts: list[str]) -> dict[str, np.ndarray]:
    """`texts` as the server's tokenizer gives them, padded into one batch."""
    encodings = load_tokenizer(spec).encode_batch(texts)
    assert max(len(e.ids) for e in encodings) <= spec.max_length  # nothing to truncate
    return collate_tokens([TokenItem(np.array(e.ids, dtype=np.int32)) for e in encodings], model.engine.pad_id)


def _served_alone_and_together(spec: ModelSpec, model: LoadedModel, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The model's vectors for `texts`, one pass per input and one pass over all of them."""
    alone = [np.asarray(model.forward(**_batch(spec, model, [text]))) for text in texts]
    return np.concatenate(alone), np.asarray(model.forward(**_batch(spec, model, texts)))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_embedder_gives_sentence_transformers_vectors_alone_and_in_a_mixed_batch(folders, family):
    from sentence_transformers import SentenceTransformer

    spec, model = _load(folders[family])
    assert (spec.pooling, spec.normalize) == ("lasttoken", True)
    texts = _texts()
    alone, together = _served_alone_and_together(spec, model, texts)
    reference = SentenceTransformer(str(folders[family]), device="cpu")
    expected_alone = np.concatenate([reference.encode([text]) for text in texts])
    expected_together = reference.encode(texts)
    assert ((alone * expected_alone).sum(axis=1) >= FLOAT32_COSINE).all()
    assert ((together * expected_together).sum(axis=1) >= FLOAT32_COSINE).all()
    assert ((alone * together).sum(axis=1) >= FLOAT32_COSINE).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_queries_behind_one_prompt_compute_it_once_with_the_states_of_the_padded_forward(folders, family):
    """Their common leading tokens (the prompt's, and more where the texts' first words
    match) are computed for the first query only; every query's token states are still the
    module's own padded forward's, and its vector sentence-transformers'."""
    from sentence_transformers import SentenceTransformer

    spec, model = _load(folders[family])
    texts = _queries()
    batch = _batch(spec, model, texts)
    ids, mask = (torch.from_numpy(batch[name]) for name in ("input_ids", "attention_mask"))
    prompt_tokens = len(load_tokenizer(spec).encode(QUERY, add_special_tokens=False).ids)
    assert shared_prefix(ids, mask) >= prompt_tokens - 1  # the prompt's last token may merge with the text's first
    states = model.engine.forward(**batch)
    with torch.inference_mode():
        padded = model.engine._padded(ids, mask, torch.from_numpy(batch["token_type_ids"]))
    keep = mask.bool()
    torch.testing.assert_close(states[keep], padded[keep], atol=1e-5, rtol=1e-4)
    together = np.asarray(model.forward(**batch))
    reference = SentenceTransformer(str(folders[family]), device="cpu")
    expected_alone = np.concatenate([reference.encode([text]) for text in texts])
    assert ((together * expected_alone).sum(axis=1) >= FLOAT32_COSINE).all()


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)")
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_meets_the_trials_bar_against_float32_alone_and_in_a_mixed_batch(folders, family):
    spec, reduced = _load(folders[family], "bfloat16")
    _, exact = _load(folders[family])
    (figures,) = run_trial(spec, reduced, exact, threads=2)
    assert figures.mean_cosine >= MEAN_COSINE and figures.min_cosine >= MIN_COSINE, figures
    assert figures.mean_cosine < 1.0  # bfloat16 was computed, not float32 twice
    # Mixed lengths; then queries behind one prompt, computed once in the batch.
    for texts in (_texts(), _queries()):
        reduced_alone, reduced_together = _served_alone_and_together(spec, reduced, texts)
        exact_alone, _ = _served_alone_and_together(spec, exact, texts)
        for got in (reduced_alone, reduced_together):
            cosines = (got * exact_alone).sum(axis=1)
            assert cosines.mean() >= MEAN_COSINE and cosines.min() >= MIN_COSINE, cosines


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> Iterator[LoopedClient]:
    with serving_on_its_own_loop(ModelLauncher(), model=[
            ModelConfig(name=family, source=str(folders[family]), engine="torch") for family in FAMILIES]) as client:
        yield client


@pytest.mark.parametrize("family", FAMILIES)
def test_fewer_dimensions_are_sentence_transformers_vector_cut_and_renormalised(served, folders, family):
    from sentence_transformers import SentenceTransformer

    texts = [text.removeprefix(QUERY) for text in _texts()]
    status, answer = served.ask("POST", "/v1/embeddings", {"model": family, "input": texts, "dimensions": 8,
                                                           "prompt_name": "query"})
    assert status == 200, answer
    got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
    full = SentenceTransformer(str(folders[family]), device="cpu").encode(texts, prompt_name="query")
    expected = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, expected, atol=2e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_padding_free_pass_through_varlen_attention(folders, family):
    """On CUDA in half precision attention is flash-attn's, causal as its window (-1, 0)."""
    _, model = _load(folders[family])
    assert model.engine._packed.varlen is None  # flash-attn only on CUDA in half precision
    mask = np.zeros((4, 31), dtype=np.int64)
    for row, length in enumerate([5, 31, 1, 12]):
        mask[row, :length] = 1
    ids = np.where(mask == 1, np.arange(mask.size).reshape(mask.shape) % 250 + 7, model.engine.pad_id)
    padded = model.forward(ids, mask, np.zeros_like(ids))
    model.engine._packed.varlen = reference_varlen
    np.testing.assert_allclose(model.forward(ids, mask, np.zeros_like(ids)), padded, atol=1e-5)
