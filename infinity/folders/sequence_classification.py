"""Sequence-classification folders (a transformers `*ForSequenceClassification`, saved by
transformers or by sentence-transformers' CrossEncoder): with one label the model
reranks (a cross-encoder's relevance), with several it classifies."""

from __future__ import annotations

from infinity.config import ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.folders import num_labels


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer",)


def detect(folder: ModelFolder) -> str | None:
    if any(a.endswith("ForSequenceClassification") for a in folder.config.get("architectures") or []):
        return "rerank" if num_labels(folder.config) == 1 else "classify"
    return None


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    return {}
