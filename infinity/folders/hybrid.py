"""Hybrid (BGE-M3) model folders, as FlagEmbedding publishes them: an encoder (XLM-RoBERTa
for BGE-M3 itself) with two torch `Linear` state dicts beside its weights,
`sparse_linear.pt` (hidden -> 1: each token's weight) and `colbert_linear.pt` (hidden ->
the width of its vectors per token). One pass gives its three outputs
(`workers.heads.hybrid`), read as FlagEmbedding's `BGEM3FlagModel` reads them."""

from __future__ import annotations

from infinity.config import ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.folders import COLBERT_LINEAR, SPARSE_LINEAR


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "Pooling", "Normalize")


def detect(folder: ModelFolder) -> str | None:
    linears = (folder.transformer / SPARSE_LINEAR, folder.transformer / COLBERT_LINEAR)
    return "hybrid" if all(path.is_file() for path in linears) else None


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    """The dense vector is the first token's state unless configured (FlagEmbedding's
    default `pooling_method`, whatever a Pooling module beside it says: FlagEmbedding does
    not read one). Both the dense vector and the vectors per token are normalised unless
    `normalize = false` (its `normalize_embeddings`), the default of every folder."""
    return {"pooling": model.pooling or "cls"}
