"""Sparse (SPLADE) models without weights: the head against sentence-transformers'
SpladePooling arithmetic on known logits, and the whole request path in one process
(tests/fast/inprocess.py) with a fake engine whose logits are known: TEI's
`/embed_sparse`, the sparse items of `/v1/embeddings`, `top_k` and the model's own
max_active_dims, `truncate: false` refusing a long input before the model runs."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from infinity.api.routes.common import ENGINE_CLIENT
from infinity.config import ModelConfig
from infinity.folders.resolve import packaged_model_folder, resolve_model
from tests.fast.inprocess import serving, token_states
from workers.heads.sparse import SparseWeights

pytestmark = pytest.mark.timeout(60)

TEXTS = ["a short sentence", "another, somewhat longer sentence about sparse vectors", "x"]
# The fake engine's logits per token: a small "vocabulary" keeps its warm-up quick (it
# computes no embedding lookup, so token ids beyond it are fine).
VOCABULARY = 64
MAX_ACTIVE_DIMS = 20


def sparse_folder(root: Path, max_active_dims: int | None = None) -> Path:
    """A SparseEncoder folder without weights: the packaged model's tokenizer and config
    (as a BERT masked language model of `VOCABULARY` logits), Transformer and
    SpladePooling (max, relu)."""
    source = packaged_model_folder()
    folder = root / "sparse"
    (folder / "1_SpladePooling").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "sentence_bert_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"],
                                                    "vocab_size": VOCABULARY}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}]))
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(
        {"pooling_strategy": "max", "activation_function": "relu", "embedding_dimension": None}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""}, "max_active_dims": max_active_dims}))
    return folder


def splade_pooling(logits: np.ndarray, mask: np.ndarray, pooling: str, activation: str) -> np.ndarray:
    """sentence-transformers' SpladePooling: masked logits, log(1 + relu) (twice for
    log1p_relu), then max or sum over tokens."""
    weights = np.log1p(np.maximum(logits * mask[..., None], 0))
    if activation == "log1p_relu":
        weights = np.log1p(weights)
    return weights.max(axis=1) if pooling == "max" else weights.sum(axis=1)


@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
def test_the_head_pools_as_splade_pooling_and_ignores_padding(pooling, activation):
    spec = msgspec.structs.replace(resolve_model(ModelConfig(name="m")), kind="sparse", pooling=pooling,
                                   sparse_activation=activation)
    head = SparseWeights(spec, {"vocab_size": 50})
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)) - 1
    mask = torch.zeros(3, 7, dtype=torch.int64)
    for row, length in enumerate((7, 2, 4)):
        mask[row, :length] = 1
    logits[mask == 0] = 100.0  # padding that counted would dominate every entry
    expected = splade_pooling(logits.numpy(), mask.numpy(), pooling, activation)
    for entries, vector in zip(head(logits, mask), expected, strict=True):
        assert entries["index"].tolist() == np.flatnonzero(vector).tolist()
        assert entries.dtype.names == ("index", "value") and entries["index"].dtype == np.int32
        np.testing.assert_allclose(entries["value"], vector[entries["index"]], rtol=1e-6)


def _token_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the packaged tokenizer.json pads to 128
    return [encoding.ids for encoding in tokenizer.encode_batch(texts)]


def _expected(folder: Path, texts: list[str], keep: int) -> list[tuple[list[int], list[float]]]:
    """What the fake engine's logits give through a max, relu SPLADE head, each input's
    `keep` largest values by index."""
    out = []
    for ids in _token_ids(folder, texts):
        weights = np.log1p(np.maximum(token_states(np.array(ids), VOCABULARY).max(axis=0), 0))
        indices = np.sort(np.argsort(-weights, kind="stable")[:keep])
        indices = indices[weights[indices] > 0]
        out.append((indices.tolist(), weights[indices].tolist()))
    return out


def test_embed_sparse_and_embeddings_answer_the_largest_weights_by_index(tmp_path):
    folder = sparse_folder(tmp_path, max_active_dims=MAX_ACTIVE_DIMS)

    async def test():
        async with serving(model=ModelConfig(name="s", source=str(folder), engine="torch")) as client:
            sparse = await (await client.post("/embed_sparse", json={"inputs": TEXTS})).json()
            items = await (await client.post("/v1/embeddings", json={"input": TEXTS, "top_k": 5})).json()
            card = (await (await client.get("/v1/models")).json())["data"][0]
        return sparse, items, card

    sparse, items, card = asyncio.run(test())
    assert (card["kind"], card["dimensions"]) == ("sparse", VOCABULARY)
    for entries, (indices, values) in zip(sparse, _expected(folder, TEXTS, MAX_ACTIVE_DIMS), strict=True):
        assert len(entries) == MAX_ACTIVE_DIMS  # the model's own max_active_dims
        assert [e["index"] for e in entries] == indices
        np.testing.assert_allclose([e["value"] for e in entries], values, rtol=1e-6)
    for item, (indices, values) in zip(items["data"], _expected(folder, TEXTS, 5), strict=True):
        assert item["embedding"]["indices"] == indices
        np.testing.assert_allclose(item["embedding"]["values"], values, rtol=1e-6)
    assert items["usage"]["prompt_tokens"] == sum(len(ids) for ids in _token_ids(folder, TEXTS))


def test_a_sparse_models_prompts_are_put_before_its_texts(tmp_path):
    """A SPLADE folder's query prompt, named on TEI's route or asked by input type on
    OpenAI's, goes before each text, as sentence-transformers' SparseEncoder puts it."""
    folder = sparse_folder(tmp_path)
    settings = folder / "config_sentence_transformers.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "prompts": {"query": "query: ", "document": ""}}))

    async def test():
        async with serving(model=ModelConfig(name="s", source=str(folder), engine="torch")) as client:
            named = await (await client.post("/embed_sparse", json={"inputs": TEXTS, "prompt_name": "query"})).json()
            typed = await (await client.post("/v1/embeddings", json={"input": TEXTS, "input_type": "query"})).json()
        return named, typed

    named, typed = asyncio.run(test())
    expected = _expected(folder, ["query: " + text for text in TEXTS], VOCABULARY)
    assert [[e["index"] for e in entries] for entries in named] == [indices for indices, _ in expected]
    assert [item["embedding"]["indices"] for item in typed["data"]] == [indices for indices, _ in expected]


def test_truncate_false_refuses_a_long_input_before_the_model_runs(tmp_path):
    folder = sparse_folder(tmp_path)
    long = " ".join(["sparse vectors"] * 20)

    async def test():
        async with serving(model=ModelConfig(name="s", source=str(folder), engine="torch", max_length=16)) as client:
            served = client.server.app[ENGINE_CLIENT].models["s"].served
            before = served.inputs
            refused = await client.post("/embed_sparse", json={"inputs": ["short", long], "truncate": False})
            computed = served.inputs - before
            cut = await client.post("/embed_sparse", json={"inputs": [long]})
            return refused.status, await refused.json(), computed, cut.status

    status, answer, computed, cut = asyncio.run(test())
    assert (status, answer["error"]["param"]) == (422, "truncate"), answer
    assert "input[1]" in answer["error"]["message"]
    assert computed == 0, "the model ran on a request it then refused"
    assert cut == 200  # as the model is set: cut at the end
