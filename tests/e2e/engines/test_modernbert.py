"""ModernBERT served as its users run it (gte-modernbert-base, CLS pooling;
modernbert-embed-base, mean pooling; its cross-encoders), in process on the engine
`engine = "auto"` gives it, the torch engine's padding-free pass: parity with
sentence-transformers on tiny random folders whose local-attention window is shorter than
most inputs, and an input's answer in a batch of mixed lengths equal to its answer alone.
The pass against transformers' own padded forward: tests/e2e/engines/test_engines.py;
which engines serve it: tests/fast/test_engine_choice.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.kinds import TEXT, RawOutput
from infinity.shared.protocol import ModelSpec
from tests.support.modernbert import LOCAL_ATTENTION, save_tiny_modernbert, save_tiny_modernbert_embedder
from tests.support.tiny_models import WORDS
from workers.engines.packed_modernbert import PackedModernBert
from workers.engines.torch_engine import TorchEngine
from workers.heads import LoadedModel, load_model
from workers.preprocess.text import TokenItem, collate_tokens, load_tokenizer

FLOAT32_COSINE = 0.99999
# Words per text: [CLS] and [SEP] add two tokens; from within the local window to well past it.
_WORDS_PER_TEXT = (1, 3, LOCAL_ATTENTION, 2 * LOCAL_ATTENTION, 45, 5, 90)


def _texts() -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, count)) for count in _WORDS_PER_TEXT]


def _served_alone_and_together(model: LoadedModel, encodings: list) -> tuple[np.ndarray, np.ndarray]:
    """The model's answers for `encodings` (the server's tokenizer's), one pass per input and
    one pass over all of them."""
    def answers(chosen: list) -> np.ndarray:
        batch = collate_tokens([TokenItem(np.array(e.ids, dtype=np.int32)) for e in chosen], model.engine.pad_id)
        return np.asarray(model.forward(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]))

    return np.concatenate([answers([e]) for e in encodings]), answers(encodings)


def _load(folder: Path) -> tuple[ModelSpec, LoadedModel]:
    """The folder's spec as `engine = "auto"` resolves it, and its model, padding-free on torch."""
    spec = resolve_model(ModelConfig(name="modernbert", source=str(folder)))
    assert spec.engine == "torch"
    model = load_model(spec, threads=1)
    assert isinstance(model.engine._packed, PackedModernBert)
    return spec, model


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_an_embedder_gives_sentence_transformers_vectors_alone_and_in_a_mixed_batch(tmp_path, pooling):
    from sentence_transformers import SentenceTransformer

    folder = save_tiny_modernbert_embedder(tmp_path / "embedder", pooling)
    spec, model = _load(folder)
    texts = _texts()
    encodings = load_tokenizer(spec).encode_batch(texts)
    assert max(len(e.ids) for e in encodings) > 4 * LOCAL_ATTENTION
    alone, together = _served_alone_and_together(model, encodings)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert ((together * expected).sum(axis=1) >= FLOAT32_COSINE).all()
    assert ((alone * together).sum(axis=1) >= FLOAT32_COSINE).all()


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_cross_encoder_scores_as_sentence_transformers_alone_and_in_a_mixed_batch(tmp_path, pooling):
    """The classifier pools by the config's `classifier_pooling`."""
    from sentence_transformers import CrossEncoder

    folder = save_tiny_modernbert(tmp_path / "reranker", head="classifier", classifier_pooling=pooling)
    spec, model = _load(folder)
    assert (spec.kind, model.head.activation) == ("rerank", "sigmoid")
    query, documents = "the quick fox", _texts()
    pairs = load_tokenizer(spec).encode_batch([(query, document) for document in documents])
    alone, together = _served_alone_and_together(model, pairs)
    expected = CrossEncoder(str(folder), device="cpu").predict([(query, document) for document in documents])
    np.testing.assert_allclose(torch.sigmoid(torch.from_numpy(together)).numpy().ravel(), expected, atol=1e-5)
    np.testing.assert_allclose(alone, together, atol=1e-5)


def test_the_masked_language_model_head_runs_on_the_padding_free_states(tmp_path):
    """A sparse (SPLADE) ModernBERT's logits, at the attended tokens."""
    folder = save_tiny_modernbert(tmp_path / "masked-lm", head="masked-lm")
    spec = resolve_model(ModelConfig(name="modernbert", source=str(folder), engine="torch"))
    engine = TorchEngine(spec, threads=1, outputs={TEXT: RawOutput.TOKEN_LOGITS})
    assert isinstance(engine._packed, PackedModernBert)
    mask = np.zeros((2, 3 * LOCAL_ATTENTION), dtype=np.int64)
    mask[0], mask[1, :5] = 1, 1
    ids = np.where(mask == 1, np.arange(mask.size).reshape(mask.shape) % 100 + 5, engine.pad_id)
    packed = engine.forward(ids, mask, np.zeros_like(ids))
    with torch.inference_mode():
        padded = engine._padded(*(torch.from_numpy(a) for a in (ids, mask, np.zeros_like(ids))))
    keep = torch.from_numpy(mask).bool()
    torch.testing.assert_close(packed[keep], padded[keep], atol=1e-5, rtol=1e-4)
