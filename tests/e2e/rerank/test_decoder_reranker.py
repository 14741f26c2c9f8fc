"""End to end: decoder rerankers (issue 55). One server serves a tiny Qwen3-Reranker in
both layouts users have: the hub's plain folder (a Qwen3ForCausalLM recognised by its
name, its model card's template applied by the server) and sentence-transformers 6's
CrossEncoder (a text-generation Transformer and LogitScore, its chat template read from
the folder). `/v1/rerank` on one query and documents of different lengths (one batch of
mixed lengths, padding-free on the Qwen3 body) must score as the references do: the
model card's recipe written here with transformers, one pair at a time, for the plain
folder; `CrossEncoder.predict` for the sentence-transformers folder; raw scores are the
logit of "yes" less that of "no"."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.support.server import models_toml, running_server

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5
QUERY = "the quick brown fox"
DOCUMENTS = ["a lazy dog", "the quick brown fox jumps over a lazy dog while seven wizards quietly judge",
             "yes", "boxing matches of jumbo sized vexing quartz sphinx numbers 0 1 2 3 4 5 6 7 8 9 " * 3]
# Qwen3-Reranker's model card, as its example code writes it.
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
               "<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.support.tiny_models import save_tiny_causal_reranker, save_tiny_logit_score_reranker

    root = tmp_path_factory.mktemp("decoder-rerankers")
    return {"plain": save_tiny_causal_reranker(root / "Qwen3-Reranker-0.6B"),
            "logit-score": save_tiny_logit_score_reranker(root / "st-causal-reranker")}


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("decoder-reranker-server")
    with running_server(config=models_toml(folders), log_dir=log_dir) as proc:
        yield proc


def card_logits(folder: Path, query: str, documents: list[str]) -> np.ndarray:
    """The model card's recipe, one pair at a time: prefix, formatted pair and suffix
    tokenized apart and joined, the causal LM's logits at the last token, "yes" less "no"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(CARD_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(CARD_SUFFIX, add_special_tokens=False)
    logits = []
    for document in documents:
        pair = f"<Instruct>: {CARD_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = prefix + tokenizer(pair, add_special_tokens=False)["input_ids"] + suffix
        with torch.inference_mode():
            last = model(torch.tensor([ids])).logits[0, -1]
        logits.append(float(last[yes] - last[no]))
    return np.array(logits)


def served(server, model: str, raw: bool = False) -> np.ndarray:
    response = server.post("/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS,
                                          "raw_scores": raw})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    by_index = {r["index"]: r["relevance_score"] for r in results}
    return np.array([by_index[i] for i in range(len(DOCUMENTS))])


def test_plain_folder_scores_as_its_model_card(server, folders):
    logits = card_logits(folders["plain"], QUERY, DOCUMENTS)
    np.testing.assert_allclose(served(server, "plain", raw=True), logits, atol=TOLERANCE)
    np.testing.assert_allclose(served(server, "plain"), [1 / (1 + math.exp(-x)) for x in logits], atol=TOLERANCE)
    # The scores differ by document (a template that lost the document would score alike).
    assert np.ptp(logits) > 1e-3


def test_logit_score_folder_scores_as_cross_encoder(server, folders):
    import torch
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(str(folders["logit-score"]), device="cpu")
    pairs = [(QUERY, document) for document in DOCUMENTS]
    np.testing.assert_allclose(served(server, "logit-score"), cross_encoder.predict(pairs), atol=TOLERANCE)
    raw = cross_encoder.predict(pairs, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(served(server, "logit-score", raw=True), raw, atol=TOLERANCE)
    assert np.ptp(raw) > 1e-3


def test_top_n_and_documents(server):
    response = server.post("/v1/rerank", {"model": "plain", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                          "return_documents": True})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    best = np.argsort(-served(server, "plain"))[:2]
    assert [r["index"] for r in results] == list(best)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in best]
