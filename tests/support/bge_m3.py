"""BGE-M3 at test time: a tiny random folder in the layout FlagEmbedding publishes, and
FlagEmbedding's own computations of its three outputs and of its hybrid score, to hold
the server's `kind = "hybrid"` answers to.

FlagEmbedding (1.4.2, the newest) installs beside this project's pins but does not
import under transformers 5: its package's `__init__` imports a MiniCPM reranker that
needs `transformers.modeling_attn_mask_utils`, which transformers 5 removed. Its
computations are therefore restated here from its source, line by line:

- `FlagEmbedding/finetune/embedder/encoder_only/m3/runner.py`, `get_model` (lines 43-103):
  the encoder by `AutoModel`, `colbert_linear = Linear(hidden, hidden or colbert_dim)` and
  `sparse_linear = Linear(hidden, 1)` loaded from `colbert_linear.pt` and `sparse_linear.pt`;
- `FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py`: `_dense_embedding`
  (lines 81-114: "cls" pooling is `last_hidden_state[:, 0]`), `_sparse_embedding`
  (116-157: `torch.relu(self.sparse_linear(hidden_state))`), `_colbert_embedding`
  (159-171: `colbert_linear(last_hidden_state[:, 1:]) * mask[:, 1:][:, :, None]`), and
  `EncoderOnlyEmbedderM3ModelForInference.forward` (528-580: the dense and colbert
  vectors `F.normalize`d, `normalize_embeddings` being True by default);
- `FlagEmbedding/inference/embedder/encoder_only/m3.py`, `encode_single_device`
  (312-489): `_process_token_weights` (354-369: per token id the largest weight above 0,
  the cls, eos, pad and unk tokens left out) and `_process_colbert_vecs` (371-374:
  `colbert_vecs[:tokens_num - 1]`); `compute_score_single_device` (602-735): the
  "colbert+sparse+dense" score, with the default weights [1, 1, 1] the weighted mean of
  the dense dot product, the sparse dot product (`compute_sparse_score` over the
  vocabulary-wide weights) and the ColBERT score (`compute_colbert_score`, modeling.py
  223-237: the sum over query vectors of the best dot product, divided by the query's
  tokens after the first).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from tests.support.tiny_models import WORDS

# XLM-RoBERTa's special tokens, in its order.
SPECIAL_TOKENS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                  "mask_token": "<mask>"}
# The tokens FlagEmbedding leaves out of the sparse weights (`_process_token_weights`).
UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def save_tiny_bge_m3(folder: Path, seed: int = 0, colbert_dim: int = 16) -> Path:
    """A BGE-M3 folder as FlagEmbedding publishes it, at a tiny size: a 2-layer
    XLM-RoBERTa (hidden size 32, 64 tokens) with random weights from `seed`, a WordPiece
    vocabulary under XLM-RoBERTa's special tokens (`<s> $A </s>`), and random
    `sparse_linear.pt` (32 -> 1) and `colbert_linear.pt` (32 -> `colbert_dim`) state dicts.
    About half the tokens get a sparse weight above zero, as relu leaves them."""
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _xlm_roberta_style_tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, cls_token="<s>", sep_token="</s>", model_max_length=64,
                            model_input_names=["input_ids", "attention_mask"],
                            **SPECIAL_TOKENS).save_pretrained(folder)
    pad = tokenizer.token_to_id("<pad>")
    config = XLMRobertaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64, max_position_embeddings=64 + pad + 2,
                              pad_token_id=pad, bos_token_id=tokenizer.token_to_id("<s>"),
                              eos_token_id=tokenizer.token_to_id("</s>"), initializer_range=0.4)
    torch.manual_seed(seed)
    XLMRobertaModel(config).eval().save_pretrained(folder)
    torch.save(torch.nn.Linear(32, 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(32, colbert_dim).state_dict(), folder / "colbert_linear.pt")
    return folder


def _xlm_roberta_style_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=list(SPECIAL_TOKENS.values()),
                                        show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))], trainer)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return tokenizer


class FlagEmbeddingM3:
    """FlagEmbedding's `BGEM3FlagModel` on a folder, in float32 on the CPU (see the
    module's docstring for the lines each step restates)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()
        hidden = self.model.config.hidden_size
        colbert = torch.load(folder / "colbert_linear.pt", map_location="cpu", weights_only=True)
        self.colbert_linear = torch.nn.Linear(hidden, colbert["weight"].shape[0])
        self.colbert_linear.load_state_dict(colbert)
        self.sparse_linear = torch.nn.Linear(hidden, 1)
        self.sparse_linear.load_state_dict(torch.load(folder / "sparse_linear.pt", map_location="cpu",
                                                      weights_only=True))
        special = self.tokenizer.special_tokens_map
        self.unused_tokens = {self.tokenizer.convert_tokens_to_ids(special[token]) for token in UNUSED_TOKENS
                              if token in special}

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict[str, list]:
        """`encode(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True)`:
        "dense_vecs" (one vector each), "lexical_weights" ({token id: weight} each) and
        "colbert_vecs" (a matrix each), from one padded batch."""
        batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        states = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"]
        dense = torch.nn.functional.normalize(states[:, 0], dim=-1)
        token_weights = torch.relu(self.sparse_linear(states)).squeeze(-1)
        colbert = self.colbert_linear(states[:, 1:]) * mask[:, 1:][:, :, None].float()
        colbert = torch.nn.functional.normalize(colbert, dim=-1)
        lexical = []
        for weights, ids in zip(token_weights.numpy(), batch["input_ids"].tolist()):
            result: dict[int, float] = {}
            for weight, token_id in zip(weights, ids):
                if token_id not in self.unused_tokens and weight > 0 and weight > result.get(token_id, 0):
                    result[token_id] = float(weight)
            lexical.append(result)
        return {"dense_vecs": list(dense.numpy()), "lexical_weights": lexical,
                "colbert_vecs": [vectors[:int(length) - 1] for vectors, length in zip(colbert.numpy(), mask.sum(1))]}

    def compute_score(self, query: str, documents: list[str]) -> list[float]:
        """`compute_score([(query, document), ...])["colbert+sparse+dense"]` with the
        default weights: each pair encoded apart, as a batch of one pair does."""
        (dense,), (lexical,), (vectors,) = self.encode([query]).values()
        scores = []
        for document in documents:
            (document_dense,), (document_lexical,), (document_vectors,) = self.encode([document]).values()
            sparse = sum(weight * document_lexical.get(token_id, 0.0) for token_id, weight in lexical.items())
            colbert = (vectors @ document_vectors.T).max(axis=1).sum() / len(vectors)
            scores.append(float((dense @ document_dense + sparse + colbert) / 3))
        return scores


def sparse_as_dict(entries: list[dict]) -> dict[int, float]:
    """An `/embed_sparse` answer's `{index, value}` entries as {token id: weight}."""
    return {entry["index"]: entry["value"] for entry in entries}


def assert_same_weights(served: dict[int, float], reference: dict[int, float]) -> None:
    """The same token ids, each weight within 1e-5."""
    assert sorted(served) == sorted(reference)
    np.testing.assert_allclose([served[i] for i in sorted(served)], [reference[i] for i in sorted(reference)],
                               atol=1e-5)
